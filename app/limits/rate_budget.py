"""Per-model OpenAI rate budget: two token buckets (requests, tokens) with a strict FIFO queue.

Design decisions:
- Oversize requests run into debt, they are not clamped. A reservation of `tokens` waits until
  the token bucket holds `min(tokens, capacity)` (a full bucket, for an oversize one) and then
  takes all `tokens`, so the bucket may go negative. Later waiters wait for the debt to refill,
  which keeps the long-run rate at the limit whatever the request size.
- `Reservation.settle` applies once; a second call is ignored and returns False.
- `pause(seconds)` only blocks admission (it never shortens an existing pause). The buckets keep
  refilling while paused; they are capped at `burst_fraction` of a minute, so the burst after
  a pause is bounded. The FIFO queue keeps its order.
- Feedback from the upstream never lifts the budget above its configuration: the effective
  limit is the lower of the configured and the latest reported one, and a lower `remaining`
  is adopted, a higher one ignored (the key may be shared with callers we cannot see).
  Reading the headers is `rate_headers.py`; learning a shared key's net refill rate from
  them is `rate_learning.py`.
- What the provider's limiter charges a call, against our estimate, is learned from the
  same headers by `charges` (`charge_learning.py`): callers reserve what it says
  (`Route.limiter_tokens`), count each call as it is sent (`sent`) and hand that back
  with the reply's headers (`observe_headers(..., sent=)`).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Mapping

from app.limits.charge_learning import ChargeLearner, Sent
from app.limits.clock import Clock, MonotonicClock
from app.limits.rate_headers import UpstreamSnapshot, lowercase_headers
from app.limits.rate_learning import NetRateLearner

__all__ = [
    "BudgetDeadlineExceeded",
    "BudgetError",
    "RateBudget",
    "Reservation",
    "UpstreamSnapshot",  # the type of `RateBudget.last_upstream`, defined in rate_headers
]

_EPS = 1e-6  # bucket amounts: a deficit this small counts as "fits" (float refill rounding)
_EPS_T = 1e-9  # seconds: a wait this short counts as zero (FakeClock lands on exact times)


class BudgetError(Exception):
    """Base class for rate budget refusals."""


class BudgetDeadlineExceeded(BudgetError):
    """The reservation could not be admitted before its deadline."""


class Reservation:
    """One admitted request: 1 request plus `tokens` tokens taken from the budget."""

    __slots__ = ("_budget", "_settled", "sent", "tokens")

    def __init__(self, budget: RateBudget, tokens: int) -> None:
        self._budget = budget
        self.tokens = tokens
        self._settled = False
        self.sent: Sent | None = None  # the call as sent, once it is (`RateBudget.sent`)

    @property
    def settled(self) -> bool:
        return self._settled

    def settle(self, actual_tokens: int | None) -> bool:
        """Reconcile after the call; returns False (and does nothing) if already settled.

        `actual_tokens` is the real usage total: the surplus is refunded, a shortfall charged.
        None means the request never reached the upstream: tokens and the request are refunded.
        """
        if actual_tokens is not None and actual_tokens < 0:
            raise ValueError(f"actual_tokens must be >= 0 or None, got {actual_tokens!r}")
        if self._settled:
            return False
        self._settled = True
        if actual_tokens is None:
            self._budget._credit(1.0, float(self.tokens))
        elif actual_tokens != self.tokens:
            self._budget._credit(0.0, float(self.tokens - actual_tokens))
        return True

    def __repr__(self) -> str:
        return f"Reservation(tokens={self.tokens}, settled={self._settled})"


class _Waiter:
    """A queued reservation; `wake` is resolved when the budget changes under it."""

    __slots__ = ("tokens", "wake")

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.wake: asyncio.Future[None] | None = None


def _positive_int(name: str, value: object) -> int:
    """A limit of zero would mean infinite waits, and bool is an int: refuse both by name."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class RateBudget:
    """RPM/TPM budget for one model; see the module docstring for the design decisions."""

    def __init__(
        self,
        *,
        rpm: int,
        tpm: int,
        burst_fraction: float = 0.1,
        clock: Clock | None = None,
        name: str = "default",
    ) -> None:
        self._cfg_rpm = _positive_int("rpm", rpm)
        self._cfg_tpm = _positive_int("tpm", tpm)
        if (
            isinstance(burst_fraction, bool)
            or not isinstance(burst_fraction, int | float)
            or not 0.0 < burst_fraction <= 1.0
        ):
            raise ValueError(f"burst_fraction must be in (0, 1], got {burst_fraction!r}")
        self._fraction = float(burst_fraction)
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self.name = name
        self._obs_rpm: int | None = None
        self._obs_tpm: int | None = None
        self._learned = NetRateLearner()  # net refill per minute learned from headers
        # What the limiter charges against our estimate (replaced by the owner with its
        # provider's and settings' learner).
        self.charges = ChargeLearner()
        self._req = self._tok = math.inf
        self._apply_limits()  # clamps the buckets to capacity: they start full
        self._last = self._clock.now()
        self._paused_until = self._last
        # FIFO of waiters. Only queue[0] (the head) looks at the buckets: strict order means a
        # big request is never starved by a stream of small ones, at the price of smalls
        # waiting behind it. The head sleeps until its predicted fit time but is woken (its
        # `wake` future resolved) whenever the budget changes, because the prediction changes.
        self._queue: deque[_Waiter] = deque()
        self.last_upstream: UpstreamSnapshot | None = None

    # ----- admission ----------------------------------------------------------------------

    async def reserve(self, tokens: int, *, deadline: float | None = None) -> Reservation:
        """Take 1 request + `tokens` tokens, waiting in FIFO order.

        Raises BudgetDeadlineExceeded as soon as the predicted admission time is after
        `deadline` (absolute clock time), or when the deadline passes while waiting.
        Cancellation leaves no trace: nothing is taken and the next waiter moves up.
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
        wait = self.predicted_wait(tokens)
        self._check_deadline(wait, deadline)
        if wait == 0.0 and not self._queue:
            return self._take(tokens)  # fast path: nobody ahead (FIFO) and it fits now
        waiter = _Waiter(tokens)
        self._queue.append(waiter)
        loop = asyncio.get_running_loop()
        try:
            while True:
                # A fresh future before each re-computation: a change after this point
                # resolves it, so no notification can be lost between compute and wait.
                waiter.wake = loop.create_future()
                sleep: float | None = None  # None: not the head, wait to be woken
                if self._queue[0] is waiter:
                    sleep = self._head_wait(tokens)
                    if sleep == 0.0:
                        self._queue.popleft()
                        self._notify_head()
                        return self._take(tokens)
                    self._check_deadline(sleep, deadline)
                if deadline is not None:
                    left = deadline - self._clock.now()
                    if left <= _EPS_T:
                        raise BudgetDeadlineExceeded(f"{self.name}: deadline passed in queue")
                    sleep = left if sleep is None else min(sleep, left)
                await self._sleep_or_wake(waiter.wake, sleep)
        except BaseException:
            self._leave(waiter)
            raise

    def predicted_wait(self, tokens: int, *, ahead: int = 0) -> float:
        """Seconds until a new `tokens` request joining the queue now would be admitted.

        `ahead` counts requests not queued yet that will be served first (admission
        control passes the calls that already-admitted scans still owe), each assumed
        to be of size `tokens`."""
        now = self._refill()
        t = max(now, self._paused_until)
        req = min(self._cap_req, self._req + self._rate_req * (t - now))
        tok = min(self._cap_tok, self._tok + self._rate_tok * (t - now))
        # Simulate the queue ahead in order; each demand is admitted once both buckets fit.
        for demand in (w.tokens for w in self._queue):
            dt = self._fit_time(req, tok, demand)
            t += dt
            req = min(self._cap_req, req + self._rate_req * dt) - 1.0
            tok = min(self._cap_tok, tok + self._rate_tok * dt) - demand
        if ahead > 0:
            # `ahead` equal demands admitted back to back: in closed form, because admission
            # asks this for every new scan and `ahead` runs into the thousands at high
            # concurrency. Served continuously, the buckets never refill to their cap.
            dt = max(0.0, (ahead - req) / self._rate_req, (ahead * tokens - tok) / self._rate_tok)
            t += dt
            req += self._rate_req * dt - ahead
            tok += self._rate_tok * dt - ahead * tokens
        dt = self._fit_time(req, tok, tokens)
        t += dt
        wait = t - now
        return wait if wait > _EPS_T else 0.0

    # ----- feedback from the upstream -----------------------------------------------------

    async def sent(self, kind: str, estimate: int) -> Sent:
        """Number a call of `kind` about to be sent, whose limiter count is `estimate` by
        today's formula: its reply's headers then say what it was charged."""
        now = self._clock.now()
        self.charges.relax(now)
        return self.charges.count(kind, estimate, now)

    def charge_refused(self, kind: str, reserved: int, wait_s: float | None, limit_type: str | None) -> None:
        """A 429 for a call that reserved `reserved`: unless it says requests ran out, the
        learned charge was too low (`charge_learning.py`); the wait it asked for, at our
        refill, is what the limiter lacked."""
        if limit_type == "requests":
            return
        missing = None if wait_s is None else wait_s * self.effective_tpm / 60.0
        self.charges.rate_limited(kind, self._clock.now(), reserved=reserved, missing=missing)

    def observe_headers(
        self, headers: Mapping[str, str], *, sent: Sent | None = None, charged: bool = True
    ) -> None:
        """Learn from `x-ratelimit-*` response headers; only ever lowers the budget.
        `sent`: the call they answer (`charged`: False for a 429), to learn its charge."""
        h = lowercase_headers(headers)
        if h is None:
            return
        # Refill at the old rates before anything changes.
        snap = UpstreamSnapshot.from_headers(h, observed_at=self._refill())
        self.last_upstream = snap
        if sent is not None and snap.remaining_tokens is not None:
            limit = snap.limit_tokens or self._cfg_tpm
            refill = min(limit, self._learned.tpm) if self._learned.tpm is not None else limit
            self.charges.observed(
                sent, snap.remaining_tokens, limit=limit, refill_per_min=refill, charged=charged
            )
        before = (self._effective(), self._req, self._tok)
        # Effective limit = min(configured, latest observed); a limit of 0 is treated as garbage.
        if snap.limit_requests:
            self._obs_rpm = snap.limit_requests
        if snap.limit_tokens:
            self._obs_tpm = snap.limit_tokens
        self._learned.observe(snap)
        self._apply_limits()
        # The key is shared with callers we cannot see: adopt a lower remaining, never a higher.
        if snap.remaining_requests is not None:
            self._req = min(self._req, float(snap.remaining_requests))
        if snap.remaining_tokens is not None:
            self._tok = min(self._tok, float(snap.remaining_tokens))
        if (self._effective(), self._req, self._tok) != before:
            self._notify_head()

    def pause(self, seconds: float) -> None:
        """Admit nobody until now + `seconds` (after a 429). Extends, never shortens."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        until = self._refill() + seconds
        if until > self._paused_until:
            self._paused_until = until
            self._notify_head()

    # ----- metrics ------------------------------------------------------------------------

    @property
    def available_requests(self) -> float:
        self._refill()
        return self._req

    @property
    def available_tokens(self) -> float:
        """May be negative: debt left by an oversize reservation or an extra charge."""
        self._refill()
        return self._tok

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def paused_until(self) -> float:
        return self._paused_until

    @property
    def effective_rpm(self) -> int:
        return self._effective()[0]

    @property
    def effective_tpm(self) -> int:
        return self._effective()[1]

    @property
    def request_capacity(self) -> float:
        return self._cap_req

    @property
    def token_capacity(self) -> float:
        return self._cap_tok

    def __repr__(self) -> str:
        return (
            f"RateBudget(name={self.name!r}, rpm={self.effective_rpm}, tpm={self.effective_tpm},"
            f" requests={self.available_requests:.2f}, tokens={self.available_tokens:.0f},"
            f" waiting={self.waiting})"
        )

    # ----- internals ----------------------------------------------------------------------

    def _effective(self) -> tuple[int, int]:
        """The limits in force: configured, lowered by reported and then by learned ones."""
        rpm = min(self._cfg_rpm, self._obs_rpm or self._cfg_rpm)
        tpm = min(self._cfg_tpm, self._obs_tpm or self._cfg_tpm)
        return self._learned.cap(rpm, tpm)

    def _apply_limits(self) -> None:
        """Derive rates and capacities from the effective limits; clamp buckets to capacity."""
        rpm, tpm = self._effective()
        self._rate_req, self._rate_tok = rpm / 60.0, tpm / 60.0
        self._cap_req = max(1.0, rpm * self._fraction)
        self._cap_tok = max(1.0, tpm * self._fraction)
        self._req = min(self._req, self._cap_req)
        self._tok = min(self._tok, self._cap_tok)

    def _refill(self) -> float:
        """Bring both buckets up to now; everything that reads them calls this first."""
        now = self._clock.now()
        dt = now - self._last
        if dt > 0:
            self._req = min(self._cap_req, self._req + self._rate_req * dt)
            self._tok = min(self._cap_tok, self._tok + self._rate_tok * dt)
            self._last = now
        return now

    def _fit_time(self, req: float, tok: float, tokens: int) -> float:
        """Seconds until buckets at `req`/`tok` fit one request of `tokens`."""
        # Debt: an oversize demand waits only for a full bucket, then takes all it asked for.
        need_tok = min(float(tokens), self._cap_tok)
        d_req, d_tok = 1.0 - req, need_tok - tok
        t_req = d_req / self._rate_req if d_req > _EPS else 0.0
        t_tok = d_tok / self._rate_tok if d_tok > _EPS else 0.0
        return max(t_req, t_tok)

    def _head_wait(self, tokens: int) -> float:
        """How long the head of the queue must still wait: the pause, or the refill."""
        now = self._refill()
        pause = self._paused_until - now
        wait = max(pause if pause > _EPS_T else 0.0, self._fit_time(self._req, self._tok, tokens))
        return wait if wait > 0.0 else 0.0

    def _take(self, tokens: int) -> Reservation:
        self._req -= 1.0
        self._tok -= tokens
        return self._reservation(tokens)

    def _reservation(self, tokens: int) -> Reservation:
        """The receipt `_take` hands out (a subclass may remember more with it)."""
        return Reservation(self, tokens)

    def _credit(self, requests: float, tokens: float) -> None:
        """Refund (positive) or charge (negative tokens) after settle; refunds cap at capacity."""
        self._refill()
        self._req = min(self._cap_req, self._req + requests)
        self._tok = min(self._cap_tok, self._tok + tokens)
        self._notify_head()

    def _check_deadline(self, wait: float, deadline: float | None) -> None:
        """Refuse as soon as the wait is known to end late, rather than when it does."""
        if deadline is not None and self._clock.now() + wait > deadline + _EPS_T:
            raise BudgetDeadlineExceeded(f"{self.name}: predicted wait {wait:.3f}s ends after the deadline")

    def _notify_head(self) -> None:
        """Wake the head to recompute its wait: the budget just changed under it."""
        if self._queue:
            wake = self._queue[0].wake
            if wake is not None and not wake.done():
                wake.set_result(None)

    def _leave(self, waiter: _Waiter) -> None:
        """Drop a waiter that gave up; if it was the head, the next one takes over."""
        if waiter in self._queue:
            was_head = self._queue[0] is waiter
            self._queue.remove(waiter)
            if was_head:
                self._notify_head()

    async def _sleep_or_wake(self, wake: asyncio.Future[None], seconds: float | None) -> None:
        """Sleep on the clock (FakeClock in tests) until `seconds` pass or `wake` fires."""
        if seconds is None:
            await wake
            return
        sleeper = asyncio.create_task(self._clock.sleep(seconds))
        try:
            await asyncio.wait((wake, sleeper), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
