"""The event loop's capacity: how much of it the scans use, and how fast new scans may
come so that it stays under LOOP_UTILISATION_TARGET.

Every byte of every scan passes through one thread: the loop's (accepting, events, stream
writes, database results). When that thread runs out of CPU every open stream freezes at
once, and calls time out for our lateness, not the provider's. Loop lag is the symptom,
and as an admission signal it collapses admission (a stall is seen once it is over, and
any stall looks alike); the cause is the CPU the loop spends, which is measured here.

Every `SAMPLE_INTERVAL_S`, from the loop thread itself:
- **utilisation**: the share of wall time the loop thread wanted the CPU, running
  (its CPU time) or runnable but waiting for a core (Linux's per-thread
  `schedstat`; elsewhere only `time.thread_time()` is known). The wait matters on a
  shared box: a loop that gets half a core is saturated at 50 % CPU;
- **share**: of the time it wanted the CPU, how much it got (the CPU the process gets);
- **CPU per scan**: the loop's CPU over the scans admitted meanwhile (a running mean, over
  samples that admitted at least `MIN_SCANS_PER_SAMPLE`), what refusals cost taken out.
  In a steady state every admitted scan's whole life is paid for within the window.

The rate new scans may start at is then `target x share / CPU per scan`: what keeps the
loop at its target. A second estimate checks it: the scans admitted in the last sample,
scaled by target / utilisation. While the loop is saturated (utilisation at or over the
target, until it is `HYSTERESIS` under it) the lower of the two holds, so a cost measured
too low cannot keep the loop over; otherwise the higher, so a cost measured too high
(fixed work spread over few scans) cannot refuse scans an idle loop could take. Never
under `MIN_RATE`, so the loop keeps measuring. `LoopPacer` (app/limits/loop_pacer.py)
admits at that rate.
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
# Saturated from the target up; not saturated again until this far under it.
HYSTERESIS = 0.1
# The mean CPU per scan moves only on samples that admitted this many scans, and by this weight.
MIN_SCANS_PER_SAMPLE = 3
COST_WEIGHT = 0.3
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
        self.saturated = False
        self.rate = self._cpu_rate()
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
        self.utilisation = min(1.0, (used + waited) / wall)
        if used + waited > 0:
            self.share = max(0.05, used / (used + waited))
        if scans >= MIN_SCANS_PER_SAMPLE:
            per_scan = max(0.0, used - refusals) / scans
            self.cpu_per_scan_s += COST_WEIGHT * (per_scan - self.cpu_per_scan_s)
        if self.utilisation >= self.target:
            self.saturated = True
        elif self.utilisation < self.target - HYSTERESIS:
            self.saturated = False
        rate, reason = self._cpu_rate(), "cpu"
        scaled = scans / wall * self.target / max(self.utilisation, 0.05)
        if scaled < rate if self.saturated else scaled > rate:
            rate, reason = scaled, "saturated" if self.saturated else "measured"
        if rate <= MIN_RATE:
            rate, reason = MIN_RATE, "floor"
        self.rate, self.reason = rate, reason
        self._moves.moved("loop_rate", self.limit, reason)

    def _cpu_rate(self) -> float:
        return max(MIN_RATE, self.target * self.share / max(self.cpu_per_scan_s, 1e-6))
