"""Event-loop health: a timer that should fire every `interval_s`; how late it fires
is how long some callback held the loop. Cheap enough to run always.

`LoopLateness` keeps what the probe knows for those who must ask "is the loop late right
now?" (app/limits/late_timeouts.py): the probe's last lag, and how overdue its pending
timer is, since a stall is seen by the probe only once it ends."""

from __future__ import annotations

import asyncio

from app.runtime.metrics import Metrics

PROBE_INTERVAL_S = 0.05


class LoopLateness:
    """How late the loop is now, in the loop's clock: the larger of how overdue the probe's
    pending timer is and the lag the probe measured within the last `recent_s`."""

    __slots__ = ("_due", "_last_at", "_last_lag", "_recent_s")

    def __init__(self, recent_s: float = 2 * PROBE_INTERVAL_S) -> None:
        self._recent_s = recent_s
        self._due = float("inf")
        self._last_lag = 0.0
        self._last_at = float("-inf")

    def waiting_until(self, due: float) -> None:
        self._due = due

    def measured(self, lag: float, now: float) -> None:
        self._due = float("inf")
        self._last_lag, self._last_at = lag, now

    def now(self, now: float) -> float:
        overdue = max(0.0, now - self._due)
        recent = self._last_lag if now - self._last_at <= self._recent_s else 0.0
        return max(overdue, recent)


async def probe_loop_lag(
    metrics: Metrics, interval_s: float = PROBE_INTERVAL_S, lateness: LoopLateness | None = None
) -> None:
    loop = asyncio.get_running_loop()
    worst = 0.0
    while True:
        scheduled = loop.time() + interval_s
        if lateness is not None:
            lateness.waiting_until(scheduled)
        await asyncio.sleep(interval_s)
        now = loop.time()
        lag = max(0.0, now - scheduled)
        if lateness is not None:
            lateness.measured(lag, now)
        metrics.loop_lag.observe(lag)
        if lag > worst:
            worst = lag
            metrics.loop_lag_max.set(worst)
