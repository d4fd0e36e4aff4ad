"""The reply caches (app/upstream/reply_cache.py): a photo already classified, or an answer already
written for the same classification, tags and rule, is not asked of OpenAI again;
concurrent scans of one new photo share one call. Over real HTTP against the simulator
and PostgreSQL, plus the cache's bounds and single-flight rules on their own."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import httpx
import pytest
from httpx_sse import aconnect_sse

from app.errors import ScanDeadlineExceeded, UpstreamError, UpstreamRefused
from app.intake.parsing import parse_scan_body
from app.limits.clock import FakeClock
from app.resources import Resources, lifespan_resources
from app.runtime.metrics import Metrics
from app.scans.events import ScanDone
from app.sim.server import RunningSimulator
from app.stages.context import AcceptedScan
from app.stages.order import stage_names
from app.upstream.reply_cache import CacheLimits, ReplyCache

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

CACHES_OFF = {"vision_cache_entries": 0, "answer_cache_entries": 0}


async def scan(svc: Service, seed: int, note: str | None = None, user: str = "cache-user") -> ScanOutcome:
    body: dict[str, Any] = {"image_url": data_url(make_jpeg(seed))}
    if note is not None:
        body["user_input"] = note
    return await run_scan(svc.client, json=body, headers={"X-User-ID": user})


def lookups(svc: Service, cache: str) -> dict[str, float]:
    outcomes = ("hit", "miss", "coalesced")
    return {o: svc.metric("ecoscan_cache_requests_total", {"cache": cache, "outcome": o}) for o in outcomes}


def shape(outcome: ScanOutcome) -> list[tuple[str, str, str | None, tuple[str, ...]]]:
    """The events as a client parses them, a run of `delta`s counted as one."""
    seen: list[tuple[str, str, str | None, tuple[str, ...]]] = []
    for e in outcome.events:
        item = (e.event, e.data["step"], e.data.get("status"), tuple(sorted(e.data)))
        if not (seen and e.event == "delta" and seen[-1][0] == "delta"):
            seen.append(item)
    return seen


def answer_text(outcome: ScanOutcome) -> str:
    return "".join(e.data["text"] for e in outcome.of("delta"))


def without_run_details(event: Event) -> dict[str, Any]:
    # What differs run to run: ids, times, the reward (owned the second time), the
    # numbering, since a cached answer comes as one delta rather than many, and which
    # deployment served each call (none, for a cached reply).
    ignored = ("job_id", "seq", "progress", "duration_ms", "timings", "reward", "upstreams")
    return {k: v for k, v in event.data.items() if k not in ignored}


# --- over HTTP ------------------------------------------------------------------------------


async def test_the_same_photo_twice_is_classified_and_answered_once(
    service: Service, sim: RunningSimulator
) -> None:
    first = await scan(service, 501)
    second = await scan(service, 501)
    assert first.terminal.event == second.terminal.event == "done"
    assert (await sim_stats(sim))["by_kind"] == {"vision": 1, "text": 1}
    assert lookups(service, "vision") == {"hit": 1, "miss": 1, "coalesced": 0}
    assert lookups(service, "answer") == {"hit": 1, "miss": 1, "coalesced": 0}
    # The client cannot tell: the same events, the same results, the answer still as deltas.
    assert shape(first) == shape(second)
    for step in stage_names():
        assert without_run_details(first.stage(step, "completed")) == without_run_details(
            second.stage(step, "completed")
        )
    assert without_run_details(first.terminal) == without_run_details(second.terminal)
    assert answer_text(second) == answer_text(first) != ""


async def test_a_cached_scan_is_stored_like_any_other(service: Service, db: asyncpg.Connection) -> None:
    await scan(service, 502)
    cached = await scan(service, 502)
    job_id = cached.terminal.data["job_id"]
    row = await scan_row(db, job_id)
    assert row["status"] == "completed"
    assert row["classification"] == cached.terminal.data["classification"]
    async with aconnect_sse(
        service.client, "GET", f"/api/v1/scan/{job_id}/events", headers={"X-User-ID": "cache-user"}
    ) as source:
        stored = [Event(sse.event, sse.id, json.loads(sse.data)) async for sse in source.aiter_sse()]
    assert stored == cached.events


async def test_concurrent_scans_of_one_new_photo_share_one_vision_call(
    service: Service, sim: RunningSimulator
) -> None:
    await sim_configure(sim, time_scale=0.05)  # a vision call of ~0.2 s: all five arrive during it
    outcomes = await asyncio.gather(*(scan(service, 503, user=f"crowd-{i}") for i in range(5)))
    assert [o.terminal.event for o in outcomes] == ["done"] * 5
    assert len({json.dumps(o.terminal.data["classification"]) for o in outcomes}) == 1
    assert (await sim_stats(sim))["by_kind"] == {"vision": 1, "text": 1}
    vision = lookups(service, "vision")
    assert vision["miss"] == 1 and vision["coalesced"] >= 1 and vision["hit"] + vision["coalesced"] == 4


async def test_with_the_caches_off_every_scan_calls_upstream(
    database_url: str, sim: RunningSimulator
) -> None:
    await sim_configure(sim, time_scale=0.05)
    async with running_service(settings_for(database_url, sim, **CACHES_OFF)) as svc:
        await scan(svc, 504)
        await scan(svc, 504)
        together = await asyncio.gather(*(scan(svc, 504, user=f"off-{i}") for i in range(3)))
        assert all(o.terminal.event == "done" for o in together)
        assert (await sim_stats(sim))["by_kind"] == {"vision": 5, "text": 5}
        assert lookups(svc, "vision") == lookups(svc, "answer") == {"hit": 0, "miss": 0, "coalesced": 0}


async def test_a_question_bypasses_the_answer_cache_and_a_new_note_the_vision_cache(
    service: Service, sim: RunningSimulator
) -> None:
    for _ in range(2):
        assert (await scan(service, 505, note="라벨은 떼야 하나요?")).terminal.event == "done"
    # The same photo and note: one classification; a question: an answer written each time.
    assert (await sim_stats(sim))["by_kind"] == {"vision": 1, "text": 2}
    assert lookups(service, "answer") == {"hit": 0, "miss": 0, "coalesced": 0}
    await scan(service, 505, note="뚜껑은요?")  # the note is part of the vision request
    assert (await sim_stats(sim))["by_kind"] == {"vision": 2, "text": 3}


async def test_waiters_share_the_upstream_verdict_of_a_failed_call_and_it_is_not_kept(
    service: Service, sim: RunningSimulator
) -> None:
    await sim_configure(sim, time_scale=0.2, refuse_next=1, refuse_kinds=["vision"])
    leader = asyncio.create_task(scan(service, 506, user="leader"))
    assert await eventually(lambda: sim_busy(sim), attempts=300)
    followers = await asyncio.gather(*(scan(service, 506, user=f"follower-{i}") for i in range(3)))
    errors = [o.terminal for o in [await leader, *followers]]
    assert {(e.event, e.data["step"], e.data["code"]) for e in errors} == {
        ("error", "vision", "UPSTREAM_REFUSED")
    }
    assert len({e.data["message"] for e in errors}) == 1  # the refusal's own words, for every scan
    assert (await sim_stats(sim))["by_kind"]["vision"] == 1
    assert lookups(service, "vision") == {"hit": 0, "miss": 1, "coalesced": 3}
    # A failure is not kept: the next scan of the photo asks again.
    assert (await scan(service, 506)).terminal.event == "done"
    assert (await sim_stats(sim))["by_kind"]["vision"] == 2


async def test_a_waiter_calls_itself_when_the_leading_scan_is_cancelled(
    service: Service, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    await sim_configure(sim, time_scale=0.3)  # a vision call of ~1.35 s
    body = {"image_url": data_url(make_jpeg(507))}
    async with (
        httpx.AsyncClient(base_url=service.url, timeout=30) as client,
        aconnect_sse(client, "POST", SCAN_URL, json=body, headers={"X-User-ID": "leaves"}) as source,
    ):
        leader_id = source.response.headers["x-scan-id"]
        assert await eventually(lambda: sim_busy(sim), attempts=300)
        follower = asyncio.create_task(scan(service, 507, user="stays"))
        # The follower's scan is waiting for the leader's call, not calling itself.
        assert await eventually(lambda: service.metric("ecoscan_scans_in_flight") == 2)
        await asyncio.sleep(0.1)
        assert (await sim_stats(sim))["by_kind"]["vision"] == 1
    # The leader's client left: its scan is cancelled, and with it its call.
    outcome = await follower
    assert outcome.terminal.event == "done"  # never the other scan's CancelledError
    assert (await sim_stats(sim))["by_kind"]["vision"] == 2
    assert lookups(service, "vision") == {"hit": 0, "miss": 2, "coalesced": 0}

    async def leader_cancelled() -> bool:
        row = await scan_row(db, leader_id)
        return (row["status"], row["error_code"]) == ("cancelled", "CLIENT_DISCONNECTED")

    assert await eventually(leader_cancelled)


async def test_a_rule_change_invalidates_the_cached_answer(
    service: Service, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    first = await scan(service, 508)
    rules = first.terminal.data["disposal_rules"]
    assert rules is not None, "pick a seed whose classification has a rule"
    key = rules["key"]
    original = await db.fetchval(
        "SELECT document FROM disposal_rules WHERE major = $1 AND middle IS NOT DISTINCT FROM $2",
        key["major"],
        key["middle"],
    )
    changed = {**original, "summary": f"바뀐 규칙 {uuid.uuid4().hex[:8]}"}
    await db.execute(
        "UPDATE disposal_rules SET document = $1 WHERE major = $2 AND middle IS NOT DISTINCT FROM $3",
        changed,
        key["major"],
        key["middle"],
    )
    try:

        async def sees_new_rule() -> bool:  # the NOTIFY reaches the rule cache within moments
            rule = (await scan(service, 508)).terminal.data["disposal_rules"]
            return bool(rule["summary"] == changed["summary"])

        assert await eventually(sees_new_rule, attempts=50, interval=0.05)
        # One classification throughout; the answer was written again for the new rule…
        assert (await sim_stats(sim))["by_kind"] == {"vision": 1, "text": 2}
        await scan(service, 508)  # …and that one is kept in turn
        assert (await sim_stats(sim))["by_kind"] == {"vision": 1, "text": 2}
    finally:
        await db.execute(
            "UPDATE disposal_rules SET document = $1 WHERE major = $2 AND middle IS NOT DISTINCT FROM $3",
            original,
            key["major"],
            key["middle"],
        )


async def test_cached_prompt_tokens_are_counted(service: Service, sim: RunningSimulator) -> None:
    # Another note: not the vision cache's, but OpenAI's prompt cache serves everything up to
    # the note (schema, system prompt, instruction, the photo's ~2,833 tokens).
    await scan(service, 509, note="첫 번째 메모")
    await scan(service, 509, note="두 번째 메모")
    cached = service.metric("ecoscan_upstream_tokens_total", {"model": "gpt-4o-mini", "kind": "cached"})
    assert cached >= 2048
    assert cached == (await sim_stats(sim))["tokens"]["cached"]


async def sim_busy(sim: RunningSimulator) -> bool:
    return bool((await sim_stats(sim))["inflight"] >= 1)


# --- the budget and the admission's owed calls ----------------------------------------------


@pytest.fixture
async def resources(database_url: str, sim: RunningSimulator) -> AsyncIterator[Resources]:
    settings = settings_for(database_url, sim, openai_rpm=60)  # 1 request a second refills
    async with lifespan_resources(settings, Metrics(process=False)) as r:
        yield r


async def run_pipeline_scan(r: Resources, seed: int) -> AcceptedScan:
    body = json.dumps({"image_url": data_url(make_jpeg(seed))}).encode()
    ticket = await r.admission.admit("budget-user")
    scan_id = uuid.uuid4()
    await r.store.create(
        scan_id, user_id="budget-user", image_source="data_url", image_sha256=None, user_input=None
    )
    accepted = AcceptedScan(
        scan_id,
        "budget-user",
        parse_scan_body(body, "application/json", r.input_limits),
        ticket,
        time.perf_counter(),
    )
    run = r.pipeline.start(accepted)
    entries = [entry async for entry in run.log.follow()]
    assert isinstance(entries[-1].event, ScanDone)
    return accepted


async def test_hits_take_nothing_from_the_budget_and_owe_no_calls(
    resources: Resources, sim: RunningSimulator
) -> None:
    r = resources
    await run_pipeline_scan(r, 510)
    budget = r.budgets["gpt-4o-mini"]
    reservations = r.metrics.registry.get_sample_value(
        "ecoscan_budget_wait_seconds_count", {"model": "gpt-4o-mini"}
    )
    assert reservations == 2
    available = budget.available_requests
    scans = [await run_pipeline_scan(r, 510) for _ in range(3)]
    assert (await sim_stats(sim))["by_kind"] == {"vision": 1, "text": 1}
    assert (
        r.metrics.registry.get_sample_value("ecoscan_budget_wait_seconds_count", {"model": "gpt-4o-mini"})
        == 2
    )
    assert budget.available_requests >= available  # only refilled, never taken
    assert r.admission.owed_calls == 0 and r.admission.in_flight == 0
    assert all(s.ticket.owed == 0 for s in scans)


# --- the cache on its own -------------------------------------------------------------------


def cache(entries: int = 10, max_bytes: int = 10_000, ttl_s: float = 60.0) -> tuple[ReplyCache, FakeClock]:
    clock = FakeClock()
    limits = CacheLimits(entries, max_bytes, ttl_s)
    return ReplyCache("vision", limits, clock=clock, metrics=Metrics(process=False)), clock


def reply(text: str, calls: list[str] | None = None) -> Callable[[], Awaitable[str]]:
    async def call() -> str:
        if calls is not None:
            calls.append(text)
        return text

    return call


async def test_the_least_recently_used_reply_goes_first_past_the_entry_bound() -> None:
    c, _ = cache(entries=2)
    await c.get_or_call("a", reply("A"))
    await c.get_or_call("b", reply("B"))
    await c.get_or_call("a", reply("never"))  # a is used again: b is now the oldest
    await c.get_or_call("c", reply("C"))
    calls: list[str] = []
    assert await c.get_or_call("a", reply("A2", calls)) == "A" and calls == []
    assert await c.get_or_call("b", reply("B2", calls)) == "B2" and calls == ["B2"]
    assert c.entries == 2


async def test_the_byte_bound_evicts_and_a_reply_larger_than_it_is_not_kept() -> None:
    c, _ = cache(max_bytes=100)
    await c.get_or_call("a", reply("가" * 20))  # 1 + 60 bytes
    await c.get_or_call("b", reply("나" * 10))  # 1 + 30: together 92
    assert (c.entries, c.bytes) == (2, 92)
    await c.get_or_call("c", reply("다" * 10))  # 123 would not fit: a goes
    assert (c.entries, c.bytes) == (2, 62)
    await c.get_or_call("d", reply("x" * 200))
    assert (c.entries, c.bytes) == (2, 62)


async def test_an_expired_reply_is_asked_again() -> None:
    c, clock = cache(ttl_s=60.0)
    calls: list[str] = []
    await c.get_or_call("a", reply("A", calls))
    await clock.advance(59.9)
    await c.get_or_call("a", reply("A", calls))
    await clock.advance(0.1)
    await c.get_or_call("a", reply("A", calls))
    assert calls == ["A", "A"]


@pytest.mark.parametrize("bounds", [(0, 100, 60.0), (10, 0, 60.0), (10, 100, 0.0)])
async def test_a_zero_bound_turns_the_cache_and_the_sharing_off(bounds: tuple[int, int, float]) -> None:
    c, _ = cache(*bounds)
    calls: list[str] = []
    gate = asyncio.Event()

    async def slow() -> str:
        calls.append("call")
        await gate.wait()
        return "A"

    tasks = [asyncio.create_task(c.get_or_call("a", slow)) for _ in range(3)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*tasks) == ["A"] * 3
    assert len(calls) == 3 and c.entries == 0


async def held_call(c: ReplyCache, key: str) -> tuple[asyncio.Task[str], asyncio.Event, list[str]]:
    """A leader whose call runs until the test says; the list records each call made."""
    release = asyncio.Event()
    calls: list[str] = []

    async def call() -> str:
        calls.append(key)
        await release.wait()
        return "reply"

    task = asyncio.create_task(c.get_or_call(key, call))
    await asyncio.sleep(0)
    return task, release, calls


async def test_a_waiter_whose_leader_is_cancelled_leads_a_call_of_its_own() -> None:
    c, _ = cache()
    leader, _release, calls = await held_call(c, "k")
    follower = asyncio.create_task(c.get_or_call("k", reply("own", calls)))
    await asyncio.sleep(0)
    leader.cancel()
    assert await follower == "own"
    assert calls == ["k", "own"]
    with pytest.raises(asyncio.CancelledError):
        await leader


async def failing_leader(c: ReplyCache, error: Exception) -> tuple[asyncio.Task[str], asyncio.Event]:
    """A leader whose call raises `error` once the test releases it."""
    release = asyncio.Event()

    async def call() -> str:
        await release.wait()
        raise error

    task = asyncio.create_task(c.get_or_call("k", call))
    await asyncio.sleep(0)
    return task, release


async def test_a_waiter_whose_leader_ran_out_of_its_own_time_leads_instead() -> None:
    c, _ = cache()
    leader, release = await failing_leader(c, ScanDeadlineExceeded())
    calls: list[str] = []
    follower = asyncio.create_task(c.get_or_call("k", reply("own", calls)))
    await asyncio.sleep(0)
    assert calls == []  # waiting for the leader
    release.set()
    with pytest.raises(ScanDeadlineExceeded):
        await leader
    assert await follower == "own" and calls == ["own"]


async def test_waiters_get_their_own_copy_of_the_upstream_verdict() -> None:
    c, _ = cache()
    verdict = UpstreamRefused("The AI model declined to answer: no.")
    leader, release = await failing_leader(c, verdict)
    followers = [asyncio.create_task(c.get_or_call("k", reply("never"))) for _ in range(2)]
    await asyncio.sleep(0)
    release.set()
    results = await asyncio.gather(leader, *followers, return_exceptions=True)
    assert results[0] is verdict
    for shared in results[1:]:
        assert isinstance(shared, UpstreamRefused) and shared is not verdict
        assert shared.message == verdict.message
    assert c.entries == 0


async def test_a_waiter_that_gives_up_leaves_the_call_to_the_others() -> None:
    c, _ = cache()
    leader, release, calls = await held_call(c, "k")
    impatient = asyncio.create_task(c.get_or_call("k", reply("never")))
    patient = asyncio.create_task(c.get_or_call("k", reply("never")))
    await asyncio.sleep(0)
    impatient.cancel()  # its own deadline, its own client
    await asyncio.sleep(0)
    release.set()
    assert await leader == await patient == "reply"
    assert calls == ["k"]
    with pytest.raises(asyncio.CancelledError):
        await impatient


async def test_lookups_are_counted_once_each() -> None:
    metrics = Metrics(process=False)
    c = ReplyCache("answer", CacheLimits(10, 10_000, 60.0), clock=FakeClock(), metrics=metrics)
    leader, release, _ = await held_call(c, "k")
    follower = asyncio.create_task(c.get_or_call("k", reply("never")))
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(leader, follower)
    await c.get_or_call("k", reply("never"))
    with pytest.raises(UpstreamError):
        await c.get_or_call("other", _raises(UpstreamError()))

    def count(outcome: str) -> float | None:
        return metrics.registry.get_sample_value(
            "ecoscan_cache_requests_total", {"cache": "answer", "outcome": outcome}
        )

    assert (count("miss"), count("coalesced"), count("hit")) == (2, 1, 1)
    assert metrics.registry.get_sample_value("ecoscan_cache_entries", {"cache": "answer"}) == 1
    assert metrics.registry.get_sample_value("ecoscan_cache_bytes", {"cache": "answer"}) == len("k") + len(
        "reply"
    )


def _raises(error: Exception) -> Callable[[], Awaitable[str]]:
    async def call() -> str:
        raise error

    return call
