"""`Breaker`: the health of one deployment, so that calls go where they can succeed.

Closed: calls go. A run of failures (`FAILURES_TO_OPEN` in a row), or too many in a
window (`WINDOW_S`, at least `WINDOW_MIN_CALLS` calls, `WINDOW_FAILURE_RATIO` failed),
opens it for a cooldown: the wait the upstream asked for when it gave one, else
`UPSTREAM_OPEN_S` (`OPEN_BASE_S` by default), doubling with each reopening up to
`OPEN_MAX_S`. Past the cooldown one
call at a time probes it (half-open): a success closes it, a failure opens it again.

A deployment can also be taken out: a key refused or a deployment that does not exist
(401/403/404) for `OUT_RETRY_S`, an exhausted quota for `QUOTA_COOLDOWN_S`; then probed
like an open one. Taking out is logged as an error: someone has to fix it.
"""

from __future__ import annotations

import logging
from collections import deque

log = logging.getLogger(__name__)

FAILURES_TO_OPEN = 3
WINDOW_S = 30.0
WINDOW_MIN_CALLS = 10
WINDOW_FAILURE_RATIO = 0.5
OPEN_BASE_S = 5.0
OPEN_MAX_S = 60.0
# A refused key or a missing deployment is not fixed by waiting: probed rarely.
OUT_RETRY_S = 300.0
# An exhausted quota (billing) comes back when someone pays, or at the period's turn.
QUOTA_COOLDOWN_S = 600.0

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class Breaker:
    def __init__(self, name: str, *, open_base_s: float = OPEN_BASE_S) -> None:
        self.name = name
        self._open_base_s = open_base_s
        self.state = CLOSED
        self.reason = ""  # why it is open or out, for logs and /readyz
        self.out = False  # taken out (a key, a deployment or a quota), not just failing
        self.open_until = 0.0
        self.probing = False
        self.opened = 0  # times opened in a row: the cooldown doubles with it
        self.verdicts = 0  # calls that said something about the deployment (success or failure)
        self._failures_in_a_row = 0
        self._recent: deque[tuple[float, bool]] = deque()

    def ready(self, now: float) -> bool:
        """May a call go to this deployment now (a probe, when half-open)? Changes nothing."""
        if self.state == CLOSED:
            return True
        return now >= self.open_until and not self.probing

    def begin(self, now: float) -> bool:
        """A call goes: past its cooldown an open breaker lets this one through as the probe
        (True: this call is the probe)."""
        if self.state != CLOSED and now >= self.open_until and not self.probing:
            self.state, self.probing = HALF_OPEN, True
            return True
        return False

    def succeeded(self, now: float) -> None:
        self.verdicts += 1
        self._record(now, ok=True)
        self._failures_in_a_row = 0
        if self.state != CLOSED:
            log.warning("upstream %s is back (%s)", self.name, self.reason or "probe succeeded")
        self.state, self.probing, self.opened, self.out, self.reason = CLOSED, False, 0, False, ""

    def failed(self, now: float, reason: str, wait_s: float | None = None) -> None:
        """A failure that says something about the deployment (not about the request)."""
        self.verdicts += 1
        self._record(now, ok=False)
        self._failures_in_a_row += 1
        if (
            self.state == HALF_OPEN
            or self._failures_in_a_row >= FAILURES_TO_OPEN
            or self._window_failing(now)
        ):
            cooldown = min(OPEN_MAX_S, self._open_base_s * 2**self.opened)
            self._open(now, max(cooldown, wait_s or 0.0), reason)

    def take_out(self, now: float, reason: str, seconds: float) -> None:
        self.verdicts += 1
        if not self.out:
            log.error("upstream %s taken out for %.0f s: %s", self.name, seconds, reason)
        self.out = True
        self._open(now, seconds, reason)

    def released(self) -> None:
        """The probe ended without a verdict (cancelled): the probe slot is free again."""
        self.probing = False

    def _open(self, now: float, seconds: float, reason: str) -> None:
        if self.state == CLOSED:
            log.warning("upstream %s: circuit open for %.1f s (%s)", self.name, seconds, reason)
        self.state, self.probing, self.reason = OPEN, False, reason
        self.open_until = now + seconds
        self.opened += 1
        self._failures_in_a_row = 0

    def _record(self, now: float, *, ok: bool) -> None:
        self._recent.append((now, ok))
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent.popleft()

    def _window_failing(self, now: float) -> bool:
        if len(self._recent) < WINDOW_MIN_CALLS:
            return False
        failed = sum(1 for _, ok in self._recent if not ok)
        return failed / len(self._recent) >= WINDOW_FAILURE_RATIO
