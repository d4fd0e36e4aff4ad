"""The pipeline without HTTP: real stages (simulator over HTTP, real PostgreSQL) run by
the runner, read as domain events from the scan's log, not as SSE."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pytest

from app.intake.parsing import parse_scan_body
from app.resources import Resources, lifespan_resources
from app.runtime.metrics import Metrics
from app.scans.events import (
    AnswerDelta,
    EventLog,
    ItemsFound,
    LogEntry,
    ScanDone,
    ScanErrored,
    ScanEvent,
    StageCompleted,
    StageStarted,
)
from app.scans.finished import FinishedScans
from app.scans.runner import progress_spans
from app.scans.store import StoredScan
from app.sim.server import RunningSimulator
from app.stages.context import AcceptedScan
from app.stages.order import stage_names

from .conftest import data_url, make_jpeg, scan_row, settings_for, sim_configure

STAGES = stage_names()


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
    expected: list[tuple[type[ScanEvent], str]] = [
        (kind, step) for step in STAGES for kind in (StageStarted, StageCompleted)
    ]
    # A photo of one item: today's events, and the item count as vision finds it.
    expected.insert(1, (ItemsFound, "vision"))
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


async def test_an_ended_scan_is_kept_as_the_row_it_wrote_not_as_its_run(
    resources: Resources, db: asyncpg.Connection
) -> None:
    """After its task ends, a scan is no longer a run (events, task, input) but, for a
    while, the terminal row it wrote: the same status and the same stored log."""
    scan, entries = await start_scan(resources, 65, user="kept-after-end")
    await asyncio.sleep(0)  # the task's done callbacks
    assert scan.id not in resources.pipeline.runs
    kept = resources.pipeline.finished.get(scan.id)
    assert kept is not None and kept.event_log is not None
    row = await scan_row(db, str(scan.id))
    assert (kept.status, kept.user_id, kept.token_sha256) == (row["status"], "kept-after-end", None)
    assert json.loads(kept.event_log) == json.loads(row["event_log"])
    replayed = EventLog.from_json(kept.event_log).entries
    assert [(e.seq, e.progress, e.event.kind, e.event.fields()) for e in replayed] == [
        (e.seq, e.progress, e.event.kind, json.loads(json.dumps(e.event.fields()))) for e in entries
    ]


def test_finished_scans_expire_in_the_order_they_ended_without_timers() -> None:
    now = [100.0]
    kept = FinishedScans(kept_s=60.0, clock=lambda: now[0])

    def ended(n: int) -> StoredScan:
        return StoredScan(uuid.UUID(int=n), None, "completed", datetime.now(UTC), None, "[]", None)

    first, second = ended(1), ended(2)
    kept.keep(first)
    now[0] = 130.0
    kept.keep(second)
    assert kept.get(first.id) is first and len(kept) == 2
    now[0] = 160.0  # the first has been kept 60 s
    assert kept.get(first.id) is None and kept.get(second.id) is second and len(kept) == 1
    now[0] = 190.0
    assert kept.get(second.id) is None and len(kept) == 0


def test_the_stage_list_is_the_products_four_stages_in_order() -> None:
    # The one place the list is written out: everything else reads app/stages/order.py.
    assert stage_names() == ["vision", "rule", "answer", "reward"]


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
