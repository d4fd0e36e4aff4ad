"""A concurrency limit per route, deterministically: each route's limit stepped interval by
interval from its own replies and budget, and the stage gate that follows their sum.
(Routing by these limits: tests/test_router.py; over HTTP: tests/test_routing.py.)"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from app.limits.adaptive import BACKOFF, AdaptiveLimit
from app.limits.admission import Admission
from app.limits.cpu_lane import CpuLane
from app.limits.route_limits import ROUTES_CHANGED
from app.limits.sizing import GATE_FLOOR, INITIAL_GATE_LIMIT, LimitSpec, Sizing
from app.limits.stage_gate import StageGate

from .sized_routes import SizedRoute, auto_limit, busy, replies, route_sizing, sized_route


@dataclass
class Stage:
    """One stage's gate at `auto`, sized by `sizing` from its routes."""

    sizing: Sizing
    gate: StageGate
    limiter: AdaptiveLimit  # the gate's: its floor, ceiling and the stage's latency
    changes: list[tuple[str, str]]

    def step(self) -> int:
        self.sizing.step()
        return self.gate.limit


@contextmanager
def stage(*routes: SizedRoute, ceiling: int = 5000, fixed: int | None = None) -> Iterator[Stage]:
    """The vision stage over `routes`: its gate at `auto` (up to `ceiling`), or `fixed`."""
    limiter = auto_limit(ceiling)
    gate = StageGate("vision", fixed if fixed is not None else limiter.limit)
    if fixed is None:
        gate.limiter = limiter
    changes: list[tuple[str, str]] = []
    cpu = CpuLane(max_workers=1, queue_limit=1)
    try:
        sizing = Sizing(
            gates={"vision": gate},
            gate_limits={"vision": limiter} if fixed is None else {},
            routes=route_sizing(*routes),
            stage_requests=lambda _stage: 0,
            admission=Admission(
                max_inflight=16,
                per_user=4,
                wait_s=0.0,
                max_budget_wait_s=10.0,
                predicted_budget_wait=lambda _owed: 0.0,
                calls_per_scan=2,
            ),
            admission_spec=LimitSpec(fixed=16),
            admission_ceiling=16,
            max_queue_s=10.0,
            cpu=cpu,
            cpu_queue_spec=LimitSpec(fixed=1),
            cpu_queue_ceiling=1,
            on_change=lambda name, reason: changes.append((name, reason)),
        )
        yield Stage(sizing, gate, limiter, changes)
    finally:
        cpu.shutdown()


def reply(at: Stage, route: SizedRoute, latency_s: float, count: int = 20, *, overloads: int = 0) -> None:
    """Replies at `route`, told to its stage's gate and to the route, as client.py tells them."""
    for n in range(count + overloads):
        at.gate.observe(latency_s, overloaded=n >= count)
    replies(route, latency_s, count, overloads=overloads)


def test_one_deployment_sizes_its_gate_as_the_gate_alone_did() -> None:
    """Before routes had limits, the gate's own `AdaptiveLimit` was stepped from the stage's
    replies, its slots held and its budget: with one route, the same steps give the same
    limits, for the same reasons, and the same latency for admission."""
    alone = auto_limit(300)
    only = sized_route("only", ceiling=300)
    # (latency, replies, overloads, slots held at most, the budget's calls/s) per interval:
    # the prior, slow start to the ceiling, a budget, a slowdown, a 429 storm to the floor.
    intervals = [
        (1.0, 0, 0, 0, math.inf),
        *[(1.0, 20, 0, 300, math.inf)] * 4,
        *[(1.0, 20, 0, 10, 40.0)] * 2,
        *[(4.0, 20, 0, 60, 40.0)] * 4,
        *[(4.0, 5, 5, 60, 40.0)] * 12,
        *[(1.0, 20, 0, 4, 40.0)] * 4,
    ]
    limits = []
    with stage(only, ceiling=300) as vision:
        for latency, count, overloads, held, rate in intervals:
            only.rate_per_s = rate
            reply(vision, only, latency, count, overloads=overloads)
            busy(only, held)()  # `held` calls at once during the interval, none left at its end
            for _ in range(count):
                alone.observe(latency)
            for _ in range(overloads):
                alone.observe(latency, overloaded=True)
            alone.in_use(held)
            before = alone.limit
            change = alone.update(rate_per_s=rate)
            assert vision.step() == alone.limit
            limits.append(alone.limit)
            if change.after != before:
                assert vision.changes[-1] == ("vision_gate", alone.reason)
            estimates = (vision.limiter.latency_s, vision.limiter.baseline_s)
            assert estimates == (alone.latency_s, alone.baseline_s)
    reasons = [reason for _, reason in vision.changes]
    assert {"grow", "ceiling", "little", "gradient", "backoff"} <= set(reasons), reasons
    assert GATE_FLOOR in limits  # the storm took it to the floor


