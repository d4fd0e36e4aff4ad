"""`MAX_INFLIGHT_PER_USER` across every replica (REDIS_URL set).

Each user's scans in flight are members of one sorted set in Redis, scored by when
they expire: a replica takes a slot with an atomic script (drop the expired, count,
add if under the cap), gives it back with ZREM when the scan ends, and renews the
expiry of the slots it holds every `SLOT_RENEW_S`. A replica that dies stops renewing,
so its slots free themselves within `SLOT_TTL_S`. Times are Redis's own clock.

A slot whose removal failed (Redis paused, unreachable, restarting) is remembered, not
renewed, and removed as soon as Redis answers again: by a background retry every
`RESEND_S` (`Unsent`), and by the user's next admission, whose script removes them before it
counts. Redis may come back with its data (a pause, a network blip, a restart that loads
its snapshot); without this, its user would be refused for up to `SLOT_TTL_S` with nothing
running. One not removed within `SLOT_TTL_S` has expired on its own and is forgotten.

Redis failing never refuses a scan: the caller's own per-process count still applies,
the failure is counted (`ecoscan_user_caps_redis_errors_total`) and logged once per
outage, and for `RETRY_AFTER_FAILURE_S` admissions do not ask Redis at all
(app/runtime/redis_fallback.py, as for every holder of shared state).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import Callable
from typing import Literal

from app.runtime.redis_fallback import FAILED, REDIS_FAILURES, RedisFallback, Unsent
from app.runtime.redis_link import RedisLink

__all__ = ["SLOT_TTL_S", "SharedUserCaps"]

log = logging.getLogger("ecoscan.admission")

SLOT_TTL_S = 30.0  # a slot not renewed for this long is free again (its replica died)
SLOT_RENEW_S = 10.0  # how often a replica renews the slots it holds

_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
for i = 4, #ARGV do redis.call('ZREM', KEYS[1], ARGV[i]) end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3]) * 1000))
return 1
"""

_RENEW = """
local t = redis.call('TIME')
local expires = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', expires, ARGV[i + 1])
  redis.call('PEXPIRE', key, math.ceil(tonumber(ARGV[1]) * 1000))
end
return #KEYS
"""


class SharedUserCaps:
    """Global per-user slots; `take` answers None when Redis could not be asked."""

    def __init__(self, link: RedisLink, *, on_error: Callable[[], None] | None = None) -> None:
        self._link = link
        self._take_script = link.script(_TAKE)
        self._renew_script = link.script(_RENEW)
        self._redis = RedisFallback(
            link,
            "per-user caps",
            log=log,
            local="counting this process's scans only",
            shared="caps are global",
            on_error=on_error,
        )
        self._instance = uuid.uuid4().hex[:12]
        self._serial = itertools.count()
        self._held: dict[str, str] = {}  # member -> user key
        # Slots whose removal failed, as (user key, member), until they have surely expired.
        self._unreleased: Unsent[tuple[str, str]] = Unsent(self._redis, self._remove, name="user-caps")
        self._renewer: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._renewer = asyncio.create_task(self._renew_loop(), name="user-caps-renew")

    async def aclose(self) -> None:
        """Free every slot this process holds (a rolling deploy leaves none behind), within
        a bounded wait; what is left expires on its own."""
        if self._renewer is not None:
            self._renewer.cancel()
        for member in list(self._held):
            self.give_back(member)
        await self._unreleased.aclose()
        if self._renewer is not None:
            await asyncio.gather(self._renewer, return_exceptions=True)

    @property
    def unreleased(self) -> int:
        """Slots whose removal failed, to be removed when Redis answers again."""
        return len(self._unreleased)

    async def take(self, user_key: str, cap: int) -> str | Literal[False] | None:
        """A slot's member name, False when the user is at the cap everywhere, or None
        when Redis failed (the caller's local count decides alone)."""
        if not self._redis.asks():
            return None
        member = f"{self._instance}:{next(self._serial)}"
        self._held[member] = user_key  # before the call: a slot taken by a lost reply is freed
        # The user's slots whose removal failed go first, in the same script: counted, they
        # would refuse the user for nothing.
        stale = [slot for slot in self._unreleased if slot[0] == user_key]
        args = [member, cap, SLOT_TTL_S, *(m for _, m in stale)]
        try:
            taken = await self._redis.call(self._take_script(keys=[self._key(user_key)], args=args))
        except BaseException:  # cancelled: the slot may have been taken all the same
            self.give_back(member)
            raise
        if taken is FAILED:
            self.give_back(member)
            return None
        self._unreleased.taken(stale)
        if not taken:
            self._held.pop(member, None)
            return False
        return member

    def give_back(self, member: str) -> None:
        """Free a slot (in the background: a scan's end never waits for Redis)."""
        user_key = self._held.pop(member, None)
        if user_key is not None:
            self._unreleased.later((user_key, member), SLOT_TTL_S)

    async def _remove(self, slots: list[tuple[str, str]]) -> None:
        by_key: dict[str, list[str]] = {}
        for user_key, member in slots:
            by_key.setdefault(self._key(user_key), []).append(member)
        async with self._link.client.pipeline(False) as pipe:
            for key, members in by_key.items():
                pipe.zrem(key, *members)
            await pipe.execute()

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(SLOT_RENEW_S)
            held = list(self._held.items())
            if not held:
                continue
            keys = [self._key(user_key) for _, user_key in held]
            with contextlib.suppress(*REDIS_FAILURES):
                async with self._redis.deadline():
                    await self._renew_script(keys=keys, args=[SLOT_TTL_S, *(m for m, _ in held)])

    def _key(self, user_key: str) -> str:
        return self._link.key("user", user_key, "scans")
