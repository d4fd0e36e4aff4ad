"""Admission control: decide before the stream starts whether a scan can be served.

Three checks, cheapest first:
1. per user: at most `per_user` scans in flight for one user (anonymous users are
   keyed by client address) -> 429 `USER_CONCURRENCY_LIMIT`; with REDIS_URL, counted
   across every replica (app/limits/shared_user_caps.py);
2. the upstream budget: if a new scan's first call would wait longer than
   `max_budget_wait_s` for the RPM/TPM budget, queueing it is pointless -> 503
   `UPSTREAM_BUDGET_EXHAUSTED`, Retry-After = when the wait would be acceptable again.
   The prediction counts not only the calls queued at the budget but every call that
   admitted scans still owe (`owed_calls`): a scan admitted a moment ago has not
   queued its vision call yet, and its answer call comes seconds later. Without
   that, a burst is admitted against an empty-looking queue and then times out;
3. the global cap: at most `max_inflight` scans; a newcomer may wait up to
   `wait_s` for a slot (smooths bursts), then 503 `SERVER_BUSY`.

A `Ticket` holds the slots for the scan's whole life and is released exactly once,
however the scan ends.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable

from app.errors import ServerBusy, UpstreamBudgetExhausted, UserOverLimit
from app.limits.shared_user_caps import SharedUserCaps


class Ticket:
    __slots__ = ("_admission", "_released", "global_slot", "owed", "user_key", "waited_s")

    def __init__(
        self, admission: Admission, user_key: str, global_slot: str | None, waited_s: float = 0.0
    ) -> None:
        self._admission = admission
        self.user_key = user_key
        self.global_slot = global_slot  # the user's slot in Redis, when caps are shared
        self.waited_s = waited_s  # how long the scan queued for a global slot
        self.owed = admission.calls_per_scan
        self._released = False

    def calls_started(self, calls: int = 1) -> None:
        """The scan is about to make `calls` of the upstream calls it owes."""
        calls = min(calls, self.owed)
        if calls > 0 and not self._released:
            self.owed -= calls
            self._admission.owed_calls -= calls

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission.owed_calls -= self.owed
            self.owed = 0
            self._admission._release(self.user_key, self.global_slot)


class Admission:
    def __init__(
        self,
        *,
        max_inflight: int,
        per_user: int,
        wait_s: float,
        max_budget_wait_s: float,
        predicted_budget_wait: Callable[[int], float],
        calls_per_scan: int,
        user_caps: SharedUserCaps | None = None,
    ) -> None:
        self.calls_per_scan = calls_per_scan  # upstream calls a scan owes when admitted
        self.max_inflight = max_inflight
        self.per_user = per_user
        self.wait_s = wait_s
        self.max_budget_wait_s = max_budget_wait_s
        self._predicted_budget_wait = predicted_budget_wait
        self._user_caps = user_caps  # REDIS_URL: the per-user cap counts every replica's scans
        self.in_flight = 0
        self.owed_calls = 0  # upstream calls admitted scans will still make
        self.admitted = 0  # scans admitted since start
        self.per_user_in_flight: dict[str, int] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        # Exponentially weighted mean scan duration: sizes Retry-After for SERVER_BUSY.
        self.mean_scan_s = 5.0

    async def admit(self, user_key: str) -> Ticket:
        if self.per_user_in_flight.get(user_key, 0) >= self.per_user:
            raise UserOverLimit(retry_after_s=self._retry_after_busy())
        budget_wait = self._predicted_budget_wait(self.owed_calls)
        if budget_wait > self.max_budget_wait_s:
            raise UpstreamBudgetExhausted(retry_after_s=max(1.0, budget_wait - self.max_budget_wait_s))
        waited_s = 0.0
        if self.in_flight < self.max_inflight and not self._waiters:
            self.in_flight += 1
        else:
            queued_at = time.perf_counter()
            await self._wait_for_slot()
            waited_s = time.perf_counter() - queued_at
        # Re-check the user: they may have started another scan while we waited.
        if self.per_user_in_flight.get(user_key, 0) >= self.per_user:
            self._release_slot()
            raise UserOverLimit(retry_after_s=self._retry_after_busy())
        self.per_user_in_flight[user_key] = self.per_user_in_flight.get(user_key, 0) + 1
        global_slot = await self._take_global_slot(user_key)
        self.owed_calls += self.calls_per_scan
        self.admitted += 1
        return Ticket(self, user_key, global_slot, waited_s)

    @property
    def waiting(self) -> int:
        """Scans queued for a slot now."""
        return len(self._waiters)

    def adopt(self, user_key: str) -> Ticket:
        """A ticket for a scan another process accepted and died with (app/scans/liveness.py).
        No check refuses it: it was admitted once, its calls were budgeted for then, and its
        demand left with its owner; refusing it now would only waste what it already paid
        for. It holds a slot like any scan, past the cap if need be (the cap is back once
        it ends)."""
        self.in_flight += 1
        self.per_user_in_flight[user_key] = self.per_user_in_flight.get(user_key, 0) + 1
        self.owed_calls += self.calls_per_scan
        self.admitted += 1
        return Ticket(self, user_key, None)

    async def _take_global_slot(self, user_key: str) -> str | None:
        """The user's slot across replicas (None: caps are not shared, or Redis failed
        and this process's count decided). Undoes the local admission if refused."""
        if self._user_caps is None:
            return None
        try:
            slot = await self._user_caps.take(user_key, self.per_user)
        except BaseException:
            self._release(user_key, None)
            raise
        if slot is False:
            self._release(user_key, None)
            raise UserOverLimit(retry_after_s=self._retry_after_busy())
        return slot

    async def _wait_for_slot(self) -> None:
        """Wait (FIFO, bounded) until a finishing scan hands its slot over.

        A released slot goes straight to the oldest waiter, so `in_flight` never drops
        below the cap while anyone waits and a newcomer cannot slip in between."""
        if self.wait_s <= 0:
            raise ServerBusy(retry_after_s=self._retry_after_busy())
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.wait_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._release_slot()  # handed over just as we gave up: pass it on
            else:
                waiter.cancel()
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise ServerBusy(retry_after_s=self._retry_after_busy()) from None
            raise

    def resize(self, max_inflight: int) -> None:
        """A new global cap: a rise admits waiters at once; a fall takes effect as scans end."""
        self.max_inflight = max_inflight
        while self._waiters and self.in_flight < self.max_inflight:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)

    def _release_slot(self) -> None:
        if self.in_flight <= self.max_inflight:  # over the cap after a fall: the slot goes
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    return
        self.in_flight -= 1

    def _release(self, user_key: str, global_slot: str | None) -> None:
        if global_slot is not None and self._user_caps is not None:
            self._user_caps.give_back(global_slot)
        left = self.per_user_in_flight.get(user_key, 1) - 1
        if left:
            self.per_user_in_flight[user_key] = left
        else:
            self.per_user_in_flight.pop(user_key, None)
        self._release_slot()

    def observe_scan_duration(self, seconds: float) -> None:
        self.mean_scan_s += 0.1 * (seconds - self.mean_scan_s)

    def _retry_after_busy(self) -> float:
        # Little's law: with N scans in flight finishing every mean_scan_s, a slot frees
        # about every mean_scan_s / N seconds; the budget may push that further out.
        per_slot = self.mean_scan_s / max(1, self.in_flight)
        return max(1.0, math.ceil(max(per_slot, self._predicted_budget_wait(self.owed_calls))))
