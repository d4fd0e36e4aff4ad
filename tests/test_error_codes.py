"""The error codes no other test produces, each made to happen over HTTP against the real
service and the simulator: refusals before the stream (`DATABASE_UNAVAILABLE`,
`CPU_SATURATED`), failures that end a started stream (`DATABASE_ERROR`,
`UPSTREAM_REJECTED`, `UPSTREAM_TIMEOUT`, `UPSTREAM_BAD_RESPONSE`), and the answer
stage's divergent retry, which is not an error but must still end with one full `done`.

Every stream ends with exactly one terminal event, and every accepted scan with a
terminal `scans` row that says the same thing. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest
from httpx_sse import aconnect_sse

from app.db.migrations import apply_migrations, bundled_migrations
from app.images.prepare import prepare_image
from app.sim.server import RunningSimulator

from .conftest import (
    SCAN_URL,
    Event,
    ScanOutcome,
    Service,
    data_url,
    eventually,
    make_jpeg,
    run_scan,
    running_service,
    scan_row,
    settings_for,
    sim_configure,
    sim_stats,
)

TERMINAL = ("done", "error")


def only_terminal(events: list[Event]) -> Event:
    """The stream's one terminal event, which must also be its last."""
    terminal = [e for e in events if e.event in TERMINAL]
    assert len(terminal) == 1, [e.event for e in events]
    assert events[-1] is terminal[0]
    return terminal[0]


async def assert_failed(
    outcome: ScanOutcome, db: asyncpg.Connection, *, step: str, code: str, retryable: bool
) -> dict[str, Any]:
    """A started stream ended by one `error` event, and a `failed` row that agrees."""
    assert outcome.status == 200
    error = only_terminal(outcome.events)
    assert (error.event, error.data["step"], error.data["code"]) == ("error", step, code)
    assert error.data["retryable"] is retryable
    row = await scan_row(db, error.data["job_id"])
    assert (row["status"], row["error_code"], row["error_step"]) == ("failed", code, step)
    return row


async def assert_refused(
    outcome: ScanOutcome, db: asyncpg.Connection, *, code: str, rows_before: int
) -> None:
    """A 503 with Retry-After before any stream, and nothing recorded."""
    assert (outcome.status, outcome.body["code"]) == (503, code)
    assert int(outcome.headers["retry-after"]) >= 1
    assert outcome.events == []
    assert await db.fetchval("SELECT count(*) FROM scans") == rows_before


def photo(seed: int) -> dict[str, Any]:
    return {"json": {"image_url": data_url(make_jpeg(seed))}}


def big_photo(seed: int) -> dict[str, Any]:  # resized: prepared in the CPU lane
    return {"json": {"image_url": data_url(make_jpeg(seed, (2000, 1500)))}}


def timeout_retries(svc: Service) -> float:
    return svc.metric("ecoscan_upstream_retries_total", {"model": "gpt-4o-mini", "reason": "timeout"})


@asynccontextmanager
async def table_renamed(db: asyncpg.Connection, table: str) -> AsyncIterator[None]:
    """Every statement naming `table` fails at once (undefined table) until the block ends."""
    await db.execute(f"ALTER TABLE {table} RENAME TO {table}_hidden_by_test")
    try:
        yield
    finally:
        await db.execute(f"ALTER TABLE {table}_hidden_by_test RENAME TO {table}")


@asynccontextmanager
async def table_locked(database_url: str, table: str) -> AsyncIterator[None]:
    """`table` locked ACCESS EXCLUSIVE by another session until the block ends."""
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            await conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            yield
    finally:
        await conn.close()


