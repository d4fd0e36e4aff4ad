"""Admission that knows the event loop's capacity: the utilisation signal and the rate it
gives (as a unit, fed readings), the pacer's bounded queue, and over real HTTP a service
whose loop a test-only burner keeps busy: it sheds new scans with SERVER_BUSY before their
body is read while the scans it accepted complete."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from app.limits.loop_capacity import MIN_RATE, PRIOR_CPU_PER_SCAN_S, LoopCapacity
from app.limits.loop_pacer import QUEUE_S, SATURATED, WAVE, LoopBusy, LoopPacer
from app.sim.server import RunningSimulator

from .conftest import Service, data_url, make_jpeg, run_scan, running_service, settings_for

# How long the loop-capacity signal may take to follow the burner: it samples twice a second.
FOLLOW_WITHIN_S = 30.0


def capacity(target: float = 0.8) -> LoopCapacity:
    cap = LoopCapacity(target=target, admitted=lambda: 0)
    cap.sample(0.0, 0.0, 0.0, 0)
    return cap


def test_utilisation_counts_the_wait_for_a_core_and_share_is_what_the_loop_got() -> None:
    cap = capacity()
    cap.sample(1.0, 0.3, 0.5, 0)  # ran 0.3 s, waited 0.5 s for a core, in 1 s
    assert cap.utilisation == pytest.approx(0.8)
    assert cap.share == pytest.approx(0.375)
    assert cap.saturated


def test_saturation_has_hysteresis() -> None:
    cap = capacity(0.8)
    cap.sample(1.0, 0.85, 0.0, 0)
    assert cap.saturated
    cap.sample(2.0, 0.85 + 0.75, 0.0, 0)  # under the target, not 0.1 under it
    assert cap.saturated
    cap.sample(3.0, 1.6 + 0.65, 0.0, 0)
    assert not cap.saturated
    cap.sample(4.0, 2.25 + 0.75, 0.0, 0)  # back up, not to the target: still not saturated
    assert not cap.saturated


def test_the_rate_keeps_the_loop_at_its_target_from_the_cpu_per_scan() -> None:
    cap = capacity(0.8)
    assert cap.rate == pytest.approx(0.8 / PRIOR_CPU_PER_SCAN_S)
    cpu = 0.0
    for second in range(1, 30):  # 100 scans a second at 4 ms each: the loop 40 % busy
        cpu += 0.4
        cap.sample(float(second), cpu, 0.0, second * 100)
    assert cap.cpu_per_scan_s == pytest.approx(0.004, rel=0.01)
    assert cap.rate == pytest.approx(0.8 / 0.004, rel=0.01)  # 200 a second would make it 80 %
    assert cap.reason == "cpu" and cap.limit in (200, 201)  # shown rounded up


def test_what_refusals_cost_is_not_charged_to_the_scans() -> None:
    cap = capacity(0.8)
    cpu = 0.0
    for second in range(1, 30):
        cap.refused(0.2)  # half of each second's loop CPU went to refusing
        cpu += 0.4
        cap.sample(float(second), cpu, 0.0, second * 100)
    assert cap.cpu_per_scan_s == pytest.approx(0.002, rel=0.01)


def test_a_saturated_loop_admits_no_faster_than_it_just_did_scaled_down_never_under_the_floor() -> None:
    cap = capacity(0.8)
    cap.sample(1.0, 0.95, 0.0, 10)  # 10 scans a second with the loop 95 % busy
    assert cap.saturated and cap.reason == "saturated"
    assert cap.rate == pytest.approx(10 * 0.8 / 0.95)
    cap.sample(2.0, 1.9, 0.0, 10)  # none admitted, still busy (something else holds the loop)
    assert cap.rate == MIN_RATE and cap.reason == "floor"


async def test_a_wave_starts_at_the_rate_and_what_the_queue_cannot_hold_is_refused_at_once() -> None:
    cap = capacity()
    cap.rate = 10.0  # scans a second
    pacer = LoopPacer(cap)
    started: list[float] = []
    refused: list[LoopBusy] = []

    async def arrive() -> None:
        try:
            await pacer.enter()
        except LoopBusy as busy:
            refused.append(busy)
        else:
            started.append(time.monotonic())

    began = time.monotonic()
    await asyncio.gather(*(arrive() for _ in range(40)))
    # One burst's worth at once, then one every 0.1 s for at most QUEUE_S: about 12.
    assert 10 <= len(started) <= 13, len(started)
    assert len(refused) == 40 - len(started)
    assert all(busy.reason == WAVE and busy.retry_after_s >= 1 for busy in refused)
    assert max(started) - began >= 0.8 * QUEUE_S  # a ramp, not all at once
    assert pacer.waiting == 0


@contextlib.asynccontextmanager
async def burning_loop(busy_share: float = 0.9, period_s: float = 0.1) -> AsyncIterator[None]:
    """A test-only CPU burner on the running loop: it spins `busy_share` of every period, so
    the loop's utilisation is known whatever else the box runs (a wait for a core counts)."""
    stop = asyncio.Event()

    async def burn() -> None:
        while not stop.is_set():
            end = time.perf_counter() + busy_share * period_s
            while time.perf_counter() < end:
                pass
            await asyncio.sleep((1 - busy_share) * period_s)

    task = asyncio.create_task(burn())
    try:
        yield
    finally:
        stop.set()
        await task


async def until(svc: Service, metric: str, value: float, labels: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + FOLLOW_WITHIN_S
    while svc.metric(metric, labels) != value:
        assert time.monotonic() < deadline, f"{metric} is {svc.metric(metric, labels)}, not {value}"
        await asyncio.sleep(0.1)


async def test_a_busy_loop_sheds_new_scans_early_while_accepted_ones_complete(
    database_url: str, sim: RunningSimulator
) -> None:
    photos = [data_url(make_jpeg(seed, (320, 240))) for seed in range(12)]
    async with running_service(settings_for(database_url, sim, loop_utilisation_target=0.8)) as svc:
        async with burning_loop():
            await until(svc, "ecoscan_loop_saturated", 1.0)
            await until(svc, "ecoscan_limit", MIN_RATE, {"limit": "loop_rate"})
            assert svc.metric("ecoscan_loop_utilisation") >= 0.8
            outcomes = await asyncio.gather(
                *(
                    run_scan(svc.client, json={"image_url": photo}, headers={"X-User-ID": f"u{n}"})
                    for n, photo in enumerate(photos)
                )
            )
        accepted = [o for o in outcomes if o.status == 200]
        shed = [o for o in outcomes if o.status != 200]
        assert accepted, "the floor rate still lets scans in"
        assert all(o.terminal.event == "done" for o in accepted), [o.terminal for o in accepted]
        assert shed, "a saturated loop sheds new scans"
        for o in shed:
            assert o.status == 503 and o.body["code"] == "SERVER_BUSY", o.body
            assert int(o.headers["retry-after"]) >= 1
        assert svc.metric("ecoscan_loop_shed_total", {"reason": SATURATED}) == len(shed)
        assert svc.metric("ecoscan_admission_rejected_total", {"reason": "SERVER_BUSY"}) == len(shed)
        assert svc.metric("ecoscan_loop_shed_cpu_seconds_total") > 0
        assert svc.metric("ecoscan_limit_changes_total", {"limit": "loop_rate", "reason": "floor"}) >= 1
        # Burner off: the loop comes back under its target, and new scans start again.
        await until(svc, "ecoscan_loop_saturated", 0.0)
        outcome = await run_scan(svc.client, json={"image_url": photos[0]}, headers={"X-User-ID": "after"})
        assert outcome.status == 200 and outcome.terminal.event == "done"
