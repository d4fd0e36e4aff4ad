"""Sizing: every limit set to `auto` follows what the upstream and the box can take,
re-derived every `SIZING_INTERVAL_S`.

- **Route limits and stage gates** (VISION_/ANSWER_CONCURRENCY): each route (one
  deployment serving one stage) has an `AdaptiveLimit` (app/limits/adaptive.py): Little's
  law from the calls per second its budget allows and its measured call latency,
  corrected by its latency and its overloads (app/limits/route_limits.py). A gate at
  `auto` is the sum of its usable routes' limits; its own `AdaptiveLimit` keeps the
  stage's latency (every reply through the gate, whichever route: admission's service
  time) and its floor and ceiling. A fixed gate keeps its number; its routes still adapt.
- **Admission** (MAX_INFLIGHT_SCANS): the scans the gates can finish in time. A scan's
  service time is the sum of its stages' call latencies; at the rate X the gates (and
  so the budgets) sustain, Little's law gives X x (service time + MAX_BUDGET_WAIT_S)
  scans in flight: those being served and those queued for at most the wait admission
  already accepts at the budget. More would only queue past that wait and time out;
  fewer would turn users away while the budget idles.
- **The CPU lane's queue** (CPU_QUEUE_LIMIT): the jobs its workers finish within
  `CPU_QUEUE_WAIT_S` at the measured job time. The workers themselves stay one per core.

Every limit stays inside [floor, ceiling]: the floor keeps a limit that backed off from
starving, the ceiling is the configured cap (`auto:N`) or what the box holds
(`BoxLimits`: file descriptors and memory). A number instead of `auto` fixes the
limit (an override, e.g. for a benchmark's grid).

What each limit is and why it last moved is on /metrics (`ecoscan_limit`,
`ecoscan_limit_changes_total`; per route `ecoscan_upstream_limit`,
`ecoscan_upstream_limit_changes_total`); a move by more than `LOG_CHANGE_RATIO`
(app/limits/moves.py) since the last logged value is logged.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from app.limits.adaptive import AdaptiveLimit
from app.limits.admission import Admission
from app.limits.cpu_lane import CpuLane
from app.limits.moves import Moves
from app.limits.route_limits import RouteSizing
from app.limits.stage_gate import StageGate

log = logging.getLogger(__name__)

SIZING_INTERVAL_S = 1.0
# The lowest an automatic limit goes: a gate or a route that backed off still probes with
# this many calls, admission still lets this many scans in.
GATE_FLOOR = 4
ADMISSION_FLOOR = 16
# Before a stage's (a route's) first call returns, its latency is assumed to be this (seconds).
PRIOR_LATENCY_S = 2.0
# A gate's (a route's) first limit, at most: the limit doubles each interval from here while every
# slot is used, so a process reaches thousands of slots in seconds without starting
# with a flood.
INITIAL_GATE_LIMIT = 64
# Scans admitted before the share of scans calling each stage is trusted over "all do".
SHARE_AFTER_SCANS = 20
# The CPU lane's queue holds what its workers finish within this long, and at least this
# many jobs a worker: uploads come in bursts, and a scan waits seconds for its calls
# anyway, so refusing one after half a second of queueing would refuse it for nothing.
CPU_QUEUE_WAIT_S = 2.0
CPU_QUEUE_FLOOR_PER_WORKER = 32
# Before the first job, a CPU job is assumed to take this long (seconds).
PRIOR_CPU_JOB_S = 0.01


@dataclass(frozen=True)
class LimitSpec:
    """A limit's setting: `auto` (sized, at most `cap` when given) or a fixed number."""

    fixed: int | None = None
    cap: int | None = None

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def ceiling(self, box: int) -> int:
        """The most this limit may be: the fixed value, else the cap or what the box holds."""
        if self.fixed is not None:
            return self.fixed
        return min(self.cap, box) if self.cap is not None else box

    @classmethod
    def parse(cls, name: str, raw: str, *, minimum: int = 1) -> LimitSpec:
        """`auto`, `auto:N` (sized, at most N) or `N` (fixed at N); N >= `minimum`."""
        text = raw.strip().lower()
        if text == "auto":
            return cls()
        if text.startswith("auto:"):
            return cls(cap=_number(name, text[5:], raw, max(1, minimum)))
        return cls(fixed=_number(name, text, raw, minimum))


def _number(name: str, number: str, raw: str, minimum: int) -> int:
    try:
        value = int(number.strip().replace("_", ""))
    except ValueError:
        raise ValueError(f"{name} must be auto, auto:N or a number N, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {raw!r}")
    return value


