"""Timeouts our own loop caused, over real HTTP against the simulator (which shares the
test's loop): a first-byte timeout that fires while a test-only burner holds the loop is
not the provider's failure (no attempt spent, no breaker verdict, sent again at once);
one that fires on time still is."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.limits.late_timeouts import LOOP_LATE, UPSTREAM
from app.runtime.loop_lag import LoopLateness
from app.sim.server import RunningSimulator

from .conftest import Service, data_url, make_jpeg, run_scan, running_service, settings_for, sim_configure

# The vision reply takes this long, and the read timeout is this; the burner holds the loop
# well past the timeout, from the moment the simulator has the request.
VISION_S = 1.0
READ_TIMEOUT_S = 1.5
BURN_S = 2.5
# How long the vision request may take to reach the simulator on a loaded box.
SENT_WITHIN_S = 30.0


def burn(seconds: float) -> None:
    """Hold the loop (and the simulator's replies with it) on the CPU, as a wave would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def sim_has_a_request(sim: RunningSimulator) -> None:
    deadline = time.monotonic() + SENT_WITHIN_S
    while sim.state.stats.inflight == 0:
        assert time.monotonic() < deadline, "the vision call never reached the simulator"
        await asyncio.sleep(0.001)


def timeouts(svc: Service, cause: str) -> float:
    return svc.metric("ecoscan_upstream_timeouts_total", {"stage": "vision", "cause": cause})


def timeout_retries(svc: Service) -> float:
    model = svc.settings.vision_model
    return svc.metric("ecoscan_upstream_retries_total", {"model": model, "reason": "timeout"})


async def test_a_timeout_that_fires_while_the_loop_is_late_is_not_the_providers(
    database_url: str, sim: RunningSimulator
) -> None:
    # One attempt: counted as the provider's, this timeout would fail the scan.
    settings = settings_for(
        database_url, sim, openai_read_timeout_s=READ_TIMEOUT_S, retry_max_attempts=1, vision_timeout_s=30.0
    )
    await sim_configure(sim, time_scale=1.0, vision_median_s=VISION_S, text_median_s=0.2)
    async with running_service(settings) as svc:
        scan = asyncio.create_task(
            run_scan(svc.client, json={"image_url": data_url(make_jpeg(7, (320, 240)))})
        )
        await sim_has_a_request(sim)
        burn(BURN_S)
        outcome = await scan
        assert outcome.status == 200 and outcome.terminal.event == "done", outcome.terminal
        assert timeouts(svc, LOOP_LATE) == 1
        assert timeouts(svc, UPSTREAM) == 0
        assert timeout_retries(svc) == 0
    assert sim.state.stats.by_kind["vision"] == 2  # sent again, at once


async def test_a_timeout_that_fires_on_time_is_still_the_providers(
    database_url: str, sim: RunningSimulator
) -> None:
    settings = settings_for(database_url, sim, openai_read_timeout_s=0.3, retry_max_attempts=1)
    await sim_configure(sim, time_scale=1.0, vision_median_s=VISION_S, text_median_s=0.2)
    async with running_service(settings) as svc:
        outcome = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(8, (320, 240)))})
        assert outcome.status == 200 and outcome.terminal.event == "error", outcome.terminal
        assert outcome.terminal.data["code"] == "UPSTREAM_TIMEOUT"
        assert timeouts(svc, UPSTREAM) == 1
        assert timeouts(svc, LOOP_LATE) == 0


def test_lateness_is_the_pending_probe_overdue_or_the_lag_just_measured() -> None:
    lateness = LoopLateness(recent_s=0.1)
    assert lateness.now(10.0) == 0.0
    lateness.waiting_until(10.05)
    assert lateness.now(10.04) == 0.0
    assert lateness.now(11.05) == pytest.approx(
        1.0
    )  # the probe's timer is a second overdue: the loop is held
    lateness.measured(1.0, 11.06)
    assert lateness.now(11.1) == 1.0  # the stall just ended: a timeout firing now fired late
    lateness.waiting_until(11.16)
    assert lateness.now(11.2) == pytest.approx(0.04)  # a while later, only what is overdue now counts


async def test_only_one_late_timeout_a_call_is_forgiven(database_url: str, sim: RunningSimulator) -> None:
    """From review: a loop that stays late must not resend a call to a silent deployment
    until its deadline with its breaker never told. The second late timeout of one call
    is the provider's: with one attempt, the scan ends UPSTREAM_TIMEOUT."""
    settings = settings_for(
        database_url, sim, openai_read_timeout_s=READ_TIMEOUT_S, retry_max_attempts=1, vision_timeout_s=30.0
    )
    await sim_configure(sim, time_scale=1.0, vision_median_s=VISION_S, text_median_s=0.2)
    async with running_service(settings) as svc:
        sent_before = sim.state.stats.by_kind["vision"]
        scan = asyncio.create_task(
            run_scan(svc.client, json={"image_url": data_url(make_jpeg(9, (320, 240)))})
        )
        for sent in (1, 2):  # the first attempt, then the one sent again at once: each held
            deadline = time.monotonic() + SENT_WITHIN_S
            while sim.state.stats.by_kind["vision"] < sent_before + sent or sim.state.stats.inflight == 0:
                assert time.monotonic() < deadline, f"attempt {sent} never reached the simulator"
                await asyncio.sleep(0.001)
            burn(BURN_S)
        outcome = await scan
        assert outcome.terminal.event == "error", outcome.terminal
        assert outcome.terminal.data["code"] == "UPSTREAM_TIMEOUT"
        assert timeouts(svc, LOOP_LATE) == 1
        assert timeouts(svc, UPSTREAM) == 1  # the second, counted as the provider's
