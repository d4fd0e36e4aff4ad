"""Gauges read live state at scrape time instead of being updated on every change. Each is
bound to a typed source here: a closure over a typed object's attribute or property, which
the type checker follows (a rename breaks the build, not a scrape)."""

from __future__ import annotations

import functools
from collections.abc import Mapping

from app.intake.body_reader import BodyBudget
from app.limits.adaptive import AdaptiveLimit
from app.limits.admission import Admission
from app.limits.charge_learning import KINDS
from app.limits.cpu_lane import CpuLane
from app.limits.loop_capacity import LoopCapacity
from app.limits.rate_budget import RateBudget
from app.limits.shared_budget import SharedRateBudget
from app.limits.sizing import Sizing
from app.limits.stage_gate import StageGate
from app.runtime.metrics import Metrics
from app.scans.store import ScanStore
from app.upstream.breaker import Breaker
from app.upstream.client import Upstream
from app.upstream.routes import Route


def bind_budgets(metrics: Metrics, budgets: Mapping[str, RateBudget]) -> None:
    """Each budget's room, queue, limits in force and learned charge ratios, by its key."""
    for key, budget in budgets.items():
        _bind_budget(metrics, key, budget)


def _bind_budget(metrics: Metrics, key: str, budget: RateBudget) -> None:
    metrics.budget_available.labels(key, "requests").set_function(lambda: budget.available_requests)
    metrics.budget_available.labels(key, "tokens").set_function(lambda: budget.available_tokens)
    metrics.budget_waiters.labels(key).set_function(lambda: budget.waiting)
    metrics.budget_limit.labels(key, "requests").set_function(lambda: budget.effective_rpm)
    metrics.budget_limit.labels(key, "tokens").set_function(lambda: budget.effective_tpm)
    for kind in KINDS:
        metrics.upstream_charge_ratio.labels(key, kind).set_function(
            functools.partial(budget.charges.ratio, kind)
        )


def bind_shared_budget(metrics: Metrics, key: str, budget: SharedRateBudget) -> None:
    metrics.budget_shared.labels(key).set_function(lambda: float(budget.shared))
    metrics.budget_share.labels(key).set_function(lambda: budget.share)


def bind_upstream(metrics: Metrics, upstream: Upstream) -> None:
    """The gates' slots in use, every route's limit and calls, open reservations."""
    for stage, gate in upstream.gates.items():
        _bind_gate(metrics, stage, gate)
    for route in upstream.routes:
        _bind_route(metrics, route)
    metrics.reservations_open.set_function(lambda: upstream.reservations_open)


def _bind_gate(metrics: Metrics, stage: str, gate: StageGate) -> None:
    metrics.semaphore_in_use.labels(stage).set_function(lambda: gate.in_use)
    metrics.semaphore_waiting.labels(stage).set_function(lambda: gate.waiting)
    if (limiter := gate.limiter) is not None:
        _bind_latencies(metrics, stage, limiter)


def _bind_latencies(metrics: Metrics, stage: str, limiter: AdaptiveLimit) -> None:
    metrics.limit_latency.labels(stage, "latency").set_function(lambda: limiter.latency_s or 0.0)
    metrics.limit_latency.labels(stage, "baseline").set_function(lambda: limiter.baseline_s or 0.0)


def _bind_route(metrics: Metrics, route: Route) -> None:
    limit = route.limit
    metrics.upstream_limit.labels(route.name, route.stage).set_function(lambda: limit.size)
    metrics.upstream_in_use.labels(route.name, route.stage).set_function(lambda: limit.active)


def bind_breaker(metrics: Metrics, name: str, breaker: Breaker) -> None:
    metrics.upstream_state.labels(name).set_function(breaker.gauge)


def bind_scans(metrics: Metrics, cpu: CpuLane, admission: Admission, store: ScanStore) -> None:
    """The CPU lane, admission and the terminal rows waiting for the database."""
    metrics.cpu_queue_depth.set_function(lambda: cpu.waiting)
    metrics.cpu_busy.set_function(lambda: cpu.busy)
    metrics.cpu_workers.set_function(lambda: cpu.max_workers)
    metrics.admission_in_use.set_function(lambda: admission.in_flight)
    metrics.admission_waiting.set_function(lambda: admission.waiting)
    metrics.scan_rows_deferred.set_function(lambda: store.deferred)


def bind_limits(metrics: Metrics, sizing: Sizing) -> None:
    """Every limit in force, as the sizing loop last set it."""
    for name in sizing.limits():
        metrics.limit.labels(name).set_function(functools.partial(_limit_of, sizing, name))


def _limit_of(sizing: Sizing, name: str) -> float:
    return float(sizing.limits()[name])


def bind_loop_capacity(metrics: Metrics, capacity: LoopCapacity) -> None:
    metrics.loop_utilisation.set_function(lambda: capacity.utilisation)
    metrics.loop_cpu_share.set_function(lambda: capacity.share)
    metrics.loop_cpu_per_scan.set_function(lambda: capacity.cpu_per_scan_s)
    metrics.loop_saturated.set_function(lambda: float(capacity.saturated))


def bind_body_budget(metrics: Metrics, budget: BodyBudget) -> None:
    metrics.body_bytes_buffered.set_function(lambda: budget.in_use)
