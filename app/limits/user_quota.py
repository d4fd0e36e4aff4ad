"""Per-user scan rate (`USER_SCAN_RATE_PER_MIN`) and quota (`USER_DAILY_SCAN_QUOTA`).

Two sliding windows per caller's rate key (app/intake/identity.py: `u:<id>`, or the
anonymous caller's address, its /64 over IPv6): the scans started in the last minute and
in the last 24 hours. A scan reserves its place in both before it is admitted (`reserve`,
429 `USER_RATE_LIMITED` / `USER_QUOTA_EXHAUSTED` with `Retry-After` = when the window has
room again); a scan refused later in acceptance gives the place back
(`Reservation.give_back`), a scan that starts keeps it, however it ends.

With REDIS_URL, each window is a sorted set in Redis, one member per reservation scored
by Redis's own clock; one script drops what has left the windows, checks both and adds to
both, so every replica sees one count, exactly. Giving back removes the member (safe to
repeat, and a member never added is no-op).

A give-back that Redis does not take is kept and sent again every `RESEND_S` (`Unsent`)
until Redis takes it (or its place has left the longest window), so a Redis pause does not cost a
caller a day's place for a scan that never ran; and it leaves a short-lived tombstone, so a
reservation that reaches Redis after its own give-back (a timed-out call still queued
there) adds nothing.

Redis failing never refuses a scan: this process counts its own reservations all along,
and while Redis fails that count decides alone (each replica then allows the full rate and
quota). The failure is counted (`ecoscan_user_quota_redis_errors_total`), logged once per
outage, and for `RETRY_AFTER_FAILURE_S` reservations do not ask Redis at all
(app/runtime/redis_fallback.py, as for every holder of shared state).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from app.errors import Overloaded, UserQuotaExhausted, UserRateLimited
from app.runtime.redis_fallback import FAILED, RedisFallback, Unsent
from app.runtime.redis_link import RedisLink

__all__ = ["Reservation", "UserQuota", "Window", "windows"]

log = logging.getLogger("ecoscan.admission")

RATE_WINDOW_S = 60.0
QUOTA_WINDOW_S = 24 * 3600.0
# This process's windows are swept of callers with nothing left in them every this many
# reservations (a caller who never comes back is otherwise kept).
SWEEP_EVERY = 1024
# How long a given-back member's tombstone outlives the give-back: longer than any call of
# the reservation that can still be on its way (the link's timeout, twice).
TOMBSTONE_MS = 60_000

# KEYS: one sorted set per window, then the member's tombstone. ARGV: the member, then
# (limit, seconds) per window. Returns {0, 0} when reserved (or already given back), else
# {index of the full window (1-based), ms until it has room}.
_RESERVE = """
if redis.call('EXISTS', KEYS[#KEYS]) == 1 then return {0, 0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i = 1, #KEYS - 1 do
  local key = KEYS[i]
  local limit, window = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  local held = redis.call('ZCARD', key)
  if held >= limit then
    local oldest = redis.call('ZRANGE', key, held - limit, held - limit, 'WITHSCORES')
    return {i, math.ceil((tonumber(oldest[2]) + window - now) * 1000)}
  end
end
for i = 1, #KEYS - 1 do
  local key = KEYS[i]
  redis.call('ZADD', key, now, ARGV[1])
  redis.call('PEXPIRE', key, math.ceil(tonumber(ARGV[2 * i + 1]) * 1000))
end
return {0, 0}
"""

# KEYS as _RESERVE's; ARGV: the member, the tombstone's life in ms.
_GIVE_BACK = """
for i = 1, #KEYS - 1 do redis.call('ZREM', KEYS[i], ARGV[1]) end
redis.call('SET', KEYS[#KEYS], 1, 'PX', ARGV[2])
return 0
"""


@dataclass(frozen=True, slots=True)
class Window:
    name: str  # in Redis keys
    limit: int
    seconds: float
    refusal: type[Overloaded]


def windows(rate_per_min: int, daily_quota: int) -> tuple[Window, ...]:
    """The windows the settings turn on (0 turns one off); the quota first: when both are
    full, the client learns the longer wait."""
    found = [
        Window("quota", daily_quota, QUOTA_WINDOW_S, UserQuotaExhausted),
        Window("rate", rate_per_min, RATE_WINDOW_S, UserRateLimited),
    ]
    return tuple(w for w in found if w.limit > 0)


class Reservation:
    """A scan's place in its caller's windows, until given back (at most once)."""

    __slots__ = ("_member", "_owner", "_rate_key", "_shared")

    def __init__(self, owner: UserQuota, rate_key: str, member: str, *, shared: bool) -> None:
        self._owner = owner
        self._rate_key = rate_key
        self._member: str | None = member
        self._shared = shared

    def give_back(self) -> None:
        """The scan was refused after all: its place is free again (in Redis in the
        background: a refusal never waits for Redis)."""
        if self._member is not None:
            self._owner._give_back(self._rate_key, self._member, shared=self._shared)
            self._member = None


class _LocalWindows:
    """This process's own reservations per rate key and window, oldest first (a dict
    keeps insertion order: member -> monotonic time)."""

    def __init__(self, limits: tuple[Window, ...]) -> None:
        self._limits = limits
        self._held: dict[str, tuple[dict[str, float], ...]] = {}
        self._added = 0

    def refusal(self, rate_key: str, now: float) -> Overloaded | None:
        held = self._held.get(rate_key)
        if held is None:
            return None
        for window, members in zip(self._limits, held, strict=True):
            _expire(members, now - window.seconds)
            if len(members) >= window.limit:
                oldest = list(members.values())[len(members) - window.limit]
                return _refused(window, oldest + window.seconds - now)
        return None

    def add(self, rate_key: str, member: str, now: float) -> None:
        held = self._held.setdefault(rate_key, tuple({} for _ in self._limits))
        for members in held:
            members[member] = now
        self._added += 1
        if self._added % SWEEP_EVERY == 0:
            self._sweep(now)

    def remove(self, rate_key: str, member: str) -> None:
        held = self._held.get(rate_key)
        if held is None:
            return
        for members in held:
            members.pop(member, None)
        if not any(held):
            del self._held[rate_key]

    def _sweep(self, now: float) -> None:
        for rate_key, held in list(self._held.items()):
            for window, members in zip(self._limits, held, strict=True):
                _expire(members, now - window.seconds)
            if not any(held):
                del self._held[rate_key]

    def __len__(self) -> int:
        return len(self._held)


def _expire(members: dict[str, float], before: float) -> None:
    while members:
        member, at = next(iter(members.items()))
        if at > before:
            return
        del members[member]


def _refused(window: Window, wait_s: float) -> Overloaded:
    return window.refusal(retry_after_s=max(1.0, math.ceil(wait_s)))


class UserQuota:
    """`reserve(rate_key)` before a scan is admitted; `aclose()` at shutdown."""

    def __init__(
        self,
        limits: tuple[Window, ...],
        *,
        link: RedisLink | None = None,
        on_error: Callable[[], None] | None = None,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        if not limits:
            raise ValueError("no window to enforce")
        self._limits = limits
        # A place given back has nothing left to give back once it left the longest window.
        self._longest_s = max(window.seconds for window in limits)
        self._local = _LocalWindows(limits)
        self._link = link
        self._on_refused = on_refused or (lambda code: None)
        self._instance = uuid.uuid4().hex[:12]
        self._serial = itertools.count()
        self._redis: RedisFallback | None = None
        # Give-backs Redis did not take, as (rate key, member).
        self._unreturned: Unsent[tuple[str, str]] | None = None
        if link is not None:
            self._reserve_script = link.script(_RESERVE)
            self._give_back_script = link.script(_GIVE_BACK)
            self._redis = RedisFallback(
                link,
                "per-user rate and quota",
                log=log,
                local="counting this process's scans only",
                shared="counts are global",
                on_error=on_error,
            )
            self._unreturned = Unsent(self._redis, self._send_give_backs, name="user-quota")

    async def reserve(self, rate_key: str) -> Reservation:
        """A place in each window for one scan, or the refusal (429, Retry-After)."""
        member = f"{self._instance}:{next(self._serial)}"
        outcome = await self._reserve_shared(rate_key, member)
        now = time.monotonic()
        if outcome != "reserved":  # no Redis, or Redis failed: this process's count decides
            refusal = self._local.refusal(rate_key, now)
            if refusal is not None:
                if outcome == "failed":
                    self._give_back_later(rate_key, member)  # in case it ran all the same
                self._on_refused(refusal.code)
                raise refusal
        self._local.add(rate_key, member, now)
        # After a failed call the script may still have run: a give-back removes it too.
        return Reservation(self, rate_key, member, shared=outcome != "unasked")

    async def _reserve_shared(self, rate_key: str, member: str) -> Literal["reserved", "failed", "unasked"]:
        """`reserved` in Redis; `failed` (Redis did not answer) or `unasked` (no Redis, or
        skipped after a failure): the local count decides. Raises the refusal when a window
        is full across replicas."""
        if self._redis is None or not self._redis.asks():
            return "unasked"
        args: list[str | int | float] = [member]
        for window in self._limits:
            args += [window.limit, window.seconds]
        try:
            reply = await self._redis.call(self._reserve_script(keys=self._keys(rate_key, member), args=args))
        except BaseException:  # cancelled: the place may have been taken all the same
            self._give_back_later(rate_key, member)
            raise
        if reply is FAILED:
            return "failed"
        full, wait_ms = reply
        if full:
            refusal = _refused(self._limits[int(full) - 1], int(wait_ms) / 1000)
            self._on_refused(refusal.code)
            raise refusal
        return "reserved"

    def _give_back(self, rate_key: str, member: str, *, shared: bool) -> None:
        self._local.remove(rate_key, member)
        if shared:
            self._give_back_later(rate_key, member)

    def _give_back_later(self, rate_key: str, member: str) -> None:
        assert self._unreturned is not None
        self._unreturned.later((rate_key, member), self._longest_s)

    async def _send_give_back(self, rate_key: str, member: str) -> bool:
        """Give a place back in Redis now; False (kept, to be sent again) if Redis failed."""
        assert self._unreturned is not None
        return await self._unreturned.send((rate_key, member), self._longest_s)

    async def _send_give_backs(self, places: list[tuple[str, str]]) -> None:
        assert self._link is not None
        async with self._link.client.pipeline(False) as pipe:
            for rate_key, member in places:
                keys = self._keys(rate_key, member)
                await self._give_back_script(keys=keys, args=[member, TOMBSTONE_MS], client=pipe)
            await pipe.execute()

    @property
    def unreturned(self) -> int:
        """Give-backs Redis has not taken yet (sent again every `RESEND_S`)."""
        return len(self._unreturned) if self._unreturned is not None else 0

    def _keys(self, rate_key: str, member: str) -> list[str]:
        assert self._link is not None
        windows = [self._link.key("user", rate_key, window.name) for window in self._limits]
        return [*windows, self._link.key("user", rate_key, "returned", member)]

    @property
    def callers(self) -> int:
        """Rate keys this process holds reservations for (bounded by the sweep)."""
        return len(self._local)

    async def aclose(self) -> None:
        """Wait (bounded) for give-backs in flight; what is left leaves its window on its own."""
        if self._unreturned is not None:
            await self._unreturned.aclose()
