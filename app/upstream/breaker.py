"""`Breaker`: the health of one deployment, so that calls go where they can succeed.

Closed: calls go. A run of failures (`FAILURES_TO_OPEN` in a row), or too many in a
window (`WINDOW_S`, at least `WINDOW_MIN_CALLS` calls, `WINDOW_FAILURE_RATIO` failed),
opens it for a cooldown: the wait the upstream asked for when it gave one, else
`UPSTREAM_OPEN_S` (`OPEN_BASE_S` by default), doubling with each reopening up to
`UPSTREAM_PROBE_MAX_S` (`OPEN_MAX_S`). Past the cooldown one probe at a time tests it
(half-open): a success closes it, a failure opens it again. Probes are the service's
own requests (app/upstream/probes.py), never a user's call: only a closed breaker is
`ready` for calls, and a call with nowhere to go waits for a return (`watch_closed`).

A deployment can also be taken out: a key refused or a deployment that does not exist
(401/403/404) for `OUT_RETRY_S`, an exhausted quota for `QUOTA_COOLDOWN_S`, a token that
could not be had for `CREDENTIAL_RETRY_S`; then probed
like an open one. Taking out is logged as an error: someone has to fix it.

A success says the deployment works only if its call was sent after the last failure (a
stream in flight when it went down may still finish fine). Calls waiting to go to it
`watch_open`, to go elsewhere the moment it opens.

With REDIS_URL, what one replica learns reaches the others (app/upstream/shared_breaker.py):
its own changes go to `listener`; what another replica found arrives through `adopt_open`,
`adopt_closed` and `probed_elsewhere`, which change this breaker without telling the
listener again.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Protocol

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
# No token to be had (app/upstream/credentials.py): its service may answer again soon.
CREDENTIAL_RETRY_S = 30.0
CREDENTIAL_REASON = "no credential"

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class BreakerListener(Protocol):
    """Told of this replica's own changes (to share them)."""

    def opened(self, breaker: Breaker, seconds: float) -> None: ...

    def closed(self, breaker: Breaker) -> None: ...

    def probe_ended(self, breaker: Breaker) -> None: ...


