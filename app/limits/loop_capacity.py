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

Two limits follow from it:
- **the ceiling**: how many scans may be in flight. When the loop is over the target, the
  ceiling is cut to what is in flight times (target - `HYSTERESIS`) / utilisation (at
  most by `CEILING_CUT_MIN`), and not again until the cut has shown: what is in flight is
  down to it and the utilisation has had a window to follow. Under the target by
  `HYSTERESIS` it grows by `CEILING_GROWTH` a sample while it binds (what is in flight is
  near it), so it never runs away above what the loop has been shown to take. A ceiling
  on the scans in flight, not a rate: a scan costs the loop over its whole life, so the
  load follows what is in flight within a few samples, where a rate shows only as its
  scans live (a rate controller cut admission to its floor before its first cut showed,
  in a benchmark). When the loop is the bottleneck, admitting past it adds no
  throughput, only lateness (Little's law: the same scans a second take longer each).
- **the rate** a wave of arrivals is spread at: `WAVE_FACTOR` times what the loop sustains
  at the target (target x share / CPU per scan), so it smooths a wave and never binds a
  steady load. Never under `MIN_RATE`, so the loop keeps measuring.
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
PRIOR_CPU_PER_SCAN_S = 0.01
# However busy the loop, this many scans a second still start.
MIN_RATE = 1.0
# A wave is spread at this many times the rate the loop sustains at its target.
WAVE_FACTOR = 2.0
# One cut of the ceiling takes at most this much off (a factor of what is in flight).
CEILING_CUT_MIN = 0.8
# While it binds and the loop has room, the ceiling grows by this factor a sample.
CEILING_GROWTH = 0.02
# It binds when what is in flight (or waiting at the pacer) is this close to it.
CEILING_NEAR = 0.95
# However busy the loop, this many scans may still be in flight.
MIN_CEILING = 10


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
        in_flight: Callable[[], int] = lambda: 0,
        max_in_flight: Callable[[], int] = lambda: 1 << 30,
        clock: LoopClock | None = None,
        on_change: Callable[[str, str], None] = lambda _limit, _reason: None,
        interval_s: float = SAMPLE_INTERVAL_S,
    ) -> None:
        self.target = target
        self._admitted = admitted
        self._in_flight = in_flight
        self._max_in_flight = max_in_flight  # the admission's cap, sized by the process
        self._clock = clock
        self._interval_s = interval_s
        self.utilisation = 0.0
        self.sustained_utilisation = 0.0  # over COST_WINDOW_S: a wave of completions is not an overload
        self.share = 1.0
        self.cpu_per_scan_s = PRIOR_CPU_PER_SCAN_S
        self.scans_per_s = 0.0  # admitted, averaged over COST_WINDOW_S
        self._cpu_per_s = 0.0  # the loop's, refusals' taken out, likewise
        self.saturated = False
        self.rate = max(MIN_RATE, WAVE_FACTOR * target / PRIOR_CPU_PER_SCAN_S)
        self.reason = "prior"
        self.ceiling = float(max_in_flight())
        self.ceiling_reason = "admission"  # no cut in force: the admission's cap
        self._cut_shown_at = 0.0  # no cut before the utilisation has followed the last one
        self._refusals_cpu_s = 0.0  # what refusals cost the loop since the last sample
        self._last: tuple[float, float, float, int] | None = None
        self._moves: Moves[str] = Moves(
            on_change, str, {"loop_rate": self.limit, "loop_inflight": self.inflight_limit}
        )

    @property
    def limit(self) -> int:
        """The rate as `ecoscan_limit{limit="loop_rate"}` shows it: scans a second, rounded up."""
        return math.ceil(self.rate)

    @property
    def inflight_limit(self) -> int:
        """The ceiling as `ecoscan_limit{limit="loop_inflight"}` shows it."""
        return math.floor(self.ceiling)

    @property
    def in_flight(self) -> int:
        return self._in_flight()

    @property
    def binding(self) -> bool:
        """Whether the ceiling is the loop's own (cut, not yet grown back to the admission's
        cap): only then does the pacer refuse at it."""
        return self.ceiling_reason != "admission"

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
        weight = 1 - math.exp(-wall / COST_WINDOW_S)
        self.sustained_utilisation += weight * (wanted - self.sustained_utilisation)
        if used + waited > 0:
            self.share = max(0.05, used / (used + waited))
        self.scans_per_s += weight * (scans / wall - self.scans_per_s)
        self._cpu_per_s += weight * (max(0.0, used - refusals) / wall - self._cpu_per_s)
        if self.scans_per_s * COST_WINDOW_S >= MIN_SCANS_FOR_COST:
            self.cpu_per_scan_s = self._cpu_per_s / self.scans_per_s
        if self.utilisation >= self.target:
            self.saturated = True
        elif self.utilisation < self.target - HYSTERESIS:
            self.saturated = False
        self._steer_ceiling(now, self._in_flight())
        rate = WAVE_FACTOR * self.target * self.share / self.cpu_per_scan_s
        self.rate, self.reason = max(MIN_RATE, rate), "cpu" if rate > MIN_RATE else "floor"
        self._moves.moved("loop_rate", self.limit, self.reason)

    def _steer_ceiling(self, now: float, in_flight: int) -> None:
        cap = float(self._max_in_flight())
        if self.utilisation >= self.target and self.sustained_utilisation >= self.target:
            if in_flight * CEILING_NEAR > self.ceiling or now < self._cut_shown_at:
                return  # the last cut has not shown yet
            cut = max(CEILING_CUT_MIN, (self.target - HYSTERESIS) / self.utilisation)
            self.ceiling = max(MIN_CEILING, min(self.ceiling, in_flight) * cut)
            self.ceiling_reason = "saturated"
            self._cut_shown_at = now + UTILISATION_WINDOW_S
        elif not self.binding or self.sustained_utilisation < self.target - HYSTERESIS:
            # Not cut, or the loop has had room for a while: no ceiling but the admission's cap
            # (which refuses on its own, after its wait), however that is sized meanwhile.
            self.ceiling, self.ceiling_reason = cap, "admission"
        elif self.utilisation < self.target - HYSTERESIS and in_flight >= CEILING_NEAR * self.ceiling:
            self.ceiling = min(cap, self.ceiling * (1 + CEILING_GROWTH))
            self.ceiling_reason = "cpu" if self.ceiling < cap else "admission"
        else:
            return
        self._moves.moved("loop_inflight", self.inflight_limit, self.ceiling_reason)
