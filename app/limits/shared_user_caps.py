"""`MAX_INFLIGHT_PER_USER` across every replica (REDIS_URL set).

Each user's scans in flight are members of one sorted set in Redis, scored by when
they expire: a replica takes a slot with an atomic script (drop the expired, count,
add if under the cap), gives it back with ZREM when the scan ends, and renews the
expiry of the slots it holds every `SLOT_RENEW_S`. A replica that dies stops renewing,
so its slots free themselves within `SLOT_TTL_S`. Times are Redis's own clock.

Redis failing never refuses a scan: the caller's own per-process count still applies,
the failure is counted (`ecoscan_user_caps_redis_errors_total`) and logged once per
outage, and for `SKIP_AFTER_FAILURE_S` admissions do not ask Redis at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Literal

from app.runtime.redis_link import RedisError, RedisLink

__all__ = ["SLOT_TTL_S", "SharedUserCaps"]

log = logging.getLogger("ecoscan.admission")

SLOT_TTL_S = 30.0  # a slot not renewed for this long is free again (its replica died)
SLOT_RENEW_S = 10.0  # how often a replica renews the slots it holds
# After Redis failed, admissions skip it this long: a hung Redis must not add its timeout
# to every scan's admission.
SKIP_AFTER_FAILURE_S = 1.0

_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
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
        self._on_error = on_error or (lambda: None)
        self._instance = uuid.uuid4().hex[:12]
        self._serial = itertools.count()
        self._held: dict[str, str] = {}  # member -> user key
        self._tasks: set[asyncio.Task[None]] = set()
        self._failing = False
        self._skip_until = 0.0
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
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self._link.timeout_s * 2)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *(t for t in [self._renewer] if t), return_exceptions=True)

    async def take(self, user_key: str, cap: int) -> str | Literal[False] | None:
        """A slot's member name, False when the user is at the cap everywhere, or None
        when Redis failed (the caller's local count decides alone)."""
        if self._failing and time.monotonic() < self._skip_until:
            return None
        member = f"{self._instance}:{next(self._serial)}"
        self._held[member] = user_key  # before the call: a slot taken by a lost reply is freed
        try:
            async with asyncio.timeout(self._link.timeout_s * 2):
                taken = await self._take_script(keys=[self._key(user_key)], args=[member, cap, SLOT_TTL_S])
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(exc)
            self.give_back(member)
            return None
        except BaseException:  # cancelled: the slot may have been taken all the same
            self.give_back(member)
            raise
        self._recovered()
        if not taken:
            self._held.pop(member, None)
            return False
        return member

    def give_back(self, member: str) -> None:
        """Free a slot (in the background: a scan's end never waits for Redis)."""
        user_key = self._held.pop(member, None)
        if user_key is None:
            return
        task = asyncio.create_task(self._remove(user_key, member))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _remove(self, user_key: str, member: str) -> None:
        try:
            async with asyncio.timeout(self._link.timeout_s * 2):
                await self._link.client.zrem(self._key(user_key), member)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(exc)  # the slot expires on its own within SLOT_TTL_S

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(SLOT_RENEW_S)
            held = list(self._held.items())
            if not held:
                continue
            keys = [self._key(user_key) for _, user_key in held]
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(self._link.timeout_s * 2):
                    await self._renew_script(keys=keys, args=[SLOT_TTL_S, *(m for m, _ in held)])

    def _key(self, user_key: str) -> str:
        return self._link.key("user", user_key, "scans")

    def _failed(self, exc: BaseException) -> None:
        self._on_error()
        self._skip_until = time.monotonic() + SKIP_AFTER_FAILURE_S
        if not self._failing:
            self._failing = True
            log.warning("per-user caps: Redis failed (%s); counting this process's scans only", exc)

    def _recovered(self) -> None:
        if self._failing:
            self._failing = False
            log.info("per-user caps: Redis answers again; caps are global")