class Breaker:
    def __init__(
        self, name: str, *, open_base_s: float = OPEN_BASE_S, open_max_s: float = OPEN_MAX_S
    ) -> None:
        self.name = name
        self._open_base_s = open_base_s
        self._open_max_s = max(open_max_s, open_base_s)
        self.state = CLOSED
        self.reason = ""  # why it is open or out, for logs and /readyz
        self.out = False  # taken out (a key, a deployment or a quota), not just failing
        self.open_until = 0.0
        self.probing = False
        self.opened = 0  # times opened in a row: the cooldown doubles with it
        self.verdicts = 0  # calls that said something about the deployment (success or failure)
        self._failures_in_a_row = 0
        self._recent: deque[tuple[float, bool]] = deque()
        self.listener: BreakerListener | None = None
        self._probes = 0  # probes begun: the current one's id
        self._last_failure_at = -math.inf
        self._opened_at = -math.inf  # when it last opened: calls sent before say nothing since
        self._open_watchers: set[Callable[[], None]] = set()
        self._closed_watchers: set[Callable[[], None]] = set()

    def gauge(self) -> int:
        """`ecoscan_upstream_state`: 0 closed, 1 open, 2 half-open, 3 taken out."""
        if self.out:
            return 3
        return {CLOSED: 0, HALF_OPEN: 2}.get(self.state, 1)

    def describe(self, now: float) -> str:
        """For `/readyz`: "closed", "probing", or "open"/"out" with why and for how long."""
        if self.state == CLOSED:
            return "closed"
        if self.probing:
            return f"probing ({self.reason})"
        left = max(0.0, self.open_until - now)
        return f"{'out' if self.out else 'open'} for {left:.0f} s more ({self.reason})"

    def watch_open(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the breaker next opens or is taken out (here or on another
        replica's word), once; `unwatch_open` when no longer interested."""
        self._open_watchers.add(callback)

    def unwatch_open(self, callback: Callable[[], None]) -> None:
        self._open_watchers.discard(callback)

    def watch_closed(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the breaker next closes (a probe succeeded, here or on
        another replica), once; `unwatch_closed` when no longer interested."""
        self._closed_watchers.add(callback)

    def unwatch_closed(self, callback: Callable[[], None]) -> None:
        self._closed_watchers.discard(callback)

    def _tell_watchers(self) -> None:
        watchers, self._open_watchers = self._open_watchers, set()
        for callback in watchers:
            callback()

    def _tell_closed(self) -> None:
        watchers, self._closed_watchers = self._closed_watchers, set()
        for callback in watchers:
            callback()

    def would_probe(self, now: float) -> bool:
        """Would a call now be this deployment's probe?"""
        return self.state != CLOSED and now >= self.open_until and not self.probing

    def ready(self, now: float) -> bool:
        """May a user's call go to this deployment now? Only when closed: probes test an
        open one. Changes nothing."""
        return self.state == CLOSED

    def begin(self, now: float) -> int:
        """A call goes: past its cooldown an open breaker lets this one through as the probe.
        Returns the probe's id (0: this call is not the probe)."""
        if self.would_probe(now):
            self.state, self.probing = HALF_OPEN, True
            self._probes += 1
            return self._probes
        return 0

    def succeeded(self, now: float, started: float | None = None) -> None:
        """A call that `started` then succeeded. One that started before the last failure
        says nothing about the deployment since (a long stream finishing after it went
        down): it counts in the window, but neither ends a run of failures nor closes it."""
        self.verdicts += 1
        self._record(now, ok=True)
        if started is not None and started < self._last_failure_at:
            return
        self._failures_in_a_row = 0
        was_closed = self.state == CLOSED
        if not was_closed:
            log.warning("upstream %s is back (%s)", self.name, self.reason or "probe succeeded")
            if self.listener is not None:
                self.listener.closed(self)
        self.state, self.probing, self.opened, self.out, self.reason = CLOSED, False, 0, False, ""
        if not was_closed:
            self._tell_closed()

    def failed(
        self, now: float, reason: str, wait_s: float | None = None, *, sent_at: float | None = None
    ) -> None:
        """A failure that says something about the deployment (not about the request), of
        a call sent at `sent_at`."""
        self.verdicts += 1
        self._record(now, ok=False)
        late = sent_at is not None and sent_at < self._opened_at and self.state != CLOSED
        if self.state == OPEN or late:
            # Already open (or probing): this call was sent before it opened, or went anyway
            # with nowhere else to go. The probe after the cooldown decides; calls already on
            # their way when it opened neither extend it nor double the next cooldown, nor
            # void a probe's success. A provider's own wait still holds.
            if wait_s and self.state == OPEN:
                self.open_until = max(self.open_until, now + wait_s)
            return
        self._last_failure_at = now
        self._failures_in_a_row += 1
        if (
            self.state == HALF_OPEN
            or self._failures_in_a_row >= FAILURES_TO_OPEN
            or self._window_failing(now)
        ):
            cooldown = min(self._open_max_s, self._open_base_s * 2**self.opened)
            self._open(now, max(cooldown, wait_s or 0.0), reason)

    def take_out(self, now: float, reason: str, seconds: float) -> None:
        self.verdicts += 1
        self._last_failure_at = now
        if not self.out:
            log.error("upstream %s taken out for %.0f s: %s", self.name, seconds, reason)
        self.out = True
        self._open(now, seconds, reason)

    def released(self, probe: int) -> None:
        """Probe `probe` ended without a verdict (cancelled, or its call never went): the
        probe slot is free again, unless a verdict or another probe came since."""
        if not self.probing or probe != self._probes:
            return
        self.probing = False
        if self.listener is not None:
            self.listener.probe_ended(self)

    def adopt_open(self, now: float, seconds: float, *, out: bool, reason: str, opened: int) -> None:
        """Another replica found it failing (or took it out): open for `seconds` more, and
        opened `opened` times in a row (a failed probe from here doubles from there)."""
        if self.state == HALF_OPEN and not out:
            return  # our probe is in flight: its verdict is fresher
        if out and not self.out:
            log.error("upstream %s taken out for %.0f s by another replica: %s", self.name, seconds, reason)
        elif self.state == CLOSED:
            log.warning(
                "upstream %s: open for %.1f s, as another replica found (%s)", self.name, seconds, reason
            )
        self.state, self.probing, self.out, self.reason = OPEN, False, out, reason
        self.open_until = now + seconds
        self._opened_at = now
        self.opened = max(self.opened, opened)
        self._failures_in_a_row = 0
        self._last_failure_at = now  # calls sent before this replica knew do not vouch for it
        self._tell_watchers()

    def adopt_closed(self) -> None:
        """Another replica's probe succeeded: calls go again."""
        if self.state == OPEN:
            log.warning("upstream %s is back (another replica's probe succeeded)", self.name)
            self.state, self.opened, self.out, self.reason = CLOSED, 0, False, ""
            self._failures_in_a_row = 0
            self._tell_closed()

    def probed_elsewhere(self, now: float, seconds: float) -> None:
        """Another replica is probing it: no probe from here for `seconds`."""
        if self.state == OPEN:
            self.open_until = max(self.open_until, now + seconds)

    def _open(self, now: float, seconds: float, reason: str) -> None:
        if self.state == CLOSED:
            log.warning("upstream %s: circuit open for %.1f s (%s)", self.name, seconds, reason)
        self.state, self.probing, self.reason = OPEN, False, reason
        self.open_until = now + seconds
        self._opened_at = now
        self.opened += 1
        self._failures_in_a_row = 0
        if self.listener is not None:
            self.listener.opened(self, seconds)
        self._tell_watchers()

    def _record(self, now: float, *, ok: bool) -> None:
        self._recent.append((now, ok))
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent.popleft()

    def _window_failing(self, now: float) -> bool:
        if len(self._recent) < WINDOW_MIN_CALLS:
            return False
        failed = sum(1 for _, ok in self._recent if not ok)
        return failed / len(self._recent) >= WINDOW_FAILURE_RATIO
