"""The self-sizing limits over real HTTP against the simulator: the gates follow the
upstream's latency and the budget, and admission follows the gates; with two deployments,
each its own limit, and the calls follow the limits.
(The algorithms step by step: tests/test_adaptive_limit.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable

import pytest

from app.limits.sizing import SIZING_INTERVAL_S
from app.sim.config import SimConfig
from app.sim.server import RunningSimulator

from .conftest import Service, data_url, make_jpeg, run_scan, running_service, settings_for, sim_configure
from .test_routing import deployment, routed_service, simulators

# Distinct photos, so no reply cache could serve a scan (they are off here as well).
PHOTOS = [data_url(make_jpeg(seed, (320, 240))) for seed in range(8)]
# How long a limit may take to move as expected: sizing steps once a second.
MOVE_WITHIN_S = 20.0


@contextlib.asynccontextmanager
async def steady_load(svc: Service, users: int) -> AsyncIterator[list[int]]:
    """`users` clients scanning back to back until the block ends; yields their statuses."""
    statuses: list[int] = []
    stop = asyncio.Event()
    photos = itertools.cycle(PHOTOS)

    async def user(n: int) -> None:
        headers = {"X-User-ID": f"user-{n}"}
        while not stop.is_set():
            outcome = await run_scan(svc.client, json={"image_url": next(photos)}, headers=headers)
            statuses.append(outcome.status)
            assert outcome.status != 200 or outcome.terminal.event == "done", outcome.terminal

    tasks = [asyncio.create_task(user(n)) for n in range(users)]
    try:
        yield statuses
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def until(svc: Service, check: Callable[[Service], bool], what: str) -> None:
    deadline = time.monotonic() + MOVE_WITHIN_S
    while not check(svc):
        assert time.monotonic() < deadline, f"{what}: limits are {limits(svc)}"
        await asyncio.sleep(0.25)


def limits(svc: Service) -> dict[str, float]:
    return {
        name: svc.metric("ecoscan_limit", {"limit": name})
        for name in ("vision_gate", "answer_gate", "admission", "cpu_queue")
    }


async def test_a_slow_upstream_lowers_the_gates_a_fast_one_raises_them_and_admission_follows(
    database_url: str, sim: RunningSimulator
) -> None:
    settings = settings_for(
        database_url,
        sim,
        openai_rpm=10_000_000,  # no budget binds: the upstream's latency alone sizes the gates
        openai_tpm=10_000_000_000,
        max_inflight_per_user=100,
        vision_cache_entries=0,
        answer_cache_entries=0,
        scan_deadline_s=30.0,
    )
    await sim_configure(sim, time_scale=0.02)  # ~0.1 s a call
    async with running_service(settings) as svc, steady_load(svc, users=24) as statuses:
        await until(
            svc,
            lambda s: s.metric("ecoscan_limit_latency_seconds", {"stage": "vision", "kind": "baseline"}) > 0,
            "a baseline",
        )
        before = limits(svc)
        await sim_configure(sim, time_scale=0.2)  # the upstream slows down tenfold
        await until(
            svc,
            lambda s: (
                limits(s)["vision_gate"] < 0.7 * before["vision_gate"]
                and limits(s)["answer_gate"] < 0.7 * before["answer_gate"]
            ),
            "the gates come down when calls take longer",
        )
        assert svc.metric("ecoscan_limit_changes_total", {"limit": "vision_gate", "reason": "gradient"}) > 0
        slow = limits(svc)
        assert slow["admission"] < before["admission"], (before, slow)
        await sim_configure(sim, time_scale=0.02)  # and recovers
        await until(
            svc,
            lambda s: (
                limits(s)["vision_gate"] > 1.3 * slow["vision_gate"]
                and limits(s)["admission"] > 1.3 * slow["admission"]
            ),
            "the gates and admission rise again once calls are fast",
        )
    assert statuses and set(statuses) == {200}, "no scan was refused or failed on the way"


async def test_the_budget_sizes_the_gates_and_admission(database_url: str, sim: RunningSimulator) -> None:
    # 1,200 RPM: 20 calls/s, were a stage to have them all. At ~0.2 s a vision call,
    # Little's law wants 20 x 0.2 x 1.5 = 6 slots.
    settings = settings_for(
        database_url,
        sim,
        openai_rpm=1200,
        openai_tpm=100_000_000,  # the requests bind, not the tokens
        vision_cache_entries=0,
        answer_cache_entries=0,
    )
    await sim_configure(sim, time_scale=0.04)
    async with running_service(settings) as svc, steady_load(svc, users=4) as statuses:
        await until(svc, lambda s: limits(s)["vision_gate"] <= 8, "the budget bounds the vision gate")
        # Admission: the gates' ~30 calls/s (the budget's 20 a stage, x 1.5) x (the calls'
        # ~0.4 s + MAX_BUDGET_WAIT_S 10 s): hundreds, not the box's thousands.
        await until(svc, lambda s: 100 <= limits(s)["admission"] <= 500, "admission follows the budget")
    assert statuses and set(statuses) == {200}


async def test_a_number_fixes_a_limit(database_url: str, sim: RunningSimulator) -> None:
    settings = settings_for(
        database_url, sim, vision_concurrency=7, answer_concurrency="auto:5", max_inflight_scans=9
    )
    async with running_service(settings) as svc:
        await asyncio.sleep(1.5)  # a sizing step or more
        assert limits(svc)["vision_gate"] == 7 and limits(svc)["admission"] == 9
        assert limits(svc)["answer_gate"] <= 5
        outcome = await run_scan(svc.client, json={"image_url": PHOTOS[0]})
        assert outcome.terminal.event == "done"


# The deployments' calls in progress, sampled this often and this many times to compare their loads.
SAMPLE_EVERY_S = 0.1
SAMPLES = 30


async def test_a_deployment_that_slows_down_loses_slots_and_calls_to_the_other(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = SimConfig(time_scale=0.02, rpm=0, tpm=0, latency_sigma=0.0, text_tokens=40)  # ~0.1 s a call
    # 200 calls/s each: at ~0.1 s a call Little's law gives each ~30 slots, more than the
    # users ever hold, so no gate and no budget holds calls back: where they go is the pick's.
    budget = {"rpm": 12_000, "tpm": 100_000_000}
    async with simulators(2, fast) as (a, b):
        listed = [deployment("slowing", a, **budget), deployment("steady", b, **budget)]
        async with (
            routed_service(database_url, sim, monkeypatch, listed, scan_deadline_s=30.0) as svc,
            steady_load(svc, users=12) as statuses,
        ):

            def route_limit(name: str) -> float:
                return svc.metric("ecoscan_upstream_limit", {"upstream": name, "stage": "vision"})

            def routed(name: str) -> float:
                return svc.metric("ecoscan_upstream_routed_total", {"upstream": name, "stage": "vision"})

            def in_use(name: str) -> float:
                return sum(
                    svc.metric("ecoscan_upstream_in_use", {"upstream": name, "stage": stage})
                    for stage in ("vision", "answer")
                )

            await until(svc, lambda _: min(routed("slowing"), routed("steady")) >= 20, "replies from both")
            await asyncio.sleep(SIZING_INTERVAL_S * 1.5)  # a sizing step: each has its no-load latency
            before = {name: route_limit(name) for name in ("slowing", "steady")}
            assert svc.metric("ecoscan_limit", {"limit": "vision_gate"}) == sum(before.values())
            await sim_configure(a, time_scale=0.2)  # one deployment slows down tenfold
            await until(
                svc,
                lambda _: route_limit("slowing") < 0.5 * route_limit("steady"),
                "the slow deployment's limit falls below the other's",
            )
            reasons = {"upstream": "slowing", "stage": "vision", "reason": "gradient"}
            assert svc.metric("ecoscan_upstream_limit_changes_total", reasons) > 0
            assert svc.metric("ecoscan_upstream_state", {"upstream": "slowing"}) == 0  # no breaker opened
            # From now on the slow one holds fewer calls at once than the other (with the
            # old pick, by fewest calls in flight, it held as many or more) and gets few calls.
            calls_before = {name: routed(name) for name in ("slowing", "steady")}
            held: dict[str, list[float]] = {"slowing": [], "steady": []}
            for _ in range(SAMPLES):
                for name, seen in held.items():
                    seen.append(in_use(name))
                await asyncio.sleep(SAMPLE_EVERY_S)
            calls = {name: routed(name) - calls_before[name] for name in calls_before}
    assert sum(held["slowing"]) < 0.75 * sum(held["steady"]), held
    assert calls["steady"] > 5 * calls["slowing"], calls
    assert statuses and set(statuses) == {200}, "no scan was refused or failed on the way"
