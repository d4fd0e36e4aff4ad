"""`MAX_INFLIGHT_PER_USER` across every replica (REDIS_URL set).

Each user's scans in flight are members of one sorted set in Redis, scored by when
they expire: a replica takes a slot with an atomic script (drop the expired, count,
add if under the cap), gives it back with ZREM when the scan ends, and renews the
expiry of the slots it holds every `SLOT_RENEW_S`. A replica that dies stops renewing,
so its slots free themselves within `SLOT_TTL_S`. Times are Redis's own clock.

A slot whose removal failed (Redis paused, unreachable, restarting) is remembered, not
renewed, and removed as soon as Redis answers again: by a background retry every
`RELEASE_RETRY_S`, and by the user's next admission, whose script removes them before it
counts. Redis may come back with its data (a pause, a network blip, a restart that loads
its snapshot); without this, its user would be refused for up to `SLOT_TTL_S` with nothing
running. One not removed within `SLOT_TTL_S` has expired on its own and is forgotten.

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

__all__ = ["RELEASE_RETRY_S", "SLOT_TTL_S", "SharedUserCaps"]

log = logging.getLogger("ecoscan.admission")

SLOT_TTL_S = 30.0  # a slot not renewed for this long is free again (its replica died)
SLOT_RENEW_S = 10.0  # how often a replica renews the slots it holds
# After Redis failed, admissions skip it this long: a hung Redis must not add its timeout
# to every scan's admission.
SKIP_AFTER_FAILURE_S = 1.0
RELEASE_RETRY_S = 1.0  # how often slots whose removal failed are tried again

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
        self._on_error = on_error or (lambda: None)
        self._instance = uuid.uuid4().hex[:12]
        self._serial = itertools.count()
        self._held: dict[str, str] = {}  # member -> user key
        # Slots whose removal failed: member -> (user key, when it has surely expired).
        self._unreleased: dict[str, tuple[str, float]] = {}
        self._releaser: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._failing = False
        self._skip_until = 0.0
        self._renewer: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._renewer = asyncio.create_task(self._renew_loop(), name="user-caps-renew")

    async def aclose(self) -> None:
        """Free every slot this process holds (a rolling deploy leaves none behind), within
        a bounded wait; what is left expires on its own."""
        for task in (self._renewer, self._releaser):
            if task is not None:
                task.cancel()
        for member in list(self._held):
            self.give_back(member)
        if self._unreleased:
            self._track(asyncio.create_task(self._release_unreleased()))
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self._link.timeout_s * 2)
        for task in list(self._tasks):
            task.cancel()
        others = (t for t in (self._renewer, self._releaser) if t is not None)
        await asyncio.gather(*self._tasks, *others, return_exceptions=True)

    @property
    def unreleased(self) -> int:
        """Slots whose removal failed, to be removed when Redis answers again."""
        return len(self._unreleased)

    async def take(self, user_key: str, cap: int) -> str | Literal[False] | None:
        """A slot's member name, False when the user is at the cap everywhere, or None
        when Redis failed (the caller's local count decides alone)."""
        if self._failing and time.monotonic() < self._skip_until:
            return None
        member = f"{self._instance}:{next(self._serial)}"
        self._held[member] = user_key  # before the call: a slot taken by a lost reply is freed
        # The user's slots whose removal failed go first, in the same script: counted, they
        # would refuse the user for nothing.
        stale = [m for m, (key, _) in self._unreleased.items() if key == user_key]
        try:
            async with asyncio.timeout(self._link.timeout_s * 2):
                taken = await self._take_script(
                    keys=[self._key(user_key)], args=[member, cap, SLOT_TTL_S, *stale]
                )
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(exc)
            self.give_back(member)
            return None
        except BaseException:  # cancelled: the slot may have been taken all the same
            self.give_back(member)
            raise
        self._recovered()
        for removed in stale:
            self._unreleased.pop(removed, None)
        if not taken:
            self._held.pop(member, None)
            return False
        return member

    def give_back(self, member: str) -> None:
        """Free a slot (in the background: a scan's end never waits for Redis)."""
        user_key = self._held.pop(member, None)
        if user_key is None:
            return
        self._track(asyncio.create_task(self._remove(user_key, member)))

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _remove(self, user_key: str, member: str) -> None:
        try:
            async with asyncio.timeout(self._link.timeout_s * 2):
                await self._link.client.zrem(self._key(user_key), member)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(exc)
            self._unreleased[member] = (user_key, time.monotonic() + SLOT_TTL_S)
            if self._releaser is None or self._releaser.done():
                self._releaser = asyncio.create_task(self._release_loop(), name="user-caps-release")

    async def _release_loop(self) -> None:
        """Until every slot whose removal failed is removed (or has expired on its own)."""
        while self._unreleased:
            await asyncio.sleep(RELEASE_RETRY_S)
            await self._release_unreleased()

    async def _release_unreleased(self) -> None:
        now = time.monotonic()
        for member, (_, expired_at) in list(self._unreleased.items()):
            if expired_at <= now:
                del self._unreleased[member]
        by_key: dict[str, list[str]] = {}
        for member, (user_key, _) in self._unreleased.items():
            by_key.setdefault(self._key(user_key), []).append(member)
        if not by_key:
            return
        try:
            async with asyncio.timeout(self._link.timeout_s * 2), self._link.client.pipeline(False) as pipe:
                for key, members in by_key.items():
                    pipe.zrem(key, *members)
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(exc)
            return
        for members in by_key.values():
            for member in members:
                self._unreleased.pop(member, None)
        self._recovered()

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
