"""Stage deadlines run on the pipeline's clock: a FakeClock moves them too."""

from __future__ import annotations

import asyncio

import pytest

from app.limits.clock import FakeClock, MonotonicClock


async def test_a_fake_clock_deadline_fires_when_the_clock_passes_it_not_before() -> None:
    clock = FakeClock()
    finished: list[str] = []

    async def work() -> None:
        try:
            async with clock.timeout_at(5.0):
                await asyncio.Event().wait()  # never set: only the deadline ends this
        except TimeoutError:
            finished.append("timed out")

    task = asyncio.create_task(work())
    await clock.advance(4.9)
    assert finished == []
    await clock.advance(0.2)
    await asyncio.wait_for(task, 1.0)
    assert finished == ["timed out"]


async def test_leaving_a_fake_clock_deadline_early_leaves_nothing_behind() -> None:
    clock = FakeClock()
    async with clock.timeout_at(5.0):
        pass
    await clock.advance(0)
    assert clock.sleepers == 0
    await clock.advance(10)  # the cancelled watchdog must not fire into anything


async def test_a_monotonic_deadline_already_past_raises_at_once() -> None:
    clock = MonotonicClock()
    with pytest.raises(TimeoutError):
        async with clock.timeout_at(clock.now() - 1):
            await asyncio.sleep(1)