async def no_statement_waits_for_a_lock(db: asyncpg.Connection) -> bool:
    waiting = await db.fetchval(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    return bool(waiting == 0)


# ----- the database ------------------------------------------------------------------


async def test_a_failing_stage_query_ends_the_stream_with_database_error(
    service: Service, db: asyncpg.Connection
) -> None:
    # A fresh service has no cached rules: the rule stage must query disposal_rules.
    async with table_renamed(db, "disposal_rules"):
        outcome = await run_scan(service.client, **photo(40))
    assert outcome.stage("vision", "completed")  # the stream had started
    await assert_failed(outcome, db, step="rule", code="DATABASE_ERROR", retryable=True)


async def test_a_scans_insert_that_times_out_is_refused_with_503(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    await apply_migrations(db, bundled_migrations())  # start-up then has nothing slow to do
    async with running_service(settings_for(database_url, sim, db_timeout_s=0.5)) as svc:
        rows_before = await db.fetchval("SELECT count(*) FROM scans")
        async with table_locked(database_url, "scans"):
            refused = await run_scan(svc.client, **photo(41))
            # The timed-out insert must be cancelled, not merely abandoned: left waiting, it
            # would go through once the lock is gone.
            assert await eventually(lambda: no_statement_waits_for_a_lock(db))
        await assert_refused(refused, db, code="DATABASE_UNAVAILABLE", rows_before=rows_before)
        assert svc.metric("ecoscan_admission_slots_in_use") == 0
        # The pool survived the timed-out statement: the next scan goes through.
        assert only_terminal((await run_scan(svc.client, **photo(41))).events).event == "done"


# ----- the upstream ------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["vision", "answer"])
async def test_a_model_the_upstream_does_not_know_is_rejected_without_retry(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection, stage: str
) -> None:
    # Unknown models are allowed at start-up (OpenAI-compatible servers name their own);
    # the simulator, like OpenAI, answers 404 model_not_found.
    settings = settings_for(database_url, sim, **{f"{stage}_model": "ecoscan-local-model"})
    async with running_service(settings) as svc:
        outcome = await run_scan(svc.client, **photo(42))
    await assert_failed(outcome, db, step=stage, code="UPSTREAM_REJECTED", retryable=False)
    assert (await sim_stats(sim))["by_status"] == {"404": 1, **({"200": 1} if stage == "answer" else {})}


async def test_a_stream_that_stalls_on_every_attempt_ends_with_upstream_timeout(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    settings = settings_for(database_url, sim, openai_read_timeout_s=0.3, retry_max_attempts=2)
    await sim_configure(sim, stall_rate=1.0, stall_s=10.0)
    async with running_service(settings) as svc:
        outcome = await run_scan(svc.client, **photo(43))
        await assert_failed(outcome, db, step="answer", code="UPSTREAM_TIMEOUT", retryable=True)
        assert (await sim_stats(sim))["stalls_injected"] == 2
        assert timeout_retries(svc) == 1


@pytest.mark.parametrize(("stage", "kind"), [("vision", "vision"), ("answer", "text")])
async def test_a_reply_that_is_not_the_expected_json_is_a_bad_response(
    service: Service, sim: RunningSimulator, db: asyncpg.Connection, stage: str, kind: str
) -> None:
    # The stage's one call gets valid JSON that ignores the schema (what a server that
    # does not enforce it returns), with finish `stop`: only parsing the content finds it.
    await sim_configure(sim, malformed_next=1, malformed_kinds=[kind])
    outcome = await run_scan(service.client, **photo(44))
    await assert_failed(outcome, db, step=stage, code="UPSTREAM_BAD_RESPONSE", retryable=True)
    assert outcome.of("delta") == []
    counters = await sim_stats(sim)
    # Bad content is not retried: the one call got it and nothing was left pending.
    assert counters["malformed_injected"] == 1
    assert counters["by_kind"] == {"vision": 1, "text": 1 if stage == "answer" else 0}


# ----- the CPU lane ------------------------------------------------------------------


async def test_a_full_cpu_lane_refuses_a_scan_with_503(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One worker, no queue; the first scan's image preparation is held inside that worker
    # until the second scan has been refused, so nothing here depends on timing. Photos
    # that need resizing: a small one going on as it came is checked on the loop.
    entered, release = threading.Event(), threading.Event()

    def held_prepare(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("inline"):  # on the loop: refuses these photos, never holds it
            return prepare_image(*args, **kwargs)
        entered.set()
        release.wait(10.0)
        return prepare_image(*args, **kwargs)

    monkeypatch.setattr("app.intake.parsing.prepare_image", held_prepare)
    settings = settings_for(database_url, sim, cpu_max_workers=1, cpu_queue_limit=0)
    async with running_service(settings) as svc:
        rows_before = await db.fetchval("SELECT count(*) FROM scans")
        first = asyncio.create_task(run_scan(svc.client, **big_photo(45)))
        try:
            assert await eventually(entered.is_set, attempts=1000)
            assert svc.metric("ecoscan_cpu_busy_workers") == 1
            refused = await run_scan(svc.client, **big_photo(46))
            await assert_refused(refused, db, code="CPU_SATURATED", rows_before=rows_before)
        finally:
            release.set()
        assert only_terminal((await first).events).event == "done"
        assert await eventually(lambda: svc.metric("ecoscan_admission_slots_in_use") == 0)


async def test_an_unexpected_error_before_the_stream_is_a_500_json_and_nothing_recorded(
    service: Service,
    db: asyncpg.Connection,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bug in accepting a scan (app/http/errors.py, JsonErrorRoute): the same JSON 500
    and count as on any other route, one logged traceback, no row."""

    def broken_prepare(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr("app.intake.parsing.prepare_image", broken_prepare)
    rows_before = await db.fetchval("SELECT count(*) FROM scans")
    outcome = await run_scan(service.client, **photo(47))
    assert (outcome.status, outcome.body) == (500, {"detail": "Internal error.", "code": "INTERNAL_ERROR"})
    assert outcome.events == [] and "a bug" not in json.dumps(outcome.body)
    assert service.metric("ecoscan_scans_total", {"outcome": "rejected", "code": "INTERNAL_ERROR"}) == 1
    assert [r.message for r in caplog.records if r.exc_info] == ["unhandled error"]
    assert await db.fetchval("SELECT count(*) FROM scans") == rows_before
    monkeypatch.undo()
    assert only_terminal((await run_scan(service.client, **photo(48))).events).event == "done"


# ----- the answer stage's divergent retry ----------------------------------------------


async def stream_scan(
    svc: Service, request: dict[str, Any], on_first_delta: Callable[[], Awaitable[None]]
) -> list[Event]:
    """Read a scan's whole stream, awaiting `on_first_delta()` when the answer starts."""
    events: list[Event] = []
    async with aconnect_sse(svc.client, "POST", SCAN_URL, **request) as source:
        async for sse in source.aiter_sse():
            events.append(Event(sse.event, sse.id, json.loads(sse.data)))
            if sse.event == "delta" and len([e for e in events if e.event == "delta"]) == 1:
                await on_first_delta()
    return events


async def test_a_retry_that_writes_another_answer_replaces_the_text_after_a_discard(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    # The first answer attempt stalls halfway; while it is held, the simulator is told to
    # write a shorter text, so the retry (same request, same seed) starts with the same
    # words but ends its first sentence where the client already saw more.
    # 120 text tokens also lengthen the vision reply's free text: give it room.
    # The reply caches off: the second scan of the photo must reach the simulator.
    no_caches = {"vision_cache_entries": 0, "answer_cache_entries": 0}
    settings = settings_for(database_url, sim, openai_read_timeout_s=1.0, vision_max_tokens=400, **no_caches)
    request = photo(47)
    await sim_configure(sim, text_tokens=120, time_scale=0.02)
    async with running_service(settings) as svc:
        clean = await run_scan(svc.client, **request)  # what the first attempt will stream
        clean_text = "".join(e.data["text"] for e in clean.of("delta"))
        await sim_configure(sim, stall_rate=1.0, stall_s=10.0)

        async def shorten_the_retry() -> None:
            await sim_configure(sim, stall_rate=0.0, text_tokens=4)

        events = await stream_scan(svc, request, shorten_the_retry)
        done = only_terminal(events)
        assert done.event == "done", done.data
        names = [e.event for e in events]
        assert names.count("discard") == 1
        cut = names.index("discard")
        streamed = "".join(e.data["text"] for e in events[:cut] if e.event == "delta")
        # Before the discard: part of the first attempt's text...
        assert streamed and clean_text.startswith(streamed) and len(streamed) < len(clean_text)
        # ...after it, the retry's whole text, which `done` carries: the client replaced it.
        final = done.data["answer"]
        assert final != clean.terminal.data["answer"]
        rewritten = "".join(e.data["text"] for e in events[cut:] if e.event == "delta")
        assert rewritten.startswith(final["user_answer"]) and not rewritten.startswith(streamed)
        assert timeout_retries(svc) == 1
        assert (await sim_stats(sim))["stalls_injected"] == 1
        row = await scan_row(db, done.data["job_id"])
        assert (row["status"], row["error_code"], row["answer"]) == ("completed", None, final)
