"""Tails cut by hedging: a call whose reply has not begun by its deployment's recent
first-byte p99 x `HEDGE_FACTOR` (within `HEDGE_MIN_S`..`HEDGE_MAX_S`; the ceiling until
`MIN_SAMPLES` replies were seen) is sent again to another closed deployment with room
under its limit and budget to spare; the first reply head (a 2xx) wins, the other attempt
is cancelled (its reservation stays spent, as its provider counted it on arrival). A
stream is raced only to its head, before any token, so its consumer sees one attempt.

`HedgeBudget` bounds the extra calls: at most `HEDGE_BUDGET` of the calls of the last
minute (plus `BURST`, so the first slow calls after a start can be hedged); a deployment
that loses a race is told it was overloaded, so its own limit
(app/limits/route_limits.py) backs off and the router gives it fewer calls.

Which attempt a reply belongs to travels in a context variable (`racing`): each attempt
runs in a task of its own, and the task's context carries its entry in the race, so the
code that reads a reply's head (`claim`) needs no extra parameter through the layers.
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import dataclasses
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from app.upstream.call import ChatResult

# Replies seen before a deployment's p99 is trusted; the ceiling is used until then.
MIN_SAMPLES = 20
# How many recent first-byte times make the p99 (per deployment and stage).
WINDOW = 200
# The minute the hedge budget counts over, in one-second buckets.
BUDGET_WINDOW_S = 60
# How much one call moves a route's late share, how soon the share fades, and how many
# calls must have been seen before a route can be called slow.
LATE_WEIGHT = 0.25
LATE_HALF_LIFE_S = 30.0
MIN_LATE_MARKS = 3
# Hedges allowed beyond the fraction (a start's first slow calls).
BURST = 2


class FirstByteTimes:
    """A route's recent first-byte times (to its reply's head), their p99, and the share
    of its calls whose first byte was late (past the hedge delay, or never): most of them
    late, the route is `slow` and the router sends it calls only when no other can take
    them. The share fades by half every `LATE_HALF_LIFE_S`, so a slow route is tried again."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=WINDOW)
        self._sorted: list[float] = []
        self._late = 0.0  # the late share, as of `_late_at`
        self._late_at = 0.0
        self._marks = 0

    def mark(self, *, late: bool, now: float) -> None:
        self._late = self.late_share(now) * (1 - LATE_WEIGHT) + (LATE_WEIGHT if late else 0.0)
        self._late_at = now
        self._marks += 1

    def late_share(self, now: float) -> float:
        fade: float = 0.5 ** (max(0.0, now - self._late_at) / LATE_HALF_LIFE_S)
        return self._late * fade

    def slow(self, now: float) -> bool:
        return self._marks >= MIN_LATE_MARKS and self.late_share(now) > 0.5

    def observe(self, seconds: float) -> None:
        if len(self._recent) == WINDOW:
            oldest = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._recent.append(seconds)
        bisect.insort(self._sorted, seconds)

    def p99(self) -> float | None:
        if len(self._sorted) < MIN_SAMPLES:
            return None
        return self._sorted[min(len(self._sorted) - 1, int(0.99 * len(self._sorted)))]

    def hedge_after(self, factor: float, floor_s: float, ceiling_s: float) -> float:
        p99 = self.p99()
        if p99 is None:
            return ceiling_s
        return min(ceiling_s, max(floor_s, p99 * factor))


