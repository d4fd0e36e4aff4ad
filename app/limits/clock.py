"""Clocks for the rate budget and the scan deadlines: the real monotonic one and a fake
one for tests and benchmarks. Budget waits, retries and stage deadlines all read the
same clock, so a test that moves a `FakeClock` moves every one of them."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

from app.limits.timeouts import Deadline, ElasticDeadline, deadline_of

__all__ = ["Clock", "FakeClock", "MonotonicClock"]


class Clock(Protocol):
    """Monotonic time source plus a matching sleep."""

    def now(self) -> float:
        """Monotonic seconds."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Sleep for `seconds` of this clock's time."""
        ...

    def timeout_at(self, deadline: Deadline) -> AbstractAsyncContextManager[object]:
        """Raise TimeoutError in the block once this clock reaches `deadline`; given as a
        function, the deadline is asked again when reached and may have moved later."""
        ...


class MonotonicClock:
    """The real clock: `time.monotonic` and `asyncio.sleep`."""

    def now(self) -> float:
        return time.monotonic()

    def timeout_at(self, deadline: Deadline) -> AbstractAsyncContextManager[object]:
        if callable(deadline):
            return ElasticDeadline(deadline, self.now)
        return asyncio.timeout(max(0.0, deadline - self.now()))

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that only moves when a test calls `await clock.advance(seconds)`.

    `sleep(s)` never sleeps for real: it parks the caller until `advance` moves time past
    `now + s`. `advance` wakes sleepers in wake-time order, setting `now()` to each wake
    time in turn, and yields to the loop `yields` times after every wake batch so the woken
    tasks (and whatever they wake in turn) run before `advance` returns.
    `await clock.advance(0)` just lets pending tasks run.
    """

    # Wake times within this much of the target count as due: `now + (t - now)` can land one
    # ulp past `t`, and a sleeper must not be stranded by rounding.
    _TOLERANCE = 1e-9

    def __init__(self, start: float = 0.0, *, yields: int = 50) -> None:
        self._now = float(start)
        self._yields = yields
        self._seq = itertools.count()
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), fut))
        await fut  # a cancelled sleep cancels fut; advance() skips it

    @asynccontextmanager
    async def timeout_at(self, deadline: Deadline) -> AsyncIterator[object]:
        """asyncio's own timeout, fired by a watchdog that sleeps on this clock."""
        when = deadline_of(deadline)
        async with asyncio.timeout(None) as scope:

            async def fire() -> None:
                while (left := when() - self._now) > 0:
                    await self.sleep(left)
                scope.reschedule(asyncio.get_running_loop().time())

            watchdog = asyncio.create_task(fire())
            try:
                yield scope
            finally:
                watchdog.cancel()

    @property
    def sleepers(self) -> int:
        """Number of tasks currently parked in `sleep`."""
        return sum(1 for _, _, fut in self._sleepers if not fut.done())

    async def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`, waking due sleepers in wake-time order."""
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        target = self._now + seconds
        await self._yield()
        while self._sleepers and self._sleepers[0][0] <= target + self._TOLERANCE:
            when = self._sleepers[0][0]
            self._now = max(self._now, min(when, target))
            while self._sleepers and self._sleepers[0][0] <= when:
                fut = heapq.heappop(self._sleepers)[2]
                if not fut.done():
                    fut.set_result(None)
            await self._yield()  # woken tasks may sleep again before target: loop re-checks
        self._now = max(self._now, target)
        await self._yield()

    async def _yield(self) -> None:
        for _ in range(self._yields):
            await asyncio.sleep(0)
