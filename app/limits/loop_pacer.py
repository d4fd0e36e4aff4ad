"""New scans start at the rate the event loop can take (app/limits/loop_capacity.py),
through a short bounded queue: a wave of arrivals becomes a ramp, not a stall.

Placed in front of everything a scan costs the loop (reading and parsing its body, its
row, its first events), twice: in the HTTP protocol as soon as a scan's head is parsed
(`refusal()`, app/http/early_refusal.py: no ASGI app, no request object, a pre-built
answer, so a refusal costs the loop little more than the head's parse), and in acceptance
after the caller's rate and quota (`enter()`, which takes the turn: for a scan that others
overtook in between, or a server run without app/http/protocol.py). Arrivals are spaced
`1 / rate` apart (a virtual schedule, GCRA: no timer, no task); `BURST_S` of the rate may
start at once. One that would wait more than `QUEUE_S` for its turn is refused at once
with SERVER_BUSY, its body never read. Its Retry-After is a turn of its own on a second
schedule at the same rate, after the queue and after the turns given to those refused
before it: what the queue drains at, so the refused come back as a ramp, not all in the
same second (at most `MAX_RETRY_AFTER_S`).
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
# Why an arrival was refused: the loop is over its target, or the loop is not (yet) but
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
        self.waiting = 0

    def refusal(self) -> LoopBusy | None:
        """`LoopBusy` (its Retry-After's turn given) if an arrival now would wait more than
        `QUEUE_S` for its turn, else None: a question that takes no turn, so the HTTP
        protocol can ask it before a request reaches the app (app/http/early_refusal.py)."""
        now = time.monotonic()
        turn = max(self._turn, now - BURST_S)
        if turn - now <= QUEUE_S:
            return None
        self._retry_turn = (
            min(max(self._retry_turn, turn), now + MAX_RETRY_AFTER_S) + 1.0 / self.capacity.rate
        )
        reason = SATURATED if self.capacity.saturated else WAVE
        return LoopBusy(reason, retry_after_s=max(1.0, math.ceil(self._retry_turn - now)))

    async def enter(self) -> None:
        """Wait for this arrival's turn (at most `QUEUE_S`), or raise `LoopBusy`."""
        if (busy := self.refusal()) is not None:
            raise busy
        now = time.monotonic()
        turn = max(self._turn, now - BURST_S)
        self._turn = turn + 1.0 / self.capacity.rate
        wait = turn - now
        if wait <= 0:
            return
        self.waiting += 1
        try:
            await asyncio.sleep(wait)
        finally:
            self.waiting -= 1