def test_the_gate_is_the_sum_of_its_usable_routes_clamped() -> None:
    a, b = sized_route("a", rate=10.0), sized_route("b", rate=20.0)
    with stage(a, b) as vision:
        reply(vision, a, 1.0)
        reply(vision, b, 1.0)
        # Little's law at each: 10 and 20 calls/s x 1 s x 1.5.
        assert vision.step() == 15 + 30 and (a.limit.size, b.limit.size) == (15, 30)
        b.usable = False  # its breaker opened: its slots leave the stage
        assert vision.step() == 15 and vision.changes[-1] == ("vision_gate", ROUTES_CHANGED)
        a.usable = False  # none usable: the gate's floor
        assert vision.step() == GATE_FLOOR and vision.changes[-1] == ("vision_gate", "floor")
    c, d = sized_route("c", rate=10.0, ceiling=20), sized_route("d", rate=20.0, ceiling=20)
    with stage(c, d, ceiling=20) as capped:  # auto:20
        reply(capped, c, 1.0)
        reply(capped, d, 1.0)
        assert capped.step() == 20 and capped.limiter.reason == "ceiling"
        assert (c.limit.size, d.limit.size) == (15, 20)  # each under the stage's ceiling


def test_a_route_whose_latency_triples_shrinks_while_the_other_does_not() -> None:
    slow, fast = sized_route("slow"), sized_route("fast")  # no budget binds: the latency sizes them
    with stage(slow, fast) as vision:
        reply(vision, slow, 1.0)
        reply(vision, fast, 1.0)
        assert vision.step() == 2 * INITIAL_GATE_LIMIT  # slots to spare: steady
        seen = []
        for _ in range(6):
            reply(vision, slow, 3.0)
            reply(vision, fast, 1.0)
            total = vision.step()
            seen.append((slow.limit.size, fast.limit.size, total))
    slow_limits = [s for s, _, _ in seen]
    assert slow_limits == sorted(slow_limits, reverse=True) and slow_limits[-1] < 0.7 * INITIAL_GATE_LIMIT
    assert set(slow.changes) == {"gradient"} and fast.changes == []
    assert all(f == INITIAL_GATE_LIMIT and total == s + f for s, f, total in seen), seen
    # The stage's latency, admission's service time, is every reply's: between the two.
    assert vision.limiter.latency_s is not None and 1.0 < vision.limiter.latency_s < 3.0


def test_429s_at_one_route_cut_only_its_limit() -> None:
    refusing, fine = sized_route("refusing"), sized_route("fine")
    with stage(refusing, fine) as vision:
        reply(vision, refusing, 1.0, count=10, overloads=3)
        reply(vision, fine, 1.0)
        assert vision.step() == int(INITIAL_GATE_LIMIT * BACKOFF) + INITIAL_GATE_LIMIT
        assert refusing.changes == ["backoff"] and fine.changes == []
        for _ in range(10):
            reply(vision, refusing, 1.0, count=0, overloads=5)
            reply(vision, fine, 1.0)
            vision.step()
        assert (refusing.limit.size, fine.limit.size) == (GATE_FLOOR, INITIAL_GATE_LIMIT)
        assert vision.gate.limit == GATE_FLOOR + INITIAL_GATE_LIMIT


def test_a_fixed_gate_keeps_its_number_while_its_routes_adapt() -> None:
    refusing, fine = sized_route("refusing", ceiling=50), sized_route("fine", ceiling=50)
    with stage(refusing, fine, fixed=50) as vision:
        for _ in range(3):
            reply(vision, refusing, 1.0, count=0, overloads=5)
            reply(vision, fine, 1.0)
            assert vision.step() == 50
        assert refusing.limit.size == int(50 * BACKOFF**3) and refusing.changes == ["backoff"] * 3
        assert fine.limit.size == 50 and vision.changes == []


def test_a_route_counts_its_calls_from_the_gate_queue_to_the_end() -> None:
    route = sized_route("only")
    first, second = route.limit.enter(), route.limit.enter()
    assert (route.limit.active, route.limit.has_room) == (2, True)
    assert route.limit.load_with_one_more == 3 / INITIAL_GATE_LIMIT
    route.limit.leave(first)
    route.limit.leave(second)
    assert route.limit.active == 0
