"""Several deployments, one budget each limit group: routing, failover, breakers, a
restarted answer. Real service, real PostgreSQL, simulators over real HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest

from app.settings import Settings
from app.sim.config import SimConfig
from app.sim.server import RunningSimulator, run_simulator

from .conftest import (
    BASE_SIM,
    ScanOutcome,
    Service,
    data_url,
    eventually,
    make_jpeg,
    run_scan,
    running_service,
    settings_for,
    sim_configure,
    sim_stats,
)

SECONDS_PER_MINUTE = 60.0  # an `rpm=1` budget's next call


def deployment(name: str, sim: RunningSimulator, **more: Any) -> dict[str, Any]:
    return {
        "name": name,
        "provider": "openai",
        "base_url": sim.base_url,
        "api_key_env": f"KEY_{name.upper().replace('-', '_')}",
        "vision_model": "gpt-4o-mini",
        "answer_model": "gpt-4o-mini",
        "rpm": 6000,
        "tpm": 10_000_000,
        **more,
    }


@asynccontextmanager
async def simulators(count: int, config: SimConfig = BASE_SIM) -> AsyncIterator[list[RunningSimulator]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(run_simulator(config)) for _ in range(count)]


@asynccontextmanager
async def routed_service(
    database_url: str,
    sim: RunningSimulator,
    monkeypatch: pytest.MonkeyPatch,
    deployments: list[dict[str, Any]],
    **overrides: Any,
) -> AsyncIterator[Service]:
    for d in deployments:
        if "api_key_env" in d:
            monkeypatch.setenv(d["api_key_env"], f"sk-{d['name']}")
    # Many scans at once from one client; no reply caches: every scan calls both stages.
    overrides = {
        "max_inflight_per_user": 100,
        "vision_cache_entries": 0,
        "answer_cache_entries": 0,
        **overrides,
    }
    listed = json.dumps(deployments)
    settings = settings_for(
        database_url, sim, openai_api_key=None, openai_base_url=None, upstreams=listed, **overrides
    )
    async with running_service(settings) as svc:
        yield svc


async def scans(svc: Service, count: int, **request: Any) -> list[ScanOutcome]:
    """`count` scans at once, each of a photo of its own (no reply cache hits)."""
    return await asyncio.gather(
        *(
            run_scan(svc.client, json={"image_url": data_url(make_jpeg(seed)), **request})
            for seed in range(1000, 1000 + count)
        )
    )


async def test_two_organisations_share_the_work_and_neither_rate_limits(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each organisation allows 120 requests a minute: together they carry what one could not.
    limited = SimConfig(time_scale=0.002, rpm=120, tpm=0, latency_sigma=0.0, text_tokens=40)
    async with simulators(2, limited) as (a, b):
        listed = [deployment("org-a", a, rpm=120), deployment("org-b", b, rpm=120)]
        async with routed_service(database_url, sim, monkeypatch, listed) as svc:
            outcomes = await scans(svc, 12)
            stats = [await sim_stats(a), await sim_stats(b)]
    assert [o.terminal.event for o in outcomes] == ["done"] * 12
    assert [s["rate_limited_total"] for s in stats] == [0, 0]
    assert sum(s["requests_total"] for s in stats) == 24
    assert min(s["requests_total"] for s in stats) >= 6, stats  # both carried a share
    assert {o.terminal.data["upstreams"]["vision"] for o in outcomes} <= {"org-a", "org-b"}


# Scans never probe an open breaker (the service's own probes do: app/upstream/probes.py),
# so no count below depends on when a probe falls, however slow the machine.
async def test_an_outage_moves_traffic_and_the_breaker_opens_then_closes(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with simulators(2) as (a, b):
        listed = [deployment("primary", a), deployment("standby", b, priority=1)]
        async with routed_service(database_url, sim, monkeypatch, listed, upstream_open_s=2.0) as svc:
            first = await scans(svc, 2)
            assert {o.terminal.data["upstreams"]["answer"] for o in first} == {"primary"}
            await sim_configure(a, error_rate=1.0, error_status=503)
            during = await scans(svc, 6)
            assert [o.terminal.event for o in during] == ["done"] * 6  # nobody saw the outage
            assert {o.terminal.data["upstreams"]["answer"] for o in during} == {"standby"}
            assert svc.metric("ecoscan_upstream_state", {"upstream": "primary"}) in (1, 2)  # open, probing
            failed_over = svc.metric("ecoscan_upstream_failovers_total", {"stage": "vision", "reason": "5xx"})
            assert failed_over >= 1

            # Open, the dead deployment gets no scan's call (only the service's own probes).
            def routed_to_primary() -> float:
                return sum(
                    svc.metric("ecoscan_upstream_routed_total", {"upstream": "primary", "stage": stage})
                    for stage in ("vision", "answer")
                )

            dead_got = routed_to_primary()
            await scans(svc, 6)
            assert routed_to_primary() == dead_got
            await sim_configure(a, error_rate=0.0)
            # The service's own probe finds it back (app/upstream/probes.py), no scan's call.
            back = {"upstream": "primary", "outcome": "ok"}
            assert await eventually(
                lambda: svc.metric("ecoscan_upstream_probes_total", back) == 1, attempts=1000
            )
            assert routed_to_primary() == dead_got
            after = await scans(svc, 3)
            assert "primary" in {o.terminal.data["upstreams"]["answer"] for o in after}
            assert svc.metric("ecoscan_upstream_state", {"upstream": "primary"}) == 0  # closed again


async def test_a_refused_key_takes_its_deployment_out_loudly(
    database_url: str,
    sim: RunningSimulator,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="app.upstream.breaker")
    async with simulators(2) as (a, b):
        keyless = {**deployment("no-key", a), "provider": "compatible"}
        del keyless["api_key_env"]  # the simulator answers 401 without a key
        listed = [keyless, deployment("good", b, priority=1)]
        async with routed_service(database_url, sim, monkeypatch, listed) as svc:
            outcomes = await scans(svc, 1)
            assert svc.metric("ecoscan_upstream_state", {"upstream": "no-key"}) == 3  # out
            ready = (await svc.client.get("/readyz")).json()
            assert ready["ready"] is True  # the other deployment serves
            # A code, never the provider's text (issue 34: it echoed up to 300 characters).
            assert re.fullmatch(r"out for \d+ s more \(refused 401\)", ready["checks"]["upstreams"]["no-key"])
            assert ready["checks"]["upstreams"]["good"] == "closed"
            assert (await sim_stats(a))["requests_total"] == 1  # one 401, then out
            outcomes += await scans(svc, 4)
            got = (await sim_stats(a))["requests_total"]
    assert [o.terminal.event for o in outcomes] == ["done"] * 5
    assert got == 1  # every later call went to the other
    assert any(
        "upstream no-key taken out" in r.getMessage() and "401" in r.getMessage() for r in caplog.records
    )
    # The log keeps what the provider said, for the operator.
    assert any(
        "upstream no-key refused" in r.getMessage() and "API key" in r.getMessage() for r in caplog.records
    )


async def test_a_refused_key_with_no_other_route_is_the_operators_to_fix(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with simulators(1) as (a,):
        keyless = {**deployment("no-key", a), "provider": "compatible"}
        del keyless["api_key_env"]  # the simulator answers 401 without a key
        async with routed_service(database_url, sim, monkeypatch, [keyless]) as svc:
            first = await scans(svc, 1)
            later = await scans(svc, 2)  # while it is out: the same answer, no call
            assert (await sim_stats(a))["requests_total"] == 1
    for outcome in [*first, *later]:
        error = outcome.terminal
        assert (error.event, error.data["code"], error.data["retryable"]) == (
            "error",
            "UPSTREAM_REJECTED",
            False,
        )
        assert "retry_after" not in error.data  # waiting does not fix a key
        assert "credentials" in error.data["message"]


async def test_a_budget_that_cannot_take_the_call_in_time_ends_it_at_once_with_a_wait(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One request a minute, one at once: the vision call takes it; the answer call would
    # wait ~60 s, past its 45 s limit. It fails at once, saying when the budget has room.
    async with (
        simulators(1) as (a,),
        routed_service(database_url, sim, monkeypatch, [deployment("slow", a, rpm=1)]) as svc,
    ):
        started = asyncio.get_running_loop().time()
        (outcome,) = await scans(svc, 1)
        took = asyncio.get_running_loop().time() - started
    error = outcome.terminal
    assert (error.event, error.data["code"], error.data["retryable"]) == (
        "error",
        "UPSTREAM_RATE_LIMITED",
        True,
    )
    assert error.data["step"] == "answer"
    assert 30 <= error.data["retry_after"] <= 70
    # Not the answer stage's limit waited out (what this test is about), however slow the box.
    assert took < Settings().answer_timeout_s


async def test_a_priority_whose_budget_is_spent_spills_to_the_next(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The primary admits one call a minute: every call after its first goes to the standby
    # at once, none waits on the primary's budget, no scan fails.
    async with simulators(2) as (a, b):
        listed = [deployment("primary", a, rpm=1), deployment("standby", b, priority=1)]
        async with routed_service(database_url, sim, monkeypatch, listed) as svc:
            started = asyncio.get_running_loop().time()
            outcomes = await scans(svc, 4)
            took = asyncio.get_running_loop().time() - started
            routed = [
                svc.metric("ecoscan_upstream_routed_total", {"upstream": n, "stage": "vision"})
                for n in ("primary", "standby")
            ]
    assert [o.terminal.event for o in outcomes] == ["done"] * 4
    assert routed == [1, 3]
    # None waited for the primary's budget: its next call is a minute away.
    assert took < SECONDS_PER_MINUTE


async def test_calls_queued_for_a_deployment_that_goes_down_go_elsewhere_at_once(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The primary admits 6 calls at once, then one a second. Its upstream holds the first 6
    # unanswered while the next ones queue for its budget; then it answers 503s: those 6
    # open its breaker, and the queued calls leave the queue for the standby at once
    # instead of going to the dead primary one a second.
    async with simulators(2) as (a, b):
        listed = [deployment("primary", a, rpm=60), deployment("standby", b, priority=1)]
        async with routed_service(database_url, sim, monkeypatch, listed) as svc:
            await sim_configure(a, outage="hang")
            running = asyncio.ensure_future(scans(svc, 10))
            queued = {"model": "primary/gpt-4o-mini"}

            async def held_and_queued() -> bool:
                held = (await sim_stats(a))["held"]
                return held >= 6 and (svc.metric("ecoscan_budget_waiters", queued) or 0) >= 1

            assert await eventually(held_and_queued, attempts=500, interval=0.01)
            await sim_configure(a, outage="503")
            outcomes = await running
            moved = {"stage": "vision", "reason": "rerouted"}
            rerouted = svc.metric("ecoscan_upstream_failovers_total", moved)
            stats = await sim_stats(a)
    assert [o.terminal.event for o in outcomes] == ["done"] * 10
    # The 6 held, and at most one the budget admitted while the test switched the outage.
    assert stats["requests_total"] + stats["outage_requests_total"] <= 7, stats
    assert rerouted and rerouted >= 1


async def test_with_every_route_down_the_scan_ends_with_a_wait(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with simulators(2) as (a, b):
        listed = [deployment("one", a), deployment("two", b)]
        settings = {"upstream_open_s": 30.0, "upstream_probe_max_s": 30.0, "upstream_ride_out_s": 0.5}
        async with routed_service(database_url, sim, monkeypatch, listed, **settings) as svc:
            for s in (a, b):
                await sim_configure(s, error_rate=1.0, error_status=503)
            outcomes = await scans(svc, 3)
            assert svc.metric("ecoscan_upstream_state", {"upstream": "one"}) == 1
            sent = [(await sim_stats(s))["requests_total"] for s in (a, b)]
            (later,) = await scans(svc, 1)  # both open: no call, a short wait for a return
            assert [(await sim_stats(s))["requests_total"] for s in (a, b)] == sent
    for outcome in outcomes:  # failed on both, or found both open: retryable, with a wait
        error = outcome.terminal
        assert error.event == "error" and error.data["retryable"] is True
        assert error.data["code"] in ("UPSTREAM_ERROR", "UPSTREAM_UNAVAILABLE")
        assert error.data["retry_after"] >= 1
    # Once both are open, the error says when the first one is back.
    error = later.terminal
    assert (error.event, error.data["code"], error.data["retryable"]) == (
        "error",
        "UPSTREAM_UNAVAILABLE",
        True,
    )
    assert error.data["retry_after"] >= 20


async def test_an_answer_broken_after_its_first_token_restarts_elsewhere_once(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with simulators(2) as (a, b):
        listed = [deployment("first", a), deployment("second", b, priority=1)]
        async with routed_service(database_url, sim, monkeypatch, listed) as svc:
            await sim_configure(a, truncate_next=1, truncate_kinds=["text"])
            (outcome,) = await scans(svc, 1)
    names = [e.event for e in outcome.events]
    assert names.count("discard") == 1
    cut = names.index("discard")
    assert "delta" in names[:cut] and "delta" in names[cut:]  # text, void, new text
    done = outcome.terminal
    assert done.event == "done" and done.data["upstreams"]["answer"] == "second"
    after = "".join(e.data["text"] for e in outcome.events[cut:] if e.event == "delta")
    assert done.data["answer"]["user_answer"] in after


async def test_answer_only_traffic_at_a_low_tpm_gets_no_429(database_url: str, sim: RunningSimulator) -> None:
    # The simulator counts like OpenAI's limiter: prompt estimate + max_completion_tokens at
    # arrival, nothing back. Every scan is one answer call (the photo's classification is
    # cached, the answer cache is off) with a 500-token cap that uses a few dozen: a budget
    # that gave the unused cap back would admit more than the limiter does and meet 429s.
    tpm = 60_000
    await sim_configure(sim, tpm=tpm)
    settings = settings_for(
        database_url,
        sim,
        openai_tpm=tpm,
        openai_rpm=10_000,
        rate_burst_fraction=1.0,  # the budget starts as full as the limiter's minute
        max_inflight_per_user=100,
        # Admission prices owed calls as typical vision calls (with a photo), far more than
        # these answers: it must not refuse what the budget will carry.
        max_budget_wait_s=1000.0,
        answer_cache_entries=0,
        # What is reserved, as computed: this is about the cap not given back. Learned
        # charges have their own 0 x 429 tests (tests/test_charges_http.py); here, against
        # a limiter that counts exactly our estimate, their readings' noise alone could
        # reserve a few percent under it.
        charge_learning=False,
    )
    photo = {"image_url": data_url(make_jpeg(77))}
    async with running_service(settings) as svc:
        assert (await run_scan(svc.client, json=photo)).terminal.event == "done"
        outcomes = await asyncio.gather(*(run_scan(svc.client, json=photo) for _ in range(60)))
        stats = await sim_stats(sim)
    assert [o.terminal.event for o in outcomes] == ["done"] * 60
    assert stats["rate_limited_total"] == 0
    # It was the budget that held them back: the limiter's minute holds fewer than 60 calls.
    assert stats["tokens_charged_total"] > tpm


async def test_azure_and_gemini_flavours_complete_scans_end_to_end(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Vision on an Azure deployment (v1 layout, `api-key`), the answer on Gemini's
    # OpenAI-compatible endpoint (no rate headers, its schema subset, its unknown-field 400s).
    azure_sim = SimConfig(
        flavor="azure", api_key="sk-azure", time_scale=0.002, latency_sigma=0.0, text_tokens=40
    )
    gemini_sim = SimConfig(
        flavor="gemini", api_key="sk-gemini", time_scale=0.002, latency_sigma=0.0, text_tokens=40
    )
    async with run_simulator(azure_sim) as az, run_simulator(gemini_sim) as gem:
        listed = [
            {
                "name": "azure",
                "provider": "azure",
                "base_url": f"{az.url}/openai/v1/",
                "api_key_env": "KEY_AZURE",
                "vision_model": "gpt-4o-mini",
                "rpm": 600,
                "tpm": 1_000_000,
            },
            {
                "name": "gemini",
                "provider": "gemini",
                "base_url": f"{gem.url}/v1beta/openai/",
                "api_key_env": "KEY_GEMINI",
                "answer_model": "gemini-2.5-flash",
                "rpm": 600,
                "tpm": 1_000_000,
            },
        ]
        monkeypatch.setenv("KEY_AZURE", "sk-azure")
        monkeypatch.setenv("KEY_GEMINI", "sk-gemini")
        async with routed_service(database_url, sim, monkeypatch, listed) as svc:
            outcomes = await asyncio.gather(
                *(
                    run_scan(
                        svc.client, json={"image_url": data_url(make_jpeg(s))}, headers={"X-User-ID": f"u{s}"}
                    )
                    for s in range(3)
                )
            )
            azure_stats, gemini_stats = await sim_stats(az), await sim_stats(gem)
    assert [o.terminal.event for o in outcomes] == ["done"] * 3
    assert {json.dumps(o.terminal.data["upstreams"], sort_keys=True) for o in outcomes} == {
        '{"answer": "gemini", "vision": "azure"}'
    }
    # Nothing was refused or rate limited: each request was shaped for its provider up front
    # (no safety_identifier nor additionalProperties to Gemini).
    for stats in (azure_stats, gemini_stats):
        assert stats["requests_total"] == 3 and stats["rate_limited_total"] == 0
        assert set(stats["by_status"]) == {"200"}, stats["by_status"]


async def test_a_deployment_refusing_a_parameter_costs_one_extra_call_per_process(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A `compatible` deployment knows nothing of what its server refuses: Gemini's endpoint
    # answers 400 naming each field it does not know; each is learned once, then left out.
    gemini_sim = SimConfig(flavor="gemini", time_scale=0.002, latency_sigma=0.0, text_tokens=40)
    async with run_simulator(gemini_sim) as gem:
        listed = [
            {
                "name": "gateway",
                "provider": "compatible",
                "base_url": f"{gem.url}/v1beta/openai/",
                "api_key_env": "KEY_GATEWAY",
                "vision_model": "gemini-2.5-flash",
                "answer_model": "gemini-2.5-flash",
                "rpm": 600,
                "tpm": 1_000_000,
            }
        ]
        async with routed_service(database_url, sim, monkeypatch, listed) as svc:

            async def scan(seed: int) -> ScanOutcome:
                body = {"image_url": data_url(make_jpeg(seed))}
                return await run_scan(svc.client, json=body, headers={"X-User-ID": "someone"})

            first = [await scan(s) for s in range(2)]
            refused_first = (await sim_stats(gem))["by_status"].get("400", 0)
            later = [await scan(s) for s in range(10, 14)]
            refused_later = (await sim_stats(gem))["by_status"].get("400", 0)
            negotiated = {
                p: svc.metric("ecoscan_upstream_negotiated_total", {"upstream": "gateway", "parameter": p})
                for p in ("safety_identifier", "additionalProperties")
            }
    assert [o.terminal.event for o in [*first, *later]] == ["done"] * 6
    assert negotiated == {"safety_identifier": 1, "additionalProperties": 1}
    assert refused_first == sum(negotiated.values())  # one extra call for each, in this process
    assert refused_later == refused_first  # and never again
