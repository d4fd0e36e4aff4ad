"""The self-sizing limits, deterministically: `AdaptiveLimit` driven interval by interval,
the resizable `StageGate`, and `Sizing` deriving admission and the CPU queue from them.
(Over HTTP against the simulator: tests/test_sizing_http.py.)"""

from __future__ import annotations

import asyncio
import math

import pytest

from app.limits.adaptive import BACKOFF, LITTLE_HEADROOM, AdaptiveLimit
from app.limits.admission import Admission
from app.limits.cpu_lane import CpuLane
from app.limits.sizing import ADMISSION_FLOOR, CPU_QUEUE_WAIT_S, LimitSpec, Sizing
from app.limits.stage_gate import StageGate

from .sized_routes import replies, route_sizing, sized_route


def interval(
    limit: AdaptiveLimit,
    *,
    latency: float = 1.0,
    calls: int = 20,
    used: int | None = None,
    overloads: int = 0,
    rate: float = math.inf,
    oldest: float = 0.0,
) -> int:
    """One sizing interval: `calls` calls of `latency` finished, `used` slots held at most."""
    for _ in range(calls):
        limit.observe(latency)
    for _ in range(overloads):
        limit.observe(latency, overloaded=True)
    limit.in_use(limit.limit if used is None else used)
    limit.update(rate_per_s=rate, oldest_in_progress_s=oldest)
    return limit.limit


def new_admission(
    *, max_inflight: int = ADMISSION_FLOOR, per_user: int = 4, wait_s: float = 0.0
) -> Admission:
    """Admission with a budget that never makes anyone wait and two calls a scan."""
    return Admission(
        max_inflight=max_inflight,
        per_user=per_user,
        wait_s=wait_s,
        max_budget_wait_s=10.0,
        predicted_budget_wait=lambda _owed: 0.0,
        calls_per_scan=2,
    )


def test_rises_under_headroom_until_the_ceiling() -> None:
    limit = AdaptiveLimit(floor=4, ceiling=5000, prior_latency_s=2.0, initial=64)
    seen = [interval(limit) for _ in range(8)]
    assert seen[:4] == [128, 256, 512, 1024]  # saturated and healthy: slow start doubles
    assert seen[-1] == 5000 and limit.reason == "ceiling"


def test_does_not_rise_while_slots_are_spare() -> None:
    limit = AdaptiveLimit(floor=4, ceiling=5000, prior_latency_s=2.0, initial=64)
    assert [interval(limit, used=20) for _ in range(5)] == [64] * 5
    assert limit.reason == "steady"


def test_littles_law_bounds_it_by_the_budget() -> None:
    limit = AdaptiveLimit(floor=4, ceiling=5000, prior_latency_s=2.0, initial=64)
    for _ in range(10):
        interval(limit, latency=3.0, rate=10.0)
    # 10 calls/s x 3 s in progress, plus the headroom: more slots would only queue at the budget.
    assert limit.limit == int(10.0 * 3.0 * (1 + LITTLE_HEADROOM)) and limit.reason == "little"
    # The budget grows (a higher tier, a replica gone): the limit follows, doubling at most.
    assert interval(limit, latency=3.0, rate=40.0) == 90
    assert interval(limit, latency=3.0, rate=40.0) == int(40.0 * 3.0 * (1 + LITTLE_HEADROOM))
    # Used or not: the target is what the budget needs, ready for a burst.
    assert interval(limit, latency=3.0, rate=40.0, used=0) == 180


def test_falls_when_latency_rises_and_recovers_when_it_settles() -> None:
    limit = AdaptiveLimit(floor=4, ceiling=5000, prior_latency_s=2.0, initial=256)
    interval(limit, latency=1.0, used=100)  # the no-load latency: 1 s
    assert limit.limit == 256
    falling = [interval(limit, latency=4.0) for _ in range(6)]
    assert falling == sorted(falling, reverse=True) and falling[-1] < 256 // 2
    assert limit.reason == "gradient"
    # A slow upstream that stays slow becomes the new normal: the limit grows again.
    rising = [interval(limit, latency=4.0) for _ in range(60)]
    assert rising[-1] > falling[-1] and limit.reason in ("grow", "ceiling")


def test_an_interval_without_a_reply_holds_a_cut_limit() -> None:
    """Calls slower than the interval leave some intervals without a reply: those say
    nothing new, and must not raise a limit the latency cut towards Little's target."""
    limit = AdaptiveLimit(floor=4, ceiling=100_000, prior_latency_s=2.0, initial=256)
    interval(limit, latency=0.1, rate=2000.0, used=10)  # the no-load latency: 0.1 s
    cut = [interval(limit, latency=1.0, rate=2000.0) for _ in range(3)]
    assert cut == sorted(cut, reverse=True) and limit.reason == "gradient"
    # Little's target at 1 s a call is 3,000 slots; without replies the limit stays put.
    assert [interval(limit, calls=0, rate=2000.0) for _ in range(3)] == [cut[-1]] * 3
    assert limit.reason == "idle"
    assert interval(limit, latency=1.0, rate=2000.0) < cut[-1]  # the next replies cut it on
    # Only a smaller budget lowers a held limit.
    assert limit.latency_s is not None
    assert interval(limit, calls=0, rate=10.0) == int(10.0 * limit.latency_s * (1 + LITTLE_HEADROOM))


