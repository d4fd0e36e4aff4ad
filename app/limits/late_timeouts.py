"""Timeouts our own loop caused: a connect or first-byte timeout that fired while the event
loop was late is not the provider's failure.

A timeout is a timer on the loop. When the loop is held (a wave of arrivals, a long
callback, a box with no core free), the reply may have come and sat in the socket while
the deadline passed: the provider answered, we did not look. Counted as the provider's,
such a timeout opens its breaker, cuts its limit and spends one of the call's attempts;
under a CPU overload every deployment looks down at once and healthy scans fail with
`UPSTREAM_ERROR` after their last attempt (issue 38).

So when one fires, the loop's lateness at that moment is asked (app/runtime/loop_lag.py:
how overdue the lag probe's timer is, or the lag it just measured). At `LATE_S` or more,
it is ours: the caller sends the call again at once, not counted against the deployment's
breaker, its limit or the call's attempts (the scan's deadline still bounds it). Either
way the cause is counted (`ecoscan_upstream_timeouts_total{stage,cause}`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from app.runtime.loop_lag import LoopLateness

# A loop this late (seconds) when a timeout fires has held that timeout's callbacks too.
LATE_S = 0.25
# Forgiven timeouts per call: one. A loop that stays late (a saturated box) would otherwise
# resend a call to a deployment that really is silent until its deadline, its breaker never
# told; the second timeout counts as the provider's whatever the loop's lateness.
MAX_FORGIVEN = 1
# The causes a timeout is counted under.
LOOP_LATE = "loop_late"
UPSTREAM = "upstream"


class LateTimeouts:
    def __init__(self, lateness: LoopLateness, on_timeout: Callable[[str, str], None]) -> None:
        self._lateness = lateness
        self._on_timeout = on_timeout

    def ours(self, stage: str, *, forgivable: bool = True) -> bool:
        """A connect or first-byte timeout of a `stage` call just fired: was our loop late
        (and may the call still be forgiven one)? Counted under the cause it is taken for."""
        late = forgivable and self._lateness.now(asyncio.get_running_loop().time()) >= LATE_S
        self._on_timeout(stage, LOOP_LATE if late else UPSTREAM)
        return late
