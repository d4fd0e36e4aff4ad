"""Liveness leases, and the takeover of scans whose process died (REDIS_URL).

Every process renews a lease every `LIVENESS_RENEW_S`: its instance id in the sorted set
`<prefix>:instances`, scored with the time (Redis's clock) at which it lapses,
`LIVENESS_TTL_S` later. The same script call returns the instances whose lease has
lapsed. For each, this process claims its `running` scans (`ScanStore.claim_orphans`:
the row's instance column decides, so each scan goes to one replica; the dead instance
must also hold no database connection, a second witness that keeps a live process cut
off from Redis alone from having its scans run twice) and, per scan:

- `TAKEOVER=true`, the input the owner kept in Redis (app/scans/handover.py) readable,
  and time left before the scan's deadline (a slot here it always gets: `Admission.adopt`,
  no budget look-ahead or cap refuses a scan already accepted and paid for): the scan
  runs on here from its mirrored event log (`ScanPipeline.adopt`): stages it completed
  are not run again, `seq` goes on where the stream stopped, so a reader that follows
  (or resumes with `Last-Event-ID`) sees one stream and one terminal event;
- otherwise it ends here at once with `error` `PROCESS_LOST` (retryable): the row, then
  the event, which reaches the stream any follower reads.

Either way a follower on any replica has its terminal event within a renew interval or
two of the lease lapsing. Judging begins only after this process has renewed its own
lease for a whole TTL without a failure: after a Redis outage, every live process has
renewed by then. Rows no one claims (no replica with Redis, or an instance forgotten
`LEASE_FORGOTTEN_AFTER_S` after it lapsed) are the lost-scan sweep's, as without Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import asyncpg

from app.errors import DatabaseError, ProcessLost
from app.limits.admission import Admission, Ticket
from app.runtime.metrics import Metrics
from app.runtime.redis_link import RedisError, RedisLink
from app.scans.handover import Handover
from app.scans.mirror import ScanStreams
from app.scans.pipeline import ScanPipeline
from app.scans.store import ScanStore

log = logging.getLogger(__name__)

# Scans claimed per statement; a dead instance's rest are claimed by the next ones.
CLAIM_BATCH = 32
# Lapsed instances judged per renewal.
LAPSED_PER_RENEWAL = 16
# A lapsed lease is forgotten this long after it lapsed: its rows, if any are left, are
# the lost-scan sweep's.
LEASE_FORGOTTEN_AFTER_S = 120.0
FORGET_MS = int(LEASE_FORGOTTEN_AFTER_S * 1000)
# A scan with less time than this before its deadline is not worth taking over.
MIN_TIME_LEFT_S = 1.0

# KEYS: the instances' lease set. ARGV: me, ttl (ms), forget (ms), how many lapsed to return.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'LIMIT', 0, tonumber(ARGV[4]))
"""


def _instances_key(link: RedisLink) -> str:
    return link.key("instances")


async def leased_instances(link: RedisLink) -> list[uuid.UUID]:
    """Instances holding a lease, or lately lapsed (the sweep spares their rows: they are
    takeover's); none when Redis does not answer (the sweep then decides alone)."""
    try:
        members: Any = await link.client.zrange(_instances_key(link), 0, -1)
    except (RedisError, OSError):
        return []
    return [uuid.UUID(m.decode()) for m in members]


class NoTicket(Ticket):
    """Holds no admission: the scan it goes with ends at once (PROCESS_LOST)."""

    __slots__ = ()

    def __init__(self) -> None:  # no super().__init__: nothing was admitted
        self._released = True
        self.owed = 0


