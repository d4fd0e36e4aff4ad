"""Timeouts that follow the model (app/limits/timeouts.py): the wait for a reply and a
stage's time limit stretch to what replies and stages took lately, never below their
settings; a hung call still ends."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.limits.clock import FakeClock
from app.limits.timeouts import PEAK_HALF_LIFE_S, TAIL, ElasticDeadline, RecentPeak
from app.sim.server import RunningSimulator

from .conftest import data_url, make_jpeg, run_scan, running_service, settings_for, sim_configure, sim_stats

# The simulator's vision median is 4.5 s before its time scale.
VISION_MEDIAN_S = 4.5


def test_the_recent_peak_holds_the_longest_and_fades_by_half_each_half_life() -> None:
    peak = RecentPeak()
    assert peak.value(0.0) == 0.0
    assert peak.timeout(20.0, 0.0) == 20.0  # nothing seen: the setting
    peak.observe(10.0, now=0.0)
    peak.observe(4.0, now=1.0)  # shorter: the longest stands
    assert peak.value(1.0) == pytest.approx(10.0 * 0.5 ** (1 / PEAK_HALF_LIFE_S))
    assert peak.value(PEAK_HALF_LIFE_S) == pytest.approx(5.0)
    assert peak.timeout(20.0, 0.0) == 20.0  # 1.5 x 10 is less than the setting
    peak.observe(16.0, now=PEAK_HALF_LIFE_S)
    assert peak.timeout(20.0, PEAK_HALF_LIFE_S) == pytest.approx(TAIL * 16.0)
    # Minutes later a slow spell is forgotten: back to the setting.
    assert peak.timeout(20.0, PEAK_HALF_LIFE_S * 6) == 20.0


async def test_an_elastic_deadline_waits_on_while_the_deadline_moves_and_ends_when_it_stops() -> None:
    start = time.monotonic()
    deadline = start + 0.05

    async def extend() -> None:
        nonlocal deadline
        await asyncio.sleep(0.03)
        deadline = start + 0.15  # learnt meanwhile: this may take longer

    mover = asyncio.create_task(extend())
    waiting = ElasticDeadline(lambda: deadline, time.monotonic)
    with pytest.raises(TimeoutError):
        async with waiting:
            await asyncio.sleep(1.0)
    await mover
    assert waiting.expired()
    assert 0.15 <= time.monotonic() - start < 0.5

    # Done before its deadline: nothing fires later.
    async with ElasticDeadline(lambda: time.monotonic() + 0.05, time.monotonic) as quick:
        await asyncio.sleep(0)
    await asyncio.sleep(0.1)
    assert not quick.expired()


async def test_the_fake_clocks_timeout_reads_a_moving_deadline_again() -> None:
    clock = FakeClock()
    deadline = 5.0

    async def body() -> None:
        async with clock.timeout_at(lambda: deadline):
            await clock.sleep(100)

    task = asyncio.create_task(body())
    await clock.advance(4)
    deadline = 8.0
    await clock.advance(2)  # past the first deadline: still waiting
    assert not task.done()
    await clock.advance(2)
    with pytest.raises(TimeoutError):
        await task


async def test_a_model_slower_than_the_read_timeout_is_waited_for_once_replies_show_it(
    database_url: str, sim: RunningSimulator
) -> None:
    # The read timeout and the vision stage's limit are 0.5 s. Replies of 0.4 s stretch
    # both to 1.5 x 0.4 = 0.6 s, so a model that slows to 0.55 s is waited for: no
    # timeout, no retry, no failed scan (with fixed timeouts every call would time out
    # and every scan fail). A call that hangs still ends, at the stretched timeout.
    settings = settings_for(
        database_url,
        sim,
        openai_read_timeout_s=0.5,
        vision_timeout_s=0.5,
        retry_max_attempts=2,
        vision_cache_entries=0,
        answer_cache_entries=0,
    )
    await sim_configure(sim, latency_sigma=0.0, time_scale=0.4 / VISION_MEDIAN_S)
    async with running_service(settings) as svc:
        first = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(31))})
        assert first.terminal.event == "done", first.terminal.data
        await sim_configure(sim, time_scale=0.55 / VISION_MEDIAN_S)
        slower = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(32))})
        assert slower.terminal.event == "done", slower.terminal.data
        timeouts = {"model": "gpt-4o-mini", "reason": "timeout"}
        assert svc.metric("ecoscan_upstream_retries_total", timeouts) == 0

        await sim_configure(sim, stall_rate=1.0, stall_s=10.0)  # vision, the first call, hangs
        began = time.monotonic()
        hung = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(33))})
        took = time.monotonic() - began
        assert hung.terminal.event == "error"
        assert hung.terminal.data["code"] in ("STAGE_TIMEOUT", "UPSTREAM_TIMEOUT"), hung.terminal.data
        assert took < 3.0  # the stretched limits (~0.8 s), not the 10 s stall
        assert (await sim_stats(sim))["stalls_injected"] >= 1


async def test_an_elastic_deadline_reached_as_the_task_is_cancelled_lets_the_cancellation_through() -> None:
    # Upstream._reply turns only a TimeoutError of its expired scope into a read timeout:
    # cancelled from outside in the same step (the stage's limit, the client gone), the
    # scope has expired too, but the cancellation must go on.
    start = time.monotonic()
    tasks: list[asyncio.Task[None]] = []

    def deadline() -> float:
        if time.monotonic() >= start + 0.02:  # an outside cancellation, as the scope's own lands
            asyncio.get_running_loop().call_soon(tasks[0].cancel)
        return start + 0.02

    waiting = ElasticDeadline(deadline, time.monotonic)

    async def body() -> None:
        async with waiting:
            await asyncio.sleep(1)

    tasks.append(asyncio.create_task(body()))
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    assert waiting.expired()
