"""Breakers shared by every replica (REDIS_URL set): a deployment one replica finds broken,
the others stop calling within `SYNC_S`, and one coming back is probed by one replica at a
time, not by each.

In Redis, per deployment, a hash `<prefix>:breaker:<id>` (`Deployment.health_id`: its
name and a digest of its endpoint and key, so a deployment whose key was fixed starts
afresh): `until` (on Redis's clock, when
the cooldown ends; 0 once a probe closed it), `out` (taken out: a key, a deployment, a
quota), `reason`, `opened` (times in a row, for the doubling) and `gen`, raised by every
change; and `<prefix>:breaker:<id>:probe`, the replica whose call probes it, for at most
`PROBE_LEASE_S`.

- This replica's own changes (its breakers' `listener`) are written by one task, in order:
  opened (Redis keeps the longer of its cooldown and ours, and `out` if either is), closed
  (our probe succeeded), a probe ended without a verdict. While Redis is away only the
  latest change per deployment waits to be written.
- The same task reads every deployment's hash each `SYNC_S` and adopts each `gen` it has
  not seen: open for what is left of the cooldown (an ended one: ready for a probe), or
  closed. A deployment with a change of ours still to write keeps ours.
- A call that would be a deployment's probe first claims the probe key (`claim_probe`);
  when another replica holds it (or Redis knows a longer cooldown), this replica waits
  that out and the call goes elsewhere.
- Redis failing never fails a call: each replica's breakers go on alone, as without
  REDIS_URL. The failure is counted (`ecoscan_upstream_breaker_redis_errors_total`),
  logged once per outage, and for `RETRY_AFTER_FAILURE_S` Redis is not asked
  (app/runtime/redis_fallback.py); once it answers, what is pending is written first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

from app.limits.clock import Clock
from app.runtime.redis_fallback import FAILED, RedisFallback
from app.runtime.redis_link import RedisLink
from app.upstream.breaker import Breaker

__all__ = ["PROBE_LEASE_S", "SYNC_S", "SharedBreakers"]

log = logging.getLogger(__name__)

# How often each replica reads the others' findings: how late it may still call a
# deployment another replica found broken.
SYNC_S = 0.5
# The longest one replica's probe keeps the others from probing (it is given back at its
# verdict; this bounds a probe whose replica died or whose call never went).
PROBE_LEASE_S = 30.0
# A deployment's hash outlives its last change this long (then it reads as never opened).
KEEP_S = 3600.0

_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) + tonumber(t[2]) / 1000000\n"

# KEYS: hash, probe. ARGV: seconds, out, reason, opened, holder, keep_s.
_OPENED = (
    _NOW
    + """
local cur = tonumber(redis.call('HGET', KEYS[1], 'until') or '0')
local cur_out = cur > now and redis.call('HGET', KEYS[1], 'out') == '1'
local reason = ARGV[3]
if cur_out and ARGV[2] ~= '1' then reason = redis.call('HGET', KEYS[1], 'reason') end
local untl = math.max(cur, now + tonumber(ARGV[1]))
local opened = math.max(tonumber(redis.call('HGET', KEYS[1], 'opened') or '0'), tonumber(ARGV[4]))
local out = '0'
if cur_out or ARGV[2] == '1' then out = '1' end
redis.call('HSET', KEYS[1], 'until', tostring(untl), 'out', out, 'reason', reason, 'opened', opened)
local gen = redis.call('HINCRBY', KEYS[1], 'gen', 1)
redis.call('PEXPIRE', KEYS[1], math.ceil((untl - now + tonumber(ARGV[6])) * 1000))
if redis.call('GET', KEYS[2]) == ARGV[5] then redis.call('DEL', KEYS[2]) end
return gen
"""
)

# KEYS: hash, probe. ARGV: keep_s.
_CLOSED = """
redis.call('HSET', KEYS[1], 'until', '0', 'out', '0', 'reason', '', 'opened', 0)
local gen = redis.call('HINCRBY', KEYS[1], 'gen', 1)
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1]) * 1000))
redis.call('DEL', KEYS[2])
return gen
"""

# KEYS: probe. ARGV: holder.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: hash, probe. ARGV: holder, lease_s. '0': the probe is ours; else the seconds to wait.
_CLAIM = (
    _NOW
    + """
local untl = tonumber(redis.call('HGET', KEYS[1], 'until') or '0')
if untl > now then return tostring(untl - now) end
if redis.call('GET', KEYS[2]) == ARGV[1] then return '0' end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', math.ceil(tonumber(ARGV[2]) * 1000)) then
  return '0'
end
return tostring(math.max(0, redis.call('PTTL', KEYS[2])) / 1000)
"""
)

# KEYS: every hash. Per key: gen, seconds left (-1: closed by a probe), out, reason, opened.
_READ = (
    _NOW
    + """
local found = {}
for _, key in ipairs(KEYS) do
  local v = redis.call('HMGET', key, 'gen', 'until', 'out', 'reason', 'opened')
  local untl = tonumber(v[2] or '0')
  local left = '-1'
  if untl > 0 then left = tostring(math.max(0, untl - now)) end
  table.insert(found, v[1] or '0')
  table.insert(found, left)
  table.insert(found, v[3] or '0')
  table.insert(found, v[4] or '')
  table.insert(found, v[5] or '0')
