"""The event loop's capacity: how much of it the scans use, and how fast new scans may
come so that it stays under LOOP_UTILISATION_TARGET.

Every byte of every scan passes through one thread: the loop's (accepting, events, stream
writes, database results). When that thread runs out of CPU every open stream freezes at
once, and calls time out for our lateness, not the provider's. Loop lag is the symptom,
and as an admission signal it collapses admission (a stall is seen once it is over, and
any stall looks alike); the cause is the CPU the loop spends, which is measured here.

Every `SAMPLE_INTERVAL_S`, from the loop thread itself:
- **utilisation**: the share of wall time the loop thread wanted the CPU, running
  (its CPU time) or runnable but waiting for a core (Linux's per-thread `schedstat`;
  elsewhere only `time.thread_time()` is known), over the last seconds
  (`UTILISATION_WINDOW_S`). The wait matters on a shared box: a loop that gets half a
  core is saturated at 50 % CPU;
- **share**: of the time it wanted the CPU, how much it got (the CPU the process gets);
- **CPU per scan**: the loop's CPU a second over the scans admitted a second, both
  averaged over `COST_WINDOW_S` (longer than a scan lives: a scan's streams cost the
  loop for its whole life, not when it is admitted), what refusals cost taken out.

The rate new scans may start at is the rate they were admitted at lately (over
`COST_WINDOW_S`) plus what the headroom takes: (goal - utilisation) x share / CPU per scan,
the goal being the target, or `HYSTERESIS` under it while the loop is saturated (at or
over the target, until it is that far under it). Over the goal the headroom is negative
and the rate falls under the recent one, slowly, as the recent one follows: admissions
change the loop's load only as the scans they start live, so a controller faster than that
would cut admission to nothing before its first cut showed (a ratchet that collapsed
admission in a benchmark). Never under `MIN_RATE`, so the loop keeps measuring.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable

from app.limits.moves import Moves

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 0.5
# Utilisation is averaged over about this long (seconds): a GC pause is not a saturation.
UTILISATION_WINDOW_S = 2.0
# The loop's CPU and the scans admitted are averaged over about this long (seconds).
COST_WINDOW_S = 30.0
# Saturated from the target up; not saturated again until this far under it.
HYSTERESIS = 0.1
# The CPU per scan is measured once the window holds this many admitted scans.
MIN_SCANS_FOR_COST = 20
# Before any is measured, a scan is assumed to cost the loop this much CPU (seconds): a
# scan of two calls and a streamed answer on a 2-core box (docs/benchmarks.md).
PRIOR_CPU_PER_SCAN_S = 0.003
# However busy the loop, this many scans a second still start.
MIN_RATE = 1.0


class LoopClock:
    """The loop thread's CPU and run-queue wait (seconds), read from that thread."""

    def __init__(self) -> None:
        self._path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self.waits_known = self._schedstat() is not None

    def read(self) -> tuple[float, float]:
        stat = self._schedstat() if self.waits_known else None
        if stat is None:
            return time.thread_time(), 0.0
        return stat

    def _schedstat(self) -> tuple[float, float] | None:
        try:
            with open(self._path, encoding="ascii") as file:
                running_ns, waiting_ns, _slices = file.read().split()
        except (OSError, ValueError):
            return None
        return int(running_ns) / 1e9, int(waiting_ns) / 1e9


class LoopCapacity:
    """Samples the loop (run `run()` as a task on it); `rate` is scans/s new scans may start at."""

    def __init__(
        self,
        *,
        target: float,
        admitted: Callable[[], int],
        clock: LoopClock | None = None,
        on_change: Callable[[str, str], None] = lambda _limit, _reason: None,
        interval_s: float = SAMPLE_INTERVAL_S,
    ) -> None:
        self.target = target
        self._admitted = admitted
        self._clock = clock
        self._interval_s = interval_s
        self.utilisation = 0.0
        self.share = 1.0
        self.cpu_per_scan_s = PRIOR_CPU_PER_SCAN_S
        self.scans_per_s = 0.0  # admitted, averaged over COST_WINDOW_S
        self._cpu_per_s = 0.0  # the loop's, refusals' taken out, likewise
        self.saturated = False
        self.rate = max(MIN_RATE, target / PRIOR_CPU_PER_SCAN_S)
        self.reason = "prior"
        self._refusals_cpu_s = 0.0  # what refusals cost the loop since the last sample
        self._last: tuple[float, float, float, int] | None = None
        self._moves: Moves[str] = Moves(on_change, str, {"loop_rate": self.limit})

    @property
    def limit(self) -> int:
        """The rate as `ecoscan_limit{limit="loop_rate"}` shows it: scans a second, rounded up."""
        return math.ceil(self.rate)

    def refused(self, cpu_s: float) -> None:
        self._refusals_cpu_s += cpu_s

    async def run(self) -> None:
        self._clock = self._clock or LoopClock()  # made here: on the loop's thread
        while True:
            cpu, wait = self._clock.read()
            try:
                self.sample(time.monotonic(), cpu, wait, self._admitted())
            except Exception:  # a bug here must not freeze the rate where it stands
                log.exception("sampling the event loop's capacity failed; again in %.1f s", self._interval_s)
            await asyncio.sleep(self._interval_s)

    def sample(self, now: float, cpu: float, wait: float, admitted: int) -> None:
        """One reading of the loop thread's CPU and wait totals and the scans admitted so far."""
        last, self._last = self._last, (now, cpu, wait, admitted)
        if last is None or now <= last[0]:
            return
        wall, used, waited, scans = now - last[0], cpu - last[1], wait - last[2], admitted - last[3]
        refusals, self._refusals_cpu_s = self._refusals_cpu_s, 0.0
        wanted = min(1.0, (used + waited) / wall)
        self.utilisation += (1 - math.exp(-wall / UTILISATION_WINDOW_S)) * (wanted - self.utilisation)
        if used + waited > 0:
            self.share = max(0.05, used / (used + waited))
        weight = 1 - math.exp(-wall / COST_WINDOW_S)
        self.scans_per_s += weight * (scans / wall - self.scans_per_s)
        self._cpu_per_s += weight * (max(0.0, used - refusals) / wall - self._cpu_per_s)
        if self.scans_per_s * COST_WINDOW_S >= MIN_SCANS_FOR_COST:
            self.cpu_per_scan_s = self._cpu_per_s / self.scans_per_s
        if self.utilisation >= self.target:
            self.saturated = True
        elif self.utilisation < self.target - HYSTERESIS:
            self.saturated = False
        goal = self.target - HYSTERESIS if self.saturated else self.target
        rate = self.scans_per_s + (goal - self.utilisation) * self.share / self.cpu_per_scan_s
        reason = "saturated" if self.saturated else "cpu"
        if rate <= MIN_RATE:
            rate, reason = MIN_RATE, "floor"
        self.rate, self.reason = rate, reason
        self._moves.moved("loop_rate", self.limit, reason)