class Sizing:
    """Re-derives the automatic limits every `interval_s` (run it as a background task)."""

    def __init__(
        self,
        *,
        gates: Mapping[str, StageGate],
        gate_limits: Mapping[str, AdaptiveLimit],
        routes: RouteSizing[Any],
        stage_requests: Callable[[str], int],
        admission: Admission,
        admission_spec: LimitSpec,
        admission_ceiling: int,
        max_queue_s: float,
        cpu: CpuLane,
        cpu_queue_spec: LimitSpec,
        cpu_queue_ceiling: int,
        on_change: Callable[[str, str], None] = lambda _limit, _reason: None,
        interval_s: float = SIZING_INTERVAL_S,
    ) -> None:
        self._gates = gates
        self._gate_limits = gate_limits
        self._routes = routes
        self._stage_requests = stage_requests
        self._admission = admission
        self._admission_spec = admission_spec
        self._admission_ceiling = admission_ceiling
        self._max_queue_s = max_queue_s
        self._cpu = cpu
        self._cpu_queue_spec = cpu_queue_spec
        self._cpu_queue_ceiling = cpu_queue_ceiling
        self._interval_s = interval_s
        self._cpu_job_s = PRIOR_CPU_JOB_S
        self._moves: Moves[str] = Moves(on_change, str, self.limits())

    def limits(self) -> dict[str, int]:
        """Every limit this process runs with now, by name (the gauge's label)."""
        limits = {f"{stage}_gate": gate.limit for stage, gate in self._gates.items()}
        limits["admission"] = self._admission.max_inflight
        limits["cpu_queue"] = self._cpu.queue_limit
        return limits

    def observe_cpu_job(self, _queue_s: float, run_s: float) -> None:
        self._cpu_job_s += 0.05 * (run_s - self._cpu_job_s)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                self.step()
            except Exception:  # a bug here must not freeze every limit where it stands
                log.exception("sizing the limits failed; trying again in %.0f s", self._interval_s)

    def step(self) -> None:
        """One interval: routes, then the gates (the sum of their routes'), admission
        (which follows the gates), then the CPU lane's queue."""
        for stage, gate in self._gates.items():
            total, reason = self._routes.step(stage)
            limiter = self._gate_limits.get(stage)
            if limiter is None:
                continue  # fixed: its routes adapt (and steer the router), its number stays
            change = limiter.follow(total, reason, oldest_in_progress_s=gate.oldest_held_s())
            gate.limit = change.after
            self._moved(f"{stage}_gate", change.after, change.reason)
        if self._admission_spec.auto:
            size, reason = self._admission_size()
            self._admission.resize(size)
            self._moved("admission", size, reason)
        if self._cpu_queue_spec.auto:
            size, reason = self._cpu_queue_size()
            self._cpu.queue_limit = size
            self._moved("cpu_queue", size, reason)

    def _admission_size(self) -> tuple[int, str]:
        """X x (service time + the queueing admission accepts), X the scans/s the stages'
        gates sustain at their measured latencies. A stage only some scans call (a cached
        vision reply makes none) takes its gate slots from those only: its share of the
        scans, counted so far, divides its gate's rate and weighs its latency."""
        service_s = 0.0
        rate = math.inf
        scans = self._admission.admitted
        for stage, gate in self._gates.items():
            limiter = self._gate_limits.get(stage)
            measured = limiter.latency_s if limiter is not None else gate.latency_s  # a fixed gate's too
            latency = measured or PRIOR_LATENCY_S
            share = min(1.0, self._stage_requests(stage) / scans) if scans >= SHARE_AFTER_SCANS else 1.0
            service_s += share * latency
            if share > 0:
                rate = min(rate, gate.limit / latency / share)
        if not math.isfinite(rate):
            return self._admission_ceiling, "ceiling"
        size = math.ceil(rate * (service_s + self._max_queue_s))
        return _clamp(size, ADMISSION_FLOOR, self._admission_ceiling, "little")

    def _cpu_queue_size(self) -> tuple[int, str]:
        workers = self._cpu.max_workers
        size = math.ceil(workers * CPU_QUEUE_WAIT_S / max(self._cpu_job_s, 1e-4))
        return _clamp(size, workers * CPU_QUEUE_FLOOR_PER_WORKER, self._cpu_queue_ceiling, "little")

    def _moved(self, name: str, value: int, reason: str) -> None:
        self._moves.moved(name, value, reason)


def _clamp(size: int, floor: int, ceiling: int, reason: str) -> tuple[int, str]:
    if size <= floor:
        return min(floor, ceiling), "floor"
    if size >= ceiling:
        return ceiling, "ceiling"
    return size, reason