class HedgeBudget:
    """Extra calls at most `ratio` of the calls of the last minute, plus `BURST`."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self._calls = [0] * BUDGET_WINDOW_S
        self._hedges = [0] * BUDGET_WINDOW_S
        self._second = 0

    def _roll(self, now: float) -> None:
        second = int(now)
        if second - self._second >= BUDGET_WINDOW_S:
            self._calls = [0] * BUDGET_WINDOW_S
            self._hedges = [0] * BUDGET_WINDOW_S
        else:
            for s in range(self._second + 1, second + 1):
                self._calls[s % BUDGET_WINDOW_S] = self._hedges[s % BUDGET_WINDOW_S] = 0
        self._second = max(self._second, second)

    def call(self, now: float) -> None:
        self._roll(now)
        self._calls[self._second % BUDGET_WINDOW_S] += 1

    def take(self, now: float) -> bool:
        """One hedge, if the budget has room for it now."""
        if self.ratio <= 0:
            return False
        self._roll(now)
        if sum(self._hedges) + 1 > self.ratio * sum(self._calls) + BURST:
            return False
        self._hedges[self._second % BUDGET_WINDOW_S] += 1
        return True


@dataclass(frozen=True)
class HedgePolicy:
    """When a call is hedged: after its route's first-byte p99 x `factor`, within
    `floor_s`..`ceiling_s`, while `budget` allows."""

    factor: float
    floor_s: float
    ceiling_s: float
    budget: HedgeBudget

    def after(self, times: FirstByteTimes) -> float:
        """How long a call on the route `times` belongs to waits for its head before a hedge."""
        return times.hedge_after(self.factor, self.floor_s, self.ceiling_s)

    def judge(self, times: FirstByteTimes, seconds: float, now: float) -> None:
        """A head came after `seconds`: on time, or late (past the hedge's delay)."""
        times.mark(late=seconds > self.after(times), now=now)


@dataclass(eq=False)
class Race:
    """Two attempts of one call; the first reply head decides."""

    winner: int = 0  # 0: none yet; else the winning attempt's entry (1 the first, 2 the hedge)
    won: asyncio.Event = field(default_factory=asyncio.Event)
    sent: asyncio.Event = field(default_factory=asyncio.Event)  # the first attempt's request left

    def claim(self, entry: int) -> bool:
        if not self.winner:
            self.winner = entry
            self.won.set()
        return self.winner == entry


racing: contextvars.ContextVar[tuple[Race, int] | None] = contextvars.ContextVar("racing", default=None)


def claim() -> bool:
    """A reply head (2xx) arrived for the attempt running here: True when it is the one
    the call goes on with (no race, or it won)."""
    entry = racing.get()
    return entry is None or entry[0].claim(entry[1])


def sending() -> None:
    """The attempt running here sends its request now: a hedge's delay runs from here, not
    from a wait at the stage gate or the budget (a queue, not a late deployment)."""
    entry = racing.get()
    if entry is not None and entry[1] == 1:
        entry[0].sent.set()


def _start(race: Race, entry: int, attempt: Awaitable[None]) -> asyncio.Task[None]:
    context = contextvars.copy_context()
    context.run(racing.set, (race, entry))
    return asyncio.create_task(_run(attempt), context=context)


async def _run(attempt: Awaitable[None]) -> None:
    await attempt


async def race(first: Awaitable[None], hedge: Callable[[], Awaitable[None] | None], after_s: float) -> int:
    """Run `first`; if no reply head came within `after_s` of its request leaving, `hedge()`
    (None: no hedge now) races it. Returns the entry that answered (1: first, 2: the hedge), once its attempt
    is done; the other is cancelled at the winner's head. Raises the first's failure when
    both failed (or the only one's)."""
    contest = Race()
    tasks: dict[asyncio.Future[Any], int] = {_start(contest, 1, first): 1}
    failures: dict[int, BaseException] = {}
    won = asyncio.ensure_future(contest.won.wait())
    sent = asyncio.ensure_future(contest.sent.wait())
    try:
        done, _ = await asyncio.wait({*tasks, sent}, return_when=asyncio.FIRST_COMPLETED)
        if sent in done:
            done, _ = await asyncio.wait({*tasks, won}, timeout=after_s, return_when=asyncio.FIRST_COMPLETED)
        if not done and not contest.winner:
            second = hedge()
            if second is not None:
                tasks[_start(contest, 2, second)] = 2
        while not contest.winner and tasks:
            done, _ = await asyncio.wait({*tasks, won}, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {won}:
                entry = tasks.pop(task)
                failure = task.exception()
                if failure is None:
                    return entry  # done without a head claimed: a reply all the same
                failures[entry] = failure
        if not contest.winner:
            raise failures.get(1) or failures[2]
        if contest.winner in failures:  # it claimed the head and failed in the same step
            raise failures[contest.winner]
        for task, entry in list(tasks.items()):
            if entry != contest.winner:
                task.cancel()
        winning = next(t for t, e in tasks.items() if e == contest.winner)
        await winning
        return contest.winner
    finally:  # cancelled from outside too: neither attempt outlives the call
        won.cancel()
        sent.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(won, sent, *tasks, return_exceptions=True)


def take_over(result: ChatResult, hedge: ChatResult) -> None:
    """The hedge answered: its reply is the call's; the time of both attempts counts."""
    queue_s, service_s, attempts = result.queue_s, result.service_s, result.attempts
    for f in dataclasses.fields(ChatResult):
        setattr(result, f.name, getattr(hedge, f.name))
    result.queue_s, result.service_s = queue_s + hedge.queue_s, service_s + hedge.service_s
    result.attempts = attempts
