"""A running scan's event log, mirrored to a Redis Stream, so any replica can follow it.

One stream per scan, `<prefix>:scan:<id>:events`: one stream entry per log entry, its
stream ID `<seq>-0` (so a `Last-Event-ID` is a stream position) and one field, `e`, the
entry exactly as the stored event log holds it (`[seq, progress, kind, step, fields]`,
see `EventLog.to_json`). A replica that follows the stream therefore sends the bytes
the owner sends and the stored replay sends.

Writing, on the replica that runs the scan: `mirror` starts a watcher that follows the
scan's `EventLog` and marks the scan pending on every entry; one writer task per
process flushes every pending scan's unwritten entries in one script call
(`_APPEND`: idempotent per seq, `MAXLEN ~`, an expiry). The scan task never waits for
Redis. A failed flush is counted, logged once per outage and retried every
`MIRROR_RETRY_S` with all that is not yet written; a scan that ended more than
`STREAM_KEPT_AFTER_END_S` ago is given up (its row holds its events). The terminal
entry reaches the stream after the row commit, because it reaches the log after it.

Following, on another replica (`follow`): the entries after the client's position
(XRANGE), then XREAD BLOCK, one block at most `block_s` (the SSE ping interval), until
the terminal entry. Before the response starts, no stream, a stream that does not hold
the position (trimmed) or a failing Redis is 409 `SCAN_RUNNING_ELSEWHERE`, as without
Redis. Once it has started, a Redis failure ends the response without a terminal event:
the client reconnects with its `Last-Event-ID`, as after any dropped connection, and
reads on from whichever replica (or the database) can serve it then.

Each follow holds a slot of `FollowerCaps` (app/scans/followers.py) from before its
response starts until the response closes it (`Following.aclose`): per user, per scan and
no more than the blocking client's connections, whose pool waits for a free connection
at most `REDIS_TIMEOUT_S` should one ever be short.

A follower renews a lease, `<prefix>:scan:<id>:followed`, before a block (at most once
a block); the owner, when its own last follower left and the disconnect grace ran out,
keeps the scan running while that lease exists (`followed_elsewhere`, app/scans/run.py).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as redis

from app.errors import ScanRunningElsewhere
from app.runtime.metrics import Metrics
from app.runtime.redis_link import RedisError, RedisLink, connection_options
from app.scans.events import EventLog, LogEntry, RecordedEvent
from app.scans.followers import FollowerCaps, FollowerSlot

log = logging.getLogger(__name__)

# A scan's stream keeps about this many entries (MAXLEN ~); a scan sends a few hundred at
# most (deltas every DELTA_FLUSH_MS, bounded by the answer's token cap).
STREAM_MAX_EVENTS = 4096
# While a scan runs, its stream outlives its last write by SCAN_DEADLINE_S plus this...
STREAM_TTL_PAST_DEADLINE_S = 300.0
# ...and once its terminal entry is written, by this: followers that raced the row's
# commit still find the end, later ones read the database.
STREAM_KEPT_AFTER_END_S = 60.0
# After a failed flush, the next attempt (with everything not yet written).
MIRROR_RETRY_S = 1.0
# Entries per flush (one script call) and per read: bounds the event loop's JSON work
# and the script's run time in Redis; the rest goes in the next flush or read.
FLUSH_MAX_ENTRIES = 512
READ_MAX_ENTRIES = 256
# Blocked XREADs in progress at once, each on a connection of its own.
FOLLOW_MAX_CONNECTIONS = 256
# A follower's lease lasts this many blocks: renewed before each, it outlives a block
# and a slow send.
FOLLOWER_LEASE_BLOCKS = 3

# KEYS: per scan, its stream and its input's key. ARGV: MAXLEN, then per scan: expiry
# (ms), its input (the JSON to keep, '-' to drop it: the scan ended, '' to keep what is
# there), n, n x (seq, entry). Entries at or below what a stream holds are skipped (a
# flush retried after a lost reply). Returns per scan the last seq its stream holds, or
# -1 if it could not be read.
_APPEND = """
local maxlen, i, tops = ARGV[1], 2, {}
for k = 1, #KEYS, 2 do
  local key, input_key = KEYS[k], KEYS[k + 1]
  local ttl, input, n = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local top = redis.pcall('XREVRANGE', key, '+', '-', 'COUNT', 1)
  local last = -1
  if type(top) == 'table' and not top['err'] then
    last = 0
    if #top > 0 then last = tonumber(string.match(top[1][1], '^%d+')) end
    for j = i + 3, i + 1 + 2 * n, 2 do
      local seq = tonumber(ARGV[j])
      if seq > last then
        redis.call('XADD', key, 'MAXLEN', '~', maxlen, ARGV[j] .. '-0', 'e', ARGV[j + 1])
        last = seq
      end
    end
    redis.call('PEXPIRE', key, ttl)
    if input == '-' then
      redis.call('DEL', input_key)
    elseif input ~= '' then
      redis.call('SET', input_key, input, 'PX', ttl)
    else
      redis.call('PEXPIRE', input_key, ttl)
    end
  end
  tops[#tops + 1] = last
  i = i + 3 + 2 * n
end
return tops
"""


# Asked by a follower after an idle block, with its position and progress: None while
# the scan's row is `running`; else the row's entries after that position, its terminal
# one last (app/streaming/access.py).
Ending = Callable[[int, int], Awaitable[list[LogEntry] | None]]

_NOT_FOLLOWABLE = (
    "The scan runs on another replica and cannot be followed from here right now; "
    "retry, or read its events once it has finished."
)


@dataclass
class _Mirror:
    """One scan's log and how much of it its stream holds."""

    key: str
    input_key: str
    log: EventLog
    written: int = 0
    ended_at: float | None = None  # loop time the terminal entry was seen
    # What another replica needs to take the scan over (app/scans/liveness.py), until sent.
    scan_input: bytes | None = None

    def unwritten(self, limit: int) -> list[LogEntry]:
        return self.log.entries[self.written : self.written + limit]


class Following:
    """A follow's entries; holds its follower slot until closed. A class, not a generator:
    the response closes its body however it ends, before the first entry too, and a
    generator never started runs no `finally`."""

    def __init__(self, entries: AsyncGenerator[LogEntry, None], slot: FollowerSlot) -> None:
        self._entries = entries
        self._slot = slot

    def __aiter__(self) -> Following:
        return self

    async def __anext__(self) -> LogEntry:
        try:
            return await self._entries.__anext__()
        except BaseException:  # its end, or Redis's: no more entries come
            self._slot.release()
            raise

    async def aclose(self) -> None:
        self._slot.release()
        await self._entries.aclose()


class ScanStreams:
    def __init__(
        self,
        link: RedisLink,
        metrics: Metrics,
        *,
        scan_deadline_s: float,
        block_s: float,
        caps: FollowerCaps | None = None,
    ) -> None:
        self._link = link
        self._metrics = metrics
        self.caps = caps or FollowerCaps(
            per_user=FOLLOW_MAX_CONNECTIONS, per_scan=FOLLOW_MAX_CONNECTIONS, total=FOLLOW_MAX_CONNECTIONS
        )
        self.caps.total = min(self.caps.total, FOLLOW_MAX_CONNECTIONS)  # never more than connections
        # No scan runs longer than this: how long a stream outlives a write, and a follow lasts.
        self._running_ttl_s = scan_deadline_s + STREAM_TTL_PAST_DEADLINE_S
        self._block_s = block_s
        self._lease_ms = int(FOLLOWER_LEASE_BLOCKS * block_s * 1000)
        self._append = link.script(_APPEND)
        # XREAD BLOCK outlasts the link's socket timeout: its own client, one block longer.
        # A pool that waits (at most REDIS_TIMEOUT_S) for a connection rather than failing
        # at once; the follower slots never outnumber its connections.
        pool = redis.BlockingConnectionPool.from_url(
            link.url,
            max_connections=FOLLOW_MAX_CONNECTIONS,
            timeout=link.timeout_s,
            socket_timeout=block_s + link.timeout_s,
            **connection_options(link.timeout_s),  # a restarted Redis: one retry, on a fresh connection
        )
        self._blocking: redis.Redis = redis.Redis.from_pool(pool)
        self._watchers: dict[asyncio.Task[None], _Mirror] = {}
        self._pending: dict[str, _Mirror] = {}
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._outage = False  # writing failed, logged once
        self._follow_outage = False  # reading failed, logged once

    def events_key(self, scan_id: uuid.UUID) -> str:
        return self._link.key("scan", str(scan_id), "events")

    def input_key(self, scan_id: uuid.UUID) -> str:
        return self._link.key("scan", str(scan_id), "input")

    def _lease_key(self, scan_id: uuid.UUID) -> str:
        return self._link.key("scan", str(scan_id), "followed")

    # --- writing ------------------------------------------------------------------

    def mirror(
        self, scan_id: uuid.UUID, events: EventLog, *, scan_input: bytes | None = None, written: int = 0
    ) -> None:
        """Mirror `events` (from entry `written + 1` to its terminal one) to the scan's
        stream, and keep `scan_input` beside it while the scan runs."""
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_forever(), name="scan-streams-writer")
        mirror = _Mirror(self.events_key(scan_id), self.input_key(scan_id), events, written, None, scan_input)
        if scan_input is not None or written < len(events.entries):
            self._pending[mirror.key] = mirror
            self._wake.set()
        watcher = asyncio.create_task(self._watch(mirror), name=f"scan-stream-{scan_id}")
        self._watchers[watcher] = mirror
        watcher.add_done_callback(self._watchers.pop)

    async def _watch(self, mirror: _Mirror) -> None:
        async for entry in mirror.log.follow():
            if entry.event.terminal:
                mirror.ended_at = asyncio.get_running_loop().time()
            self._pending[mirror.key] = mirror
            self._wake.set()

    async def _write_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                flushed = await self._flush()
            except Exception:  # a bug must not end mirroring for every later scan
                log.exception("mirroring running scans' events failed unexpectedly")
                flushed = False
            if not flushed:
                await asyncio.sleep(MIRROR_RETRY_S)
                self._wake.set()

    async def _flush(self) -> bool:
        """One script call for what the pending scans have not written (up to
        `FLUSH_MAX_ENTRIES`); False if Redis failed."""
        batch, keys = [], []
        args: list[Any] = [STREAM_MAX_EVENTS]
        room = FLUSH_MAX_ENTRIES
        for mirror in list(self._pending.values()):
            entries = mirror.unwritten(room)
            if not entries and mirror.scan_input is not None and mirror.log.entries:
                entries = mirror.log.entries[-1:]  # the input goes with an entry (seq-idempotent)
            if not entries:  # marked again after a flush that had already taken its entry
                del self._pending[mirror.key]
                continue
            room -= len(entries)
            batch.append(mirror)
            keys += [mirror.key, mirror.input_key]
            ended = entries[-1].event.terminal
            ttl_s = STREAM_KEPT_AFTER_END_S if ended else self._running_ttl_s
            scan_input = b"-" if ended else (mirror.scan_input or b"")
            args += [int(ttl_s * 1000), scan_input, len(entries), *_flatten(entries)]
            if room == 0:
                break
        try:
            tops = await self._append(keys=keys, args=args) if batch else []
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return False
        return self._written(batch, [int(top) for top in tops])

    def _written(self, batch: list[_Mirror], tops: list[int]) -> bool:
        """Note what each stream holds now; False if one of them could not be written."""
        unwritable = [mirror.key for mirror, top in zip(batch, tops, strict=True) if top < 0]
        for mirror, top in zip(batch, tops, strict=True):
            self._metrics.stream_events_mirrored.inc(max(0, top - mirror.written))
            mirror.written = max(mirror.written, top)
            if top >= 0:
                mirror.scan_input = None
            if mirror.written >= len(mirror.log.entries):
                self._pending.pop(mirror.key, None)
            else:
                self._wake.set()  # more than one flush held
        if unwritable:
            self._failed(RedisError(f"not a stream: {', '.join(unwritable)}"))
            return False
        if self._outage and batch:
            self._outage = False
            log.info("Redis: running scans' events are mirrored again")
        return True

    def _failed(self, exc: Exception) -> None:
        self._metrics.stream_mirror_failures.inc()
        if not self._outage:
            self._outage = True
            log.warning(
                "Redis: mirroring running scans' events failed (%s); retrying every %.0f s, "
                "other replicas answer 409 for them meanwhile",
                exc,
                MIRROR_RETRY_S,
            )
        now = asyncio.get_running_loop().time()
        for key, mirror in list(self._pending.items()):
            if mirror.ended_at is not None and now - mirror.ended_at > STREAM_KEPT_AFTER_END_S:
                del self._pending[key]  # no follower can need it any more: the row has it

    async def close(self) -> None:
        """Stop writing, after one last flush of what is still unwritten (bounded by
        REDIS_TIMEOUT_S); the scans have ended by now (`ScanPipeline.cancel_all`)."""
        for mirror in self._watchers.values():
            if mirror.written < len(mirror.log.entries):
                self._pending[mirror.key] = mirror
        tasks = [*self._watchers, *([self._writer] if self._writer else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        while self._pending and await self._flush():
            pass
        await self._blocking.aclose()

    # --- following ----------------------------------------------------------------

    async def followed_elsewhere(self, scan_id: uuid.UUID) -> bool:
        """Whether a replica other than the owner follows the scan now (its lease exists)."""
        try:
            return bool(await self._link.client.exists(self._lease_key(scan_id)))
        except (RedisError, OSError):
            return False

    async def recorded(self, scan_id: uuid.UUID) -> tuple[list[LogEntry], bytes | None]:
        """What a scan's owner left here: its mirrored entries and the input it kept
        (app/scans/liveness.py takes a dead owner's scans over from them)."""
        async with self._link.client.pipeline(transaction=False) as pipe:
            pipe.xrange(self.events_key(scan_id), count=STREAM_MAX_EVENTS)
            pipe.get(self.input_key(scan_id))
            found, scan_input = await pipe.execute()
        return _entries(found), scan_input

    async def follow(
        self, scan_id: uuid.UUID, after: int, *, ended_after: Ending, follower: str = ""
    ) -> Following | None:
        """The scan's entries after `after`, live until its terminal one; None when the
        stream ended at or before `after` (204). `ScanRunningElsewhere` (409) when the
        stream cannot serve the position; `FollowerLimit` (429) when `follower` (the
        caller's rate key) or the scan has its share of followers. `ended_after` is asked
        after an idle block: a scan whose row ended without its end reaching the stream (a
        sweep) ends the follow with the row's terminal entry."""
        try:
            slot = self.caps.take(follower, scan_id)
        except Exception:
            self._metrics.stream_follows.labels("limited").inc()
            raise
        try:
            entries = await self._probed(scan_id, after, ended_after)
        except BaseException:
            slot.release()
            raise
        if entries is None:
            slot.release()
            return None
        return Following(entries, slot)

    async def _probed(
        self, scan_id: uuid.UUID, after: int, ended_after: Ending
    ) -> AsyncGenerator[LogEntry, None] | None:
        key = self.events_key(scan_id)
        try:
            first, last = await self._probe(key, after)
        except (RedisError, OSError) as exc:
            self._metrics.stream_follows.labels("refused").inc()
            self._follow_failed(exc)
            raise ScanRunningElsewhere(_NOT_FOLLOWABLE) from None
        self._follow_outage = False
        if last is not None and last.event.terminal and after >= last.seq:
            return None
        if last is None or (first and first[0].seq != after + 1):
            self._metrics.stream_follows.labels("refused").inc()
            raise ScanRunningElsewhere(_NOT_FOLLOWABLE)
        self._metrics.stream_follows.labels("served").inc()
        return self._follow(scan_id, first, after, ended_after)

    async def _probe(self, key: str, after: int) -> tuple[list[LogEntry], LogEntry | None]:
        """What follows `after`, and the stream's last entry (None: no stream), at once."""
        async with self._link.client.pipeline(transaction=False) as pipe:
            pipe.xrange(key, min=f"{after + 1}-0", count=READ_MAX_ENTRIES)
            pipe.xrevrange(key, count=1)
            following, last = await pipe.execute()
        return _entries(following), next(iter(_entries(last)), None)

    async def _follow(
        self,
        scan_id: uuid.UUID,
        entries: list[LogEntry],
        position: int,
        ended_after: Ending,
    ) -> AsyncGenerator[LogEntry, None]:
        key, lease = self.events_key(scan_id), self._lease_key(scan_id)
        loop = asyncio.get_running_loop()
        give_up_at, renewed_at = loop.time() + self._running_ttl_s, -self._block_s
        progress = 0
        try:
            while True:
                for entry in entries:
                    position, progress = entry.seq, entry.progress
                    yield entry
                    if entry.event.terminal:
                        return
                if loop.time() - renewed_at >= self._block_s:
                    await self._link.client.set(lease, b"1", px=self._lease_ms)
                    renewed_at = loop.time()
                entries = await self._read_after(key, position)
                if entries:
                    continue
                if loop.time() > give_up_at:
                    return
                ended = await ended_after(position, progress)
                if ended is not None:  # the row ended without its end reaching the stream
                    entries = ended
                    if not entries:
                        return
        except (RedisError, OSError) as exc:
            self._metrics.stream_follows.labels("cut").inc()
            self._follow_failed(exc)

    def _follow_failed(self, exc: Exception) -> None:
        if not self._follow_outage:
            self._follow_outage = True
            log.warning(
                "Redis: following scans of other replicas failed (%s); their events answer 409, "
                "and streams that were following them ended, until Redis answers",
                exc,
            )

    async def _read_after(self, key: str, position: int) -> list[LogEntry]:
        block_ms = int(self._block_s * 1000)
        reply: Any = await self._blocking.xread(
            {key: f"{position}-0"}, count=READ_MAX_ENTRIES, block=block_ms
        )
        return [entry for _, found in reply or [] for entry in _entries(found)]


def _flatten(entries: list[LogEntry]) -> list[Any]:
    """`seq, entry-json` pairs for `_APPEND`; each entry as `EventLog.to_json` stores it."""
    pairs: list[Any] = []
    for e in entries:
        record = [e.seq, e.progress, e.event.kind, e.event.step, e.event.fields()]
        pairs += [e.seq, orjson.dumps(record)]
    return pairs


def _entries(reply: list[tuple[bytes, dict[bytes, bytes]]]) -> list[LogEntry]:
    entries = []
    for _, fields in reply:
        seq, progress, kind, step, recorded = orjson.loads(fields[b"e"])
        entries.append(LogEntry(seq, progress, RecordedEvent(kind=kind, step=step, recorded=recorded)))
    return entries