def test_noise_within_the_tolerance_does_not_cut_it() -> None:
    limit = AdaptiveLimit(floor=4, ceiling=10_000, prior_latency_s=2.0, initial=64)
    seen = [interval(limit, latency=1.0 + 0.3 * (i % 2)) for i in range(6)]
    assert seen == sorted(seen) and seen[-1] > 64


def test_a_429_storm_backs_it_off_to_the_floor_and_no_further() -> None:
    limit = AdaptiveLimit(floor=4, ceiling=5000, prior_latency_s=2.0, initial=100)
    assert interval(limit, calls=5, overloads=3) == int(100 * BACKOFF)
    assert limit.reason == "backoff"
    for _ in range(30):
        interval(limit, calls=0, overloads=5)
    assert limit.limit == 4 and limit.reason == "floor"


def test_before_any_reply_what_is_still_running_sets_the_latency() -> None:
    limit = AdaptiveLimit(floor=4, ceiling=5000, prior_latency_s=2.0, initial=8)
    interval(limit, calls=0, rate=10.0, used=0)
    interval(limit, calls=0, rate=10.0, used=0)
    assert limit.limit == int(10.0 * 2.0 * (1 + LITTLE_HEADROOM))  # the prior, 2 s
    interval(limit, calls=0, rate=10.0, oldest=20.0)
    assert limit.latency_s == 20.0  # a call out for 20 s: calls take at least that long
    assert limit.limit > 30


def test_limit_spec_reads_auto_caps_and_numbers() -> None:
    assert LimitSpec.parse("X", "auto") == LimitSpec()
    assert LimitSpec.parse("X", " AUTO:200 ") == LimitSpec(cap=200)
    assert LimitSpec.parse("X", "64") == LimitSpec(fixed=64)
    assert LimitSpec(cap=200).ceiling(5000) == 200 and LimitSpec().ceiling(5000) == 5000
    for bad in ("", "auto:", "auto:0", "0", "-3", "many", "auto:x"):
        with pytest.raises(ValueError, match="X must be"):
            LimitSpec.parse("X", bad)
    assert LimitSpec.parse("X", "0", minimum=0) == LimitSpec(fixed=0)


def holders(gate: StageGate, count: int) -> tuple[list[asyncio.Task[None]], list[int], asyncio.Event]:
    """`count` calls through `gate`, in order: each notes its number once in, then holds its
    slot until the event is set."""
    order: list[int] = []
    release = asyncio.Event()

    async def call(n: int) -> None:
        async with gate.hold():
            order.append(n)
            await release.wait()

    return [asyncio.create_task(call(n)) for n in range(count)], order, release


async def test_gate_resizes_without_cutting_holders_off() -> None:
    gate = StageGate("vision", 2)
    tasks, order, release = holders(gate, 6)
    await asyncio.sleep(0)
    assert (gate.in_use, gate.waiting) == (2, 4)
    gate.limit = 4  # a rise lets waiters in at once, first come first
    await asyncio.sleep(0)
    assert (gate.in_use, gate.waiting, order) == (4, 2, [0, 1, 2, 3])
    gate.limit = 1  # a fall: nobody is cut off, nobody new gets in
    await asyncio.sleep(0)
    assert (gate.in_use, gate.waiting) == (4, 2)
    release.set()
    await asyncio.gather(*tasks)
    assert (gate.in_use, gate.waiting, order) == (0, 0, [0, 1, 2, 3, 4, 5])


async def test_a_waiter_cancelled_as_it_is_handed_a_slot_passes_it_on() -> None:
    gate = StageGate("answer", 1)
    held = asyncio.Event()
    got: list[str] = []

    async def holder() -> None:
        async with gate.hold():
            await held.wait()

    async def waiter(name: str) -> None:
        async with gate.hold():
            got.append(name)

    first = asyncio.create_task(holder())
    await asyncio.sleep(0)
    cancelled, second = asyncio.create_task(waiter("cancelled")), asyncio.create_task(waiter("second"))
    await asyncio.sleep(0)
    held.set()
    await asyncio.sleep(0)  # the holder leaves: the slot is handed to `cancelled`...
    cancelled.cancel()  # ...which is cancelled before it runs
    await asyncio.gather(first, second, cancelled, return_exceptions=True)
    assert got == ["second"] and gate.in_use == 0


