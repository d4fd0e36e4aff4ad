"""The pipeline without HTTP: real stages (simulator over HTTP, real PostgreSQL) run by
the runner, read as domain events from the scan's log, not as SSE."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from app.metrics import Metrics
from app.resources import Resources, lifespan_resources
from app.scan_context import AcceptedScan
from app.scan_events import AnswerDelta, LogEntry, ScanDone, ScanErrored, StageCompleted, StageStarted
from app.scan_input import parse_scan_body
from app.sim.server import RunningSimulator
from app.stage_runner import progress_spans

from .conftest import data_url, make_jpeg, scan_row, settings_for, sim_configure

STAGES = ["vision", "rule", "answer", "reward"]


@pytest.fixture
async def resources(database_url: str, sim: RunningSimulator) -> AsyncIterator[Resources]:
    async with lifespan_resources(settings_for(database_url, sim), Metrics(process=False)) as r:
        yield r


async def start_scan(
    r: Resources, seed: int, user: str = "pipeline-user"
) -> tuple[AcceptedScan, list[LogEntry]]:
    body = json.dumps({"image_url": data_url(make_jpeg(seed))}).encode()
    scan_input = parse_scan_body(body, "application/json", r.input_limits)
    ticket = await r.admission.admit(user)
    scan_id = uuid.uuid4()
    await r.store.create(scan_id, user_id=user, image_source="data_url", image_sha256=None, user_input=None)
    scan = AcceptedScan(scan_id, user, scan_input, ticket, time.perf_counter())
    run = r.pipeline.start(scan)
    entries = [entry async for entry in run.log.follow()]
    assert run.task is not None
    await run.task
    return scan, entries


def assert_well_formed(entries: list[LogEntry]) -> None:
    assert [e.seq for e in entries] == list(range(1, len(entries) + 1))
    progress = [e.progress for e in entries]
    assert progress == sorted(progress) and progress[0] >= 0 and progress[-1] <= 100
    assert [e.event.terminal for e in entries].count(True) == 1 and entries[-1].event.terminal


async def test_a_scan_publishes_each_stage_in_order_then_done(resources: Resources) -> None:
    scan, entries = await start_scan(resources, 61)
    assert_well_formed(entries)
    stage_events = [(type(e.event), e.event.step) for e in entries if not isinstance(e.event, AnswerDelta)]
    expected = [(kind, step) for step in STAGES for kind in (StageStarted, StageCompleted)]
    assert stage_events == [*expected, (ScanDone, "done")]
    deltas = [i for i, e in enumerate(entries) if isinstance(e.event, AnswerDelta)]
    answer_started = next(i for i, e in enumerate(entries) if e.event == StageStarted("answer"))
    assert deltas and all(answer_started < i for i in deltas)
    done = entries[-1].event
    assert isinstance(done, ScanDone) and entries[-1].progress == 100
    assert set(done.result) >= {
        "classification",
        "disposal_rules",
        "disposal_rules_reason",
        "answer",
        "reward",
    }
    assert set(done.timings) >= {f"{s}_ms" for s in STAGES} | {"total_ms"}
    # The ticket went back, and so did the calls the scan owed.
    assert resources.admission.in_flight == 0 and resources.admission.owed_calls == 0
    assert scan.ticket.owed == 0


async def test_a_failing_stage_ends_the_log_with_one_error_naming_it(
    resources: Resources, sim: RunningSimulator
) -> None:
    await sim_configure(sim, error_rate=1.0, error_status=500, error_kinds=["text"])
    _, entries = await start_scan(resources, 62)
    assert_well_formed(entries)
    error = entries[-1].event
    assert isinstance(error, ScanErrored)
    assert (error.step, error.code, error.retryable) == ("answer", "UPSTREAM_ERROR", True)
    assert not any(isinstance(e.event, StageCompleted) and e.event.step == "answer" for e in entries)
    assert resources.admission.in_flight == 0 and resources.admission.owed_calls == 0


async def test_a_late_reader_replays_the_log_from_any_point(resources: Resources) -> None:
    body = json.dumps({"image_url": data_url(make_jpeg(63))}).encode()
    ticket = await resources.admission.admit("late-reader")
    scan_id = uuid.uuid4()
    await resources.store.create(
        scan_id, user_id=None, image_source="data_url", image_sha256=None, user_input=None
    )
    scan_input = parse_scan_body(body, "application/json", resources.input_limits)
    run = resources.pipeline.start(AcceptedScan(scan_id, None, scan_input, ticket, time.perf_counter()))
    everything = [e async for e in run.log.follow()]
    from_third = [e async for e in run.log.follow(after_seq=2)]
    assert from_third == everything[2:]
    assert run.task is not None
    await run.task


def test_progress_spans_and_owed_calls_come_from_the_stage_list(resources: Resources) -> None:
    runner = resources.pipeline._runner
    assert [s.name for s in runner.stages] == STAGES
    assert runner.calls_per_scan == 2 == resources.admission.calls_per_scan
    spans = progress_spans(runner.stages)
    bounds = [b for s in STAGES for b in (spans[s].started, spans[s].completed)]
    assert bounds == sorted(bounds) and bounds[0] > 0 and bounds[-1] < 100


async def test_a_scan_cancelled_before_its_first_step_still_ends_once(
    resources: Resources, db: asyncpg.Connection
) -> None:
    """A task cancelled before it ever ran would skip its cleanup; the run defers the
    cancel to its first step, so the row, the event and the slot all come out right."""
    body = json.dumps({"image_url": data_url(make_jpeg(64))}).encode()
    scan_input = parse_scan_body(body, "application/json", resources.input_limits)
    ticket = await resources.admission.admit("early-cancel")
    scan_id = uuid.uuid4()
    await resources.store.create(
        scan_id, user_id="early-cancel", image_source="data_url", image_sha256=None, user_input=None
    )
    run = resources.pipeline.start(
        AcceptedScan(scan_id, "early-cancel", scan_input, ticket, time.perf_counter())
    )
    run.cancel()  # same tick: the task has not run yet
    assert run.task is not None
    with pytest.raises(asyncio.CancelledError):
        await run.task
    async with asyncio.timeout(10):  # without a terminal event, following never ends
        entries = [entry async for entry in run.log.follow()]
    assert_well_formed(entries)
    error = entries[-1].event
    assert isinstance(error, ScanErrored) and error.code == "CLIENT_DISCONNECTED"
    row = await scan_row(db, str(scan_id))
    assert (row["status"], row["error_code"]) == ("cancelled", "CLIENT_DISCONNECTED")
    assert resources.admission.in_flight == 0 and not resources.pipeline.running