class Liveness:
    def __init__(
        self,
        link: RedisLink,
        *,
        store: ScanStore,
        pipeline: ScanPipeline,
        streams: ScanStreams,
        admission: Admission,
        metrics: Metrics,
        ttl_s: float,
        renew_s: float,
        takeover: bool,
    ) -> None:
        self._link = link
        self._store = store
        self._pipeline = pipeline
        self._streams = streams
        self._admission = admission
        self._metrics = metrics
        self._ttl_s = ttl_s
        self._renew_s = renew_s
        self._takeover = takeover
        self._me = str(store.instance_id)
        self._key = _instances_key(link)
        self._renew = link.script(_RENEW)
        self._adopting: asyncio.Task[None] | None = None
        self._outage = False

    async def run(self) -> None:
        """Renew every `renew_s`; judge lapsed leases once renewing has held for a TTL."""
        loop = asyncio.get_running_loop()
        holding_since: float | None = None
        while True:
            try:
                lapsed = await self._renew(
                    keys=[self._key],
                    args=[self._me, int(self._ttl_s * 1000), FORGET_MS, LAPSED_PER_RENEWAL],
                )
            except (RedisError, OSError) as exc:
                holding_since = None
                if not self._outage:
                    self._outage = True
                    log.warning("Redis: renewing this process's liveness lease failed (%s)", exc)
            else:
                if self._outage:
                    self._outage = False
                    log.info("Redis: liveness lease renewed again")
                now = loop.time()
                holding_since = now if holding_since is None else holding_since
                dead = [uuid.UUID(m.decode()) for m in lapsed if m.decode() != self._me]
                if dead and now - holding_since >= self._ttl_s and self._idle():
                    self._adopting = asyncio.create_task(self._take_over(dead), name="scan-takeover")
            await asyncio.sleep(self._renew_s)

    def _idle(self) -> bool:
        return (self._adopting is None or self._adopting.done()) and self._pipeline.accepting

    async def close(self) -> None:
        """Stop, and give the lease back: this process's scans have ended by now."""
        if self._adopting is not None:
            self._adopting.cancel()
            await asyncio.gather(self._adopting, return_exceptions=True)
        with contextlib.suppress(RedisError, OSError):  # else it lapses by itself
            await self._link.client.zrem(self._key, self._me)

    async def _take_over(self, dead: list[uuid.UUID]) -> None:
        for instance in dead:
            try:
                await self._claim_all(instance)
            except DatabaseError:
                log.warning("takeover of instance %s: database unavailable; will retry", instance)
                return
            except (RedisError, OSError) as exc:
                log.warning("takeover of instance %s: Redis failed (%s); will retry", instance, exc)
                return

    async def _claim_all(self, dead: uuid.UUID) -> None:
        while self._pipeline.accepting:
            rows = await self._store.claim_orphans(dead, CLAIM_BATCH)
            for row in rows:
                await self._adopt(row, dead)
            if len(rows) < CLAIM_BATCH:
                break
        if not await self._store.runs_any(dead):
            await self._link.client.zrem(self._key, str(dead))
            log.info("instance %s: liveness lease lapsed, nothing of it left running", dead)

    async def _adopt(self, row: asyncpg.Record, row_owner: uuid.UUID) -> None:
        scan_id = row["id"]
        try:
            entries, raw = await self._streams.recorded(scan_id)
        except (RedisError, OSError):
            entries, raw = [], None
        handover = Handover.decode(raw) if raw else None
        if entries and [e.seq for e in entries] != list(range(1, len(entries) + 1)):
            entries = []  # trimmed: its log cannot be rebuilt
        if entries and entries[-1].event.terminal:
            entries = entries[:-1]  # its end never reached the row: it ends again, here
        reason, left_s = self._why_not(handover, entries)
        ticket: Ticket = NoTicket()
        if reason is None and handover is not None:
            ticket = self._admission.adopt(handover.rate_key)
        scan = (handover or _unknown(row)).accepted(scan_id, ticket)
        run = self._pipeline.adopt(
            scan, entries, deadline_s=left_s, token_sha256=row["token_sha256"], lost=reason
        )
        run.created_at = row["created_at"]
        outcome = "lost" if reason is not None else "resumed"
        self._metrics.scans_taken_over.labels(outcome).inc()
        why = "" if reason is None else f": {reason.message}"
        log.warning("scan %s of dead instance %s claimed: %s%s", scan_id, row_owner, outcome, why)

    def _why_not(self, handover: Handover | None, entries: list[Any]) -> tuple[ProcessLost | None, float]:
        """Why the scan cannot run on here (None: it can), and its time left."""
        if not self._takeover:
            return ProcessLost(), 0.0
        if handover is None:
            return ProcessLost(), 0.0
        left_s = handover.deadline_at - time.time()
        if left_s < MIN_TIME_LEFT_S:
            # Still PROCESS_LOST, not SCAN_DEADLINE_EXCEEDED: the death is the cause, and
            # its remedy (the same Idempotency-Key starts a new attempt) is the client's.
            return ProcessLost(f"{ProcessLost.default_message} (too little of its deadline was left)"), 0.0
        vision_done = any(
            e.event.kind == "stage" and e.event.fields().get("status") == "completed" for e in entries
        )
        if not handover.image_url and not vision_done:
            return ProcessLost(), 0.0
        return None, left_s


def _unknown(row: asyncpg.Record) -> Handover:
    """A scan whose input was not kept: enough to end it."""
    now = time.time()
    return Handover(
        "url", "", None, None, row["user_id"], "takeover", row["token_sha256"], None, {}, now, now
    )
