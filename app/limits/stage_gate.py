"""A counting gate for one stage's upstream calls: at most `limit` held at once, FIFO
for the rest, reporting how many slots are held and how long the caller waited.

It bounds only what it is named for (concurrent upstream calls of one stage). It is
never held across CPU work, and the CPU lane's slots are never held across I/O.

Its limit may move while calls hold slots (app/limits/sizing.py sets it): a rise lets
waiters in at once; a fall takes effect as holders leave, never by cutting one off.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from app.limits.adaptive import AdaptiveLimit


class StageGate:
    def __init__(self, stage: str, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"{stage} concurrency must be >= 1")
        self.stage = stage
        self._limit = limit
        self.in_use = 0
        # FIFO of waiters; one that gave up stays in it, done, until `_wake` passes it by
        # (removing it from the middle would cost a walk of the queue per give-up).
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._waiting = 0
        # When each holder took its slot, oldest first (dicts keep insertion order).
        self._held_since: dict[int, float] = {}
        self._tokens = itertools.count()
        # Sized automatically (app/limits/sizing.py): told how each call went.
        self.limiter: AdaptiveLimit | None = None
        self.latency_s: float | None = None  # mean upstream time of the calls through it

    @property
    def limit(self) -> int:
        return self._limit

    @limit.setter
    def limit(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"{self.stage} concurrency must be >= 1")
        self._limit = value
        self._wake()

    @property
    def ceiling(self) -> int:
        """The most its limit may ever be."""
        return self.limiter.ceiling if self.limiter is not None else self._limit

    @property
    def waiting(self) -> int:
        return self._waiting

    def oldest_held_s(self) -> float:
        """How long the longest holder has held its slot (0 when none does)."""
        for since in self._held_since.values():
            return time.perf_counter() - since
        return 0.0

    def observe(self, latency_s: float, *, overloaded: bool) -> None:
        """A call that held a slot took `latency_s` upstream; `overloaded`: the upstream
        refused it for load (429, 5xx) or let it time out."""
        if not overloaded:  # a running mean of replies, sized or not: admission's service time
            self.latency_s = (
                latency_s if self.latency_s is None else self.latency_s + 0.05 * (latency_s - self.latency_s)
            )
        if self.limiter is not None:
            self.limiter.observe(latency_s, overloaded=overloaded)

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[float]:
        """Hold a slot for the body; yields the seconds spent waiting for it."""
        started = time.perf_counter()
        if self.in_use < self._limit and not self._waiting:
            self._take()
        else:
            await self._wait()
        token = next(self._tokens)
        self._held_since[token] = time.perf_counter()
        try:
            yield time.perf_counter() - started
        finally:
            del self._held_since[token]
            self.in_use -= 1
            self._wake()

    def _take(self) -> None:
        self.in_use += 1

    async def _wait(self) -> None:
        """Queue (FIFO) until `_wake` hands this waiter a slot: the slot is taken on its
        behalf, so no newcomer slips in between the release and the waiter's wake-up."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._waiting += 1
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.in_use -= 1  # handed a slot just as it was cancelled: pass it on
                self._wake()
            else:
                waiter.cancel()  # left in the queue, done: `_wake` passes it by
                self._waiting -= 1
            raise

    def _wake(self) -> None:
        while self._waiters and self.in_use < self._limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._waiting -= 1
                self._take()
                waiter.set_result(None)
