"""New scans start as the event loop can take them (app/limits/loop_capacity.py): at most
its ceiling in flight, and a wave of arrivals spread at its rate through a short bounded
queue, a ramp, not a stall.

Placed in front of everything a scan costs the loop (reading and parsing its body, its
row, its first events), twice: in the HTTP protocol as soon as a scan's head is parsed
(`refusal()`, app/http/early_refusal.py: no ASGI app, no request object, a pre-built
answer, so a refusal costs the loop little more than the head's parse), and in acceptance
after the caller's rate and quota (`enter()`, which takes the turn: for a scan that others
overtook in between, or a server run without app/http/protocol.py). At a ceiling of the
loop's own (a cut: the scans in flight, those waiting for their turn and those past it not
yet admitted) an arrival is refused at once with SERVER_BUSY, its body never read; its Retry-After is a turn
of its own at the rate scans were admitted lately (about the rate they end at), after the
turns given to those refused before it. Under it, arrivals are spaced `1 / rate` apart (a
virtual schedule, GCRA: no timer, no task); `BURST_S` of the rate may start at once, and
one that would wait more than `QUEUE_S` for its turn is refused likewise, its turn on the
same schedule at the wave's rate. So the refused come back as a ramp, not all in the same
second (at most `MAX_RETRY_AFTER_S`).
"""

from __future__ import annotations

import asyncio
import math
import time

from app.errors import ServerBusy
from app.limits.loop_capacity import LoopCapacity

# The queue holds at most this long of arrivals at the rate (the longest a scan waits here).
QUEUE_S = 1.0
# This long of the rate may start at once, with no wait.
BURST_S = 0.1
# The longest Retry-After the pacer gives (seconds).
MAX_RETRY_AFTER_S = 60.0
# Retry-After at the ceiling counts on scans ending at least this fast (a second).
MIN_DRAIN_RATE = 1.0
# Why an arrival was refused: it met a ceiling the loop set while it stayed saturated, or
# more arrived at once than the queue holds at the rate.
SATURATED = "saturated"
WAVE = "wave"


class LoopBusy(ServerBusy):
    """SERVER_BUSY from the pacer; `reason` is `SATURATED` or `WAVE`."""

    def __init__(self, reason: str, *, retry_after_s: float) -> None:
        super().__init__(retry_after_s=retry_after_s)
        self.reason = reason


class LoopPacer:
    def __init__(self, capacity: LoopCapacity) -> None:
        self.capacity = capacity
        self._turn = 0.0  # when the next arrival's turn is, at the rate (monotonic seconds)
        self._retry_turn = 0.0  # when the next refused arrival is told to come back
        self.waiting = 0  # arrivals waiting for their turn
        self.entering = 0  # arrivals past their turn, not yet admitted or refused elsewhere

    def refusal(self) -> LoopBusy | None:
        """`LoopBusy` (its Retry-After's turn given) if an arrival now would meet a ceiling of
        the loop's own or wait more than `QUEUE_S` for its turn, else None: a question that
        takes no turn, so the HTTP protocol can ask it before a request reaches the app
        (app/http/early_refusal.py)."""
        now = time.monotonic()
        capacity = self.capacity
        if capacity.binding and capacity.in_flight + self.waiting + self.entering >= capacity.inflight_limit:
            # Back when, at the rate scans have been admitted lately (about the rate they end
            # at), the turns given to those refused before it have passed.
            drain = max(MIN_DRAIN_RATE, capacity.scans_per_s)
            return self._refused(SATURATED, now, now, drain)
        turn = max(self._turn, now - BURST_S)
        if turn - now <= QUEUE_S:
            return None
        return self._refused(WAVE, now, turn, capacity.rate)

    def _refused(self, reason: str, now: float, turn: float, rate: float) -> LoopBusy:
        self._retry_turn = min(max(self._retry_turn, turn), now + MAX_RETRY_AFTER_S) + 1.0 / rate
        return LoopBusy(reason, retry_after_s=max(1.0, math.ceil(self._retry_turn - now)))

    async def enter(self) -> None:
        """Wait for this arrival's turn (at most `QUEUE_S`), or raise `LoopBusy`. Past its
        turn the arrival counts against the ceiling until `entered()`: a wave all past the
        pacer before any of it is admitted (and counted in flight) must not overshoot it."""
        if (busy := self.refusal()) is not None:
            raise busy
        now = time.monotonic()
        turn = max(self._turn, now - BURST_S)
        self._turn = turn + 1.0 / self.capacity.rate
        wait = turn - now
        if wait > 0:
            self.waiting += 1
            try:
                await asyncio.sleep(wait)
            finally:
                self.waiting -= 1
        self.entering += 1

    def entered(self) -> None:
        """The arrival `enter()` let through was admitted, or refused for another reason."""
        self.entering -= 1