async def test_admission_and_the_cpu_queue_follow_the_gates() -> None:
    gates = {"vision": StageGate("vision", 64), "answer": StageGate("answer", 64)}
    limiters = {s: AdaptiveLimit(floor=4, ceiling=5000, prior_latency_s=2.0, initial=64) for s in gates}
    for gate, limiter in zip(gates.values(), limiters.values(), strict=True):
        gate.limiter = limiter
    admission = new_admission()
    cpu = CpuLane(max_workers=2, queue_limit=2)
    # One deployment per stage whose budget allows 20 calls/s.
    routes = {stage: sized_route("only", stage, rate=20.0) for stage in gates}
    changes: list[tuple[str, str]] = []
    sizing = Sizing(
        gates=gates,
        gate_limits=limiters,
        routes=route_sizing(*routes.values()),
        stage_requests=lambda _stage: 0,  # no scans yet: every stage counts for all
        admission=admission,
        admission_spec=LimitSpec(),
        admission_ceiling=5000,
        max_queue_s=10.0,
        cpu=cpu,
        cpu_queue_spec=LimitSpec(),
        cpu_queue_ceiling=5000,
        on_change=lambda name, reason: changes.append((name, reason)),
    )
    try:
        for _ in range(3):
            for stage, latency in (("vision", 1.0), ("answer", 3.0)):
                gates[stage].observe(latency, overloaded=False)  # as each reply is fed
                replies(routes[stage], latency, count=1)
            sizing.observe_cpu_job(0.0, 0.02)
            sizing.step()
        limits = sizing.limits()
        # Little's law per stage: 20 calls/s x latency x (1 + headroom).
        assert limits["vision_gate"] == 30 and limits["answer_gate"] == 90
        # Admission: the 30 scans/s the gates sustain (their headroom over the budget's 20)
        # x (1 s + 3 s of calls + 10 s of queue).
        assert limits["admission"] == 30 * (1 + 3 + 10) == admission.max_inflight
        # The CPU queue: what 2 workers finish in CPU_QUEUE_WAIT_S at the measured job time.
        job_s = 0.01 + (0.02 - 0.01) * (1 - 0.95**3)
        assert limits["cpu_queue"] == math.ceil(2 * CPU_QUEUE_WAIT_S / job_s) == cpu.queue_limit
        assert ("admission", "little") in changes and ("vision_gate", "little") in changes
        # The budget halves: the gates and admission come down with it.
        for route in routes.values():
            route.rate_per_s = 10.0
        sizing.step()
        assert sizing.limits()["admission"] < limits["admission"] * 0.6
        assert sizing.limits()["answer_gate"] < limits["answer_gate"]
    finally:
        cpu.shutdown()


async def test_a_higher_admission_cap_lets_waiters_in_at_once() -> None:
    admission = new_admission(max_inflight=1, per_user=10, wait_s=5.0)
    first = await admission.admit("a")
    second = asyncio.create_task(admission.admit("a"))
    await asyncio.sleep(0)
    assert not second.done()
    admission.resize(2)
    await asyncio.sleep(0)
    assert second.done() and admission.in_flight == 2
    admission.resize(1)  # a fall: the next release does not hand its slot on
    third = asyncio.create_task(admission.admit("a"))
    await asyncio.sleep(0)
    first.release()
    await asyncio.sleep(0)
    assert not third.done() and admission.in_flight == 1
    second.result().release()
    ticket = await asyncio.wait_for(third, 1.0)
    ticket.release()
    assert admission.in_flight == 0


async def test_waiters_that_give_up_leave_the_count_and_the_order_intact() -> None:
    gate = StageGate("vision", 1)
    tasks, order, release = holders(gate, 6)
    await asyncio.sleep(0)
    assert (gate.in_use, gate.waiting) == (1, 5)
    for n in (1, 3, 4):  # give up while queued
        tasks[n].cancel()
    await asyncio.sleep(0)
    assert gate.waiting == 2
    release.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [0, 2, 5] and (gate.in_use, gate.waiting) == (0, 0)


async def test_admission_follows_fixed_gates_at_their_measured_latency() -> None:
    """A sweep's grid point fixes the gates and leaves admission `auto`: admission then
    sizes itself from the latency the fixed gates measure, not from a prior."""
    gates = {"vision": StageGate("vision", 30), "answer": StageGate("answer", 90)}
    for _ in range(5):
        gates["vision"].observe(1.0, overloaded=False)
        gates["answer"].observe(3.0, overloaded=False)
    gates["answer"].observe(30.0, overloaded=True)  # a timeout is no reply: not a sample
    admission = new_admission()
    cpu = CpuLane(max_workers=1, queue_limit=1)
    try:
        sizing = Sizing(
            gates=gates,
            gate_limits={},
            routes=route_sizing(),
            stage_requests=lambda _stage: 0,
            admission=admission,
            admission_spec=LimitSpec(),
            admission_ceiling=5000,
            max_queue_s=10.0,
            cpu=cpu,
            cpu_queue_spec=LimitSpec(fixed=1),
            cpu_queue_ceiling=1,
        )
        sizing.step()
        # 30 scans/s through either gate (30 / 1 s, 90 / 3 s) x (1 s + 3 s + 10 s).
        assert admission.max_inflight == 30 * 14
    finally:
        cpu.shutdown()
