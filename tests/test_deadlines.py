"""Stage timeouts and the scan deadline end the stream with an `error` event, record
the row and release everything."""

from __future__ import annotations

import asyncio
import threading

import asyncpg
import pytest

from app.errors import CpuLaneSaturated
from app.limits.cpu_lane import CpuLane
from app.sim.server import RunningSimulator

from .conftest import (
    data_url,
    eventually,
    make_jpeg,
    run_scan,
    running_service,
    scan_row,
    settings_for,
    sim_configure,
)


@pytest.mark.parametrize(
    ("overrides", "code", "step"),
    [
        ({"vision_timeout_s": 0.2}, "STAGE_TIMEOUT", "vision"),
        ({"answer_timeout_s": 0.2}, "STAGE_TIMEOUT", "answer"),
        ({"scan_deadline_s": 0.3}, "SCAN_DEADLINE_EXCEEDED", "vision"),
    ],
)
async def test_expiry_ends_the_stream_with_an_error_and_a_failed_row(
    database_url: str,
    sim: RunningSimulator,
    db: asyncpg.Connection,
    overrides: dict[str, float],
    code: str,
    step: str,
) -> None:
    await sim_configure(sim, time_scale=0.3)  # each call takes ~1.4 s
    async with running_service(settings_for(database_url, sim, **overrides)) as svc:
        outcome = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(5))})
        error = outcome.terminal
        assert (error.event, error.data["code"], error.data["step"]) == ("error", code, step)
        assert error.data["retryable"] is True
        row = await scan_row(db, error.data["job_id"])
        assert (row["status"], row["error_code"]) == ("failed", code)
        assert await eventually(lambda: svc.metric("ecoscan_budget_reservations_open") == 0)
        assert svc.metric("ecoscan_stage_semaphore_in_use", {"stage": step}) == 0
        assert svc.metric("ecoscan_admission_slots_in_use") == 0


async def test_cpu_lane_refuses_at_once_when_its_queue_is_full() -> None:
    lane = CpuLane(max_workers=1, queue_limit=0)
    release = threading.Event()
    try:
        lane_task = asyncio.create_task(lane.run(release.wait, 5))
        assert await eventually(lambda: lane.busy == 1)
        with pytest.raises(CpuLaneSaturated):
            await lane.run(sum, [1, 2])
        release.set()
        assert await lane_task is True
        assert lane.busy == 0 and lane.waiting == 0
        assert await lane.run(sum, [1, 2]) == 3
    finally:
        release.set()
        lane.shutdown()


async def test_cpu_lane_slot_is_held_until_the_thread_finishes_even_if_the_caller_gives_up() -> None:
    lane = CpuLane(max_workers=1, queue_limit=4)
    release = threading.Event()
    try:
        waiter = asyncio.create_task(lane.run(release.wait, 5))
        assert await eventually(lambda: lane.busy == 1)
        waiter.cancel()
        await asyncio.sleep(0.01)
        # The caller is gone, but the thread still runs: the slot is still taken.
        assert lane.busy == 1
        release.set()
        assert await eventually(lambda: lane.busy == 0)
    finally:
        release.set()
        lane.shutdown()


async def test_cpu_lane_hands_over_results_and_errors_even_if_an_observer_fails() -> None:
    lane = CpuLane(max_workers=1, queue_limit=4)

    def broken_observer(_queue_s: float, _run_s: float) -> None:
        raise RuntimeError("observer bug")

    lane.observers.append(broken_observer)
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, _context: None)  # the observer's error, logged by the loop
    try:
        async with asyncio.timeout(5):
            assert await lane.run(sum, [1, 2]) == 3
            with pytest.raises(ZeroDivisionError):
                await lane.run(divmod, 1, 0)
        assert lane.busy == 0
    finally:
        loop.set_exception_handler(None)
        lane.shutdown()
