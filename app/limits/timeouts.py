"""Timeouts that follow what they bound: a configured timeout is the least a wait gets;
a model that takes longer than the setting assumed stretches it.

A fixed timeout is a guess about the model behind it. A read timeout of 20 s is generous
for a 2 s vision call and fails one call in ten of a model whose replies take 14 s at the
median, under any load; each such failure is retried (the same wait again), counted as
overload (the limits back off) and, past the stage's own limit, fails the scan. So the
waits for an upstream's reply and a stage's completion are each

    max(configured, TAIL x the longest recent duration of the same thing)

where "recent" fades by half every `PEAK_HALF_LIFE_S` (`RecentPeak`). A peak rather than
a mean: latency distributions of language models are heavy-tailed and, for a stage a
cache sometimes answers, mixed; the longest recent one says how long a healthy one can
take without assuming a shape. A hung call still ends: after TAIL x what calls took a
minute ago, and never past the scan's deadline.

The deadline is re-read when reached (`ElasticDeadline`): the first calls after start-up
are all sent before any has finished, under the configured guess; when that runs out,
the replies that came meanwhile say how long calls take, and the wait goes on if they
say it should.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from types import TracebackType

# When a wait must end: a time, or what gives it (a deadline that may move later).
Deadline = float | Callable[[], float]

# A timeout is at least this many times the longest recent duration...
TAIL = 1.5
# ...which fades by half every this many seconds: a slow minute is remembered for a few.
PEAK_HALF_LIFE_S = 60.0


class RecentPeak:
    """The longest of recent durations, each fading by half every `half_life_s` after it
    was seen. Only the largest faded value matters, and every value fades alike, so one
    (value, time) pair is exact."""

    __slots__ = ("_at", "_half_life_s", "_peak")

    def __init__(self, half_life_s: float = PEAK_HALF_LIFE_S) -> None:
        self._half_life_s = half_life_s
        self._peak = 0.0
        self._at = 0.0

    def observe(self, seconds: float, now: float) -> None:
        if seconds >= self.value(now):
            self._peak, self._at = seconds, now

    def value(self, now: float) -> float:
        if not self._peak:
            return 0.0
        return self._peak * math.exp2(-max(0.0, now - self._at) / self._half_life_s)

    def timeout(self, configured_s: float, now: float) -> float:
        """The wait this duration gets: the configured one, or `TAIL` x the recent peak."""
        return max(configured_s, TAIL * self.value(now))


class ElasticDeadline:
    """`asyncio.timeout` whose deadline (`deadline()`, in `now()`'s seconds) is asked again
    when reached: the block is cancelled (TimeoutError out of the block, as asyncio's) only
    once the deadline it gives has passed. One timer at a time, no task."""

    __slots__ = ("_deadline", "_handle", "_loop", "_now", "_scope")

    def __init__(self, deadline: Callable[[], float], now: Callable[[], float]) -> None:
        self._deadline = deadline
        self._now = now
        self._scope = asyncio.timeout(None)
        self._handle: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> ElasticDeadline:
        self._loop = asyncio.get_running_loop()
        await self._scope.__aenter__()
        self._check()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
        await self._scope.__aexit__(kind, exc, tb)

    def expired(self) -> bool:
        return self._scope.expired()

    def _check(self) -> None:
        left = self._deadline() - self._now()
        if left > 0:
            self._handle = self._loop.call_later(left, self._check)
        else:
            self._handle = None
            self._scope.reschedule(self._loop.time())


def deadline_of(deadline: Deadline) -> Callable[[], float]:
    """`deadline` as what gives it, asked each time it matters."""
    if callable(deadline):
        return deadline
    fixed: float = deadline
    return lambda: fixed
