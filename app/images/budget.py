"""The decode budget: bytes of decode memory in flight across the CPU lane's threads.

A decode holds its estimated bytes (app/images/plan.py) of one process-wide
`DecodeBudget` (default 8 bytes x `max_pixels`: two of the largest accepted RGBA images,
320 MB at 40 Mpx), waiting first come, first served while other threads hold it; an
image whose estimate alone exceeds the budget is refused with 413 before a pixel is
decoded. However many threads the CPU lane has, the decodes in flight stay under the
budget.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator

from app.errors import CpuLaneSaturated

# How long a decode may wait for budget (others' big decodes) before its request is
# refused with 503 CPU_SATURATED: many of the largest decodes' time, so that a backlog,
# not one big image ahead, is what makes a request give up.
DECODE_WAIT_TIMEOUT_S = 10.0


class DecodeBudget:
    """Bytes of decode memory in flight across the CPU lane's threads.

    `hold(n)` blocks the calling (worker) thread until `n` bytes are free and every
    earlier caller has been served: first come, first served, so a big image is not
    starved by a stream of small ones.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.in_use = 0
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(f"cannot hold {nbytes} of {self.capacity} bytes")
        ticket = object()
        deadline = time.monotonic() + DECODE_WAIT_TIMEOUT_S
        with self._cond:
            self._queue.append(ticket)
            while self._queue[0] is not ticket or self.in_use + nbytes > self.capacity:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cond.wait(remaining):
                    self._queue.remove(ticket)
                    self._cond.notify_all()
                    raise CpuLaneSaturated("Large images are being decoded; retry shortly.")
            self._queue.popleft()
            self.in_use += nbytes
            self._cond.notify_all()  # the next in line may fit too
        try:
            yield
        finally:
            with self._cond:
                self.in_use -= nbytes
                self._cond.notify_all()


_budgets: dict[int, DecodeBudget] = {}
_budgets_lock = threading.Lock()


def decode_budget(capacity: int) -> DecodeBudget:
    """The process-wide budget of that size (one per configured size; one in production)."""
    with _budgets_lock:
        budget = _budgets.get(capacity)
        if budget is None:
            budget = _budgets[capacity] = DecodeBudget(capacity)
        return budget
