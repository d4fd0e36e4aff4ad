"""Failures after the stream started end it with one `error` event and a `failed`
row; retryable upstream trouble is absorbed by the one retry layer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import asyncpg
import pytest
from httpx_sse import aconnect_sse

from app.sim.server import RunningSimulator

from .conftest import (
    SCAN_URL,
    Event,
    Service,
    data_url,
    make_jpeg,
    run_scan,
    running_service,
    scan_row,
    settings_for,
    sim_configure,
    sim_stats,
)

KIND = {"vision": "vision", "answer": "text"}


@pytest.fixture
async def impatient(database_url: str, sim: RunningSimulator) -> AsyncIterator[Service]:
    """A service that waits half a second for a deployment's return: a persistent failure
    fails the scan soon (app/upstream/probes.py)."""
    async with running_service(settings_for(database_url, sim, upstream_ride_out_s=0.5)) as svc:
        yield svc


@pytest.mark.parametrize("stage", ["vision", "answer"])
async def test_persistent_5xx_ends_with_error_event_and_failed_row(
    impatient: Service, sim: RunningSimulator, db: asyncpg.Connection, stage: str
) -> None:
    service = impatient
    await sim_configure(sim, error_rate=1.0, error_status=503, error_kinds=[KIND[stage]])
    outcome = await run_scan(service.client, json={"image_url": data_url(make_jpeg(7))})
    assert outcome.status == 200
    error = outcome.terminal
    assert error.event == "error"
    assert error.data["step"] == stage
    assert error.data["code"] == "UPSTREAM_ERROR"
    assert error.data["retryable"] is True
    assert len(outcome.of("done")) == 0
    row = await scan_row(db, error.data["job_id"])
    assert (row["status"], row["error_code"], row["error_step"]) == ("failed", "UPSTREAM_ERROR", stage)
    # Retried up to the attempt limit, never more: one retry layer, not three. (The 503s the
    # simulator counts beyond the calls are the service's own probes of the open deployment.)
    labels = {"model": "gpt-4o-mini", "endpoint": "chat.completions", "status": "5xx"}
    calls = service.metric("ecoscan_upstream_calls_total", labels)
    assert 3 <= calls <= service.settings.retry_max_attempts
    assert (await sim_stats(sim))["by_status"]["503"] >= calls


@pytest.mark.parametrize("stage", ["vision", "answer"])
async def test_persistent_429_ends_with_rate_limited_error(
    impatient: Service, sim: RunningSimulator, db: asyncpg.Connection, stage: str
) -> None:
    service = impatient
    await sim_configure(sim, reject_next=100, reject_retry_after_ms=5, reject_kinds=[KIND[stage]])
    outcome = await run_scan(service.client, json={"image_url": data_url(make_jpeg(8))})
    error = outcome.terminal
    assert (error.event, error.data["step"], error.data["code"]) == ("error", stage, "UPSTREAM_RATE_LIMITED")
    row = await scan_row(db, error.data["job_id"])
    assert (row["status"], row["error_code"]) == ("failed", "UPSTREAM_RATE_LIMITED")
    labels = {"model": "gpt-4o-mini", "type": "rate_limit_exceeded"}
    assert service.metric("ecoscan_upstream_rate_limited_total", labels) >= 1


@pytest.mark.parametrize("stage", ["vision", "answer"])
async def test_a_transient_429_is_absorbed_and_the_scan_completes(
    service: Service, sim: RunningSimulator, db: asyncpg.Connection, stage: str
) -> None:
    await sim_configure(sim, reject_next=1, reject_retry_after_ms=20, reject_kinds=[KIND[stage]])
    outcome = await run_scan(service.client, json={"image_url": data_url(make_jpeg(9))})
    assert outcome.terminal.event == "done", outcome.terminal.data
    stats = await sim_stats(sim)
    assert stats["rate_limited_total"] == 1
    assert service.metric("ecoscan_upstream_retries_total", {"model": "gpt-4o-mini", "reason": "429"}) == 1
    row = await scan_row(db, outcome.terminal.data["job_id"])
    assert row["status"] == "completed"


async def test_a_stream_retried_mid_answer_is_discarded_once_and_sent_again_whole(
    database_url: str, sim: RunningSimulator
) -> None:
    # The first answer stream stalls halfway; the service's read timeout fires and the
    # retry streams the text again from its start. The client is told once to drop what it
    # had (`discard`), then gets the whole text: no piece twice, none missing.
    # The reply caches off: the second scan of the photo must reach the simulator.
    no_caches = {"vision_cache_entries": 0, "answer_cache_entries": 0}
    settings = settings_for(database_url, sim, openai_read_timeout_s=0.3, **no_caches)
    image = {"image_url": data_url(make_jpeg(12))}
    async with running_service(settings) as svc:
        clean = await run_scan(svc.client, json=image)
        clean_text = "".join(e.data["text"] for e in clean.of("delta"))
        await sim_configure(sim, stall_rate=1.0, stall_s=3.0, time_scale=0.02)
        events: list[Event] = []
        async with aconnect_sse(svc.client, "POST", SCAN_URL, json=image) as source:
            async for sse in source.aiter_sse():
                events.append(Event(sse.event, sse.id, json.loads(sse.data)))
                if sse.event == "delta" and sum(e.event == "delta" for e in events) == 1:
                    await sim_configure(sim, stall_rate=0.0)  # only the first attempt stalls
        assert events[-1].event == "done", events[-1].data
        names = [e.event for e in events]
        assert names.count("discard") == 1
        after = events[names.index("discard") :]
        assert "".join(e.data["text"] for e in after if e.event == "delta") == clean_text
        assert events[-1].data["answer"] == clean.terminal.data["answer"]
        assert svc.metric("ecoscan_upstream_stream_restarts_total", {"stage": "answer"}) == 1
        assert (
            svc.metric("ecoscan_upstream_retries_total", {"model": "gpt-4o-mini", "reason": "timeout"}) == 1
        )
        assert (await sim_stats(sim))["stalls_injected"] == 1


async def test_insufficient_quota_is_not_retried(
    service: Service, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    await sim_configure(sim, quota_exhausted=True)
    outcome = await run_scan(service.client, json={"image_url": data_url(make_jpeg(10))})
    error = outcome.terminal
    assert error.data["code"] == "UPSTREAM_QUOTA_EXHAUSTED"
    assert error.data["retryable"] is False
    assert (await sim_stats(sim))["quota_rejected_total"] == 1
    row = await scan_row(db, error.data["job_id"])
    assert (row["status"], row["error_code"]) == ("failed", "UPSTREAM_QUOTA_EXHAUSTED")
