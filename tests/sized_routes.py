"""Routes as route sizing sees them (a name, a stage, a `RouteLimit`), for the tests that
step `Sizing` and `RouteSizing` interval by interval without a `Router` behind them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from app.limits.adaptive import AdaptiveLimit
from app.limits.route_limits import RouteLimit, RouteSizing
from app.limits.sizing import GATE_FLOOR, INITIAL_GATE_LIMIT, PRIOR_LATENCY_S


@dataclass(eq=False)
class SizedRoute:
    name: str
    stage: str
    limit: RouteLimit
    rate_per_s: float = math.inf  # what its budget allows
    usable: bool = True  # its breaker lets calls through
    changes: list[str] = field(default_factory=list)  # why its limit moved, in order


def auto_limit(ceiling: int = 5000) -> AdaptiveLimit:
    """A gate's or a route's limit as app/resources.py makes one (floor, prior, first limit)."""
    return AdaptiveLimit(
        floor=min(GATE_FLOOR, ceiling),
        ceiling=ceiling,
        prior_latency_s=PRIOR_LATENCY_S,
        initial=INITIAL_GATE_LIMIT,
    )


def sized_route(
    name: str, stage: str = "vision", *, ceiling: int = 5000, rate: float = math.inf
) -> SizedRoute:
    return SizedRoute(name, stage, RouteLimit(auto_limit(ceiling)), rate_per_s=rate)


def route_sizing(*routes: SizedRoute) -> RouteSizing[SizedRoute]:
    by_stage: dict[str, list[SizedRoute]] = {}
    for route in routes:
        by_stage.setdefault(route.stage, []).append(route)
    named = {(r.name, r.stage): r for r in routes}

    def usable(stage: str) -> list[SizedRoute]:
        return [r for r in by_stage.get(stage, []) if r.usable]

    def changed(name: str, stage: str, reason: str) -> None:
        named[(name, stage)].changes.append(reason)

    return RouteSizing(by_stage, usable=usable, rate=lambda r: r.rate_per_s, on_change=changed)


def replies(route: SizedRoute, latency_s: float, count: int = 20, *, overloads: int = 0) -> None:
    """`count` replies of `latency_s` and `overloads` refusals for load at `route`, fed as
    app/upstream/client.py feeds them."""
    for _ in range(count):
        route.limit.observe(latency_s, overloaded=False)
    for _ in range(overloads):
        route.limit.observe(latency_s, overloaded=True)


def busy(route: SizedRoute, calls: int) -> Callable[[], None]:
    """`calls` attempts held on `route` (its slots in use); returns what ends them."""
    tokens = [route.limit.enter() for _ in range(calls)]

    def end() -> None:
        for token in tokens:
            route.limit.leave(token)

    return end