end
return found
"""
)


class SharedBreakers:
    """Every deployment's breaker, shared through Redis (see the module docstring)."""

    def __init__(
        self,
        link: RedisLink,
        breakers: Mapping[str, Breaker],
        clock: Clock,
        *,
        holder: str,
        sync_s: float = SYNC_S,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        self._link = link
        self._breakers = dict(breakers)  # by their ids in Redis
        self._ids = {breaker: shared_id for shared_id, breaker in breakers.items()}
        self._clock = clock
        self.holder = holder
        self._sync_s = sync_s
        self._redis = RedisFallback(
            link,
            "breakers",
            log=log,
            local="each replica's breakers go on alone",
            shared="breakers are shared",
            on_error=on_error,
        )
        self._opened = link.script(_OPENED)
        self._closed = link.script(_CLOSED)
        self._release = link.script(_RELEASE)
        self._claim = link.script(_CLAIM)
        self._read = link.script(_READ)
        self._seen: dict[str, bytes] = {}  # the gen adopted last, per deployment
        # Changes of ours still to write: the latest state ("opened" or "closed") and
        # whether a probe of ours is to be given back, per deployment.
        self._pending: dict[str, tuple[str | None, bool]] = {}
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        for breaker in breakers.values():
            breaker.listener = self

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="breakers-sync")

    async def aclose(self) -> None:
        """Stop syncing; write what is pending, within a bounded wait."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for breaker in self._breakers.values():
            breaker.listener = None
        if self._pending and self._redis.shared:
            await self._redis.call(self._write_pending())

    @property
    def shared(self) -> bool:
        return self._redis.shared

    # ----- this replica's changes (BreakerListener) ---------------------------------------

    def opened(self, breaker: Breaker, seconds: float) -> None:
        self._queue(self._ids[breaker], "opened", release=False)

    def closed(self, breaker: Breaker) -> None:
        self._queue(self._ids[breaker], "closed", release=False)

    def probe_ended(self, breaker: Breaker) -> None:
        self._queue(self._ids[breaker], None, release=True)

    def _queue(self, name: str, state: str | None, *, release: bool) -> None:
        pending_state, pending_release = self._pending.get(name, (None, False))
        self._pending[name] = (state or pending_state, release or pending_release)
        self._kick.set()

    # ----- probes -------------------------------------------------------------------------

    async def claim_probe(self, breaker: Breaker) -> float | None:
        """None: this replica may probe `breaker`'s deployment (the probe is ours, or Redis
        could not say); else the seconds another replica's probe or cooldown has left."""
        if not self._redis.asks():
            return None
        keys = self._keys(self._ids[breaker])
        reply = await self._redis.call(self._claim(keys=keys, args=[self.holder, PROBE_LEASE_S]))
        if reply is FAILED:
            return None
        wait = float(reply)
        return wait if wait > 0 else None

    # ----- the sync task ------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._sync_s):
                    await self._kick.wait()
            self._kick.clear()
            if not self._redis.asks():
                continue
            try:
                await self._redis.call(self._sync())
            except Exception:  # a bug must not end the sharing for good
                log.exception("breakers: syncing with Redis failed")

    async def _sync(self) -> None:
        await self._write_pending()
        await self._adopt()

    async def _write_pending(self) -> None:
        while self._pending:
            name, (state, release) = next(iter(self._pending.items()))
            del self._pending[name]
            try:
                await self._write(self._breakers[name], state, release=release)
            except BaseException:
                if name not in self._pending:  # nothing newer meanwhile: write it next time
                    self._pending[name] = (state, release)
                raise

    async def _write(self, breaker: Breaker, state: str | None, *, release: bool) -> None:
        hash_key, probe_key = self._keys(self._ids[breaker])
        if state == "opened":
            seconds = max(0.0, breaker.open_until - self._clock.now())
            out = 1 if breaker.out else 0
            args = [seconds, out, breaker.reason, breaker.opened, self.holder, KEEP_S]
            await self._opened(keys=[hash_key, probe_key], args=args)
        elif state == "closed":
            await self._closed(keys=[hash_key, probe_key], args=[KEEP_S])
        if release:
            await self._release(keys=[probe_key], args=[self.holder])

    async def _adopt(self) -> None:
        names = list(self._breakers)
        found = await self._read(keys=[self._keys(name)[0] for name in names], args=[])
        now = self._clock.now()
        for i, name in enumerate(names):
            gen, left, out, reason, opened = found[5 * i : 5 * i + 5]
            if gen == self._seen.get(name) or name in self._pending:
                continue
            self._seen[name] = gen
            breaker, seconds = self._breakers[name], float(left)
            if gen == b"0":  # nothing known yet
                continue
            if seconds < 0:
                breaker.adopt_closed()
            else:
                breaker.adopt_open(
                    now, seconds, out=out == b"1", reason=reason.decode(errors="replace"), opened=int(opened)
                )

    def _keys(self, name: str) -> list[str]:
        return [self._link.key("breaker", name), self._link.key("breaker", name, "probe")]
