"""What each scan cost (app/upstream/prices.py): the price arithmetic, the deployments'
prices, and over real HTTP a scan's stored cost against what the simulators say they
served — retried, hedged and refused calls included — and the documented spend query on
real PostgreSQL."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

from app.sim.config import SimConfig
from app.sim.server import RunningSimulator
from app.upstream.call import ChatResult
from app.upstream.deployments import DeploymentError, parse_deployments
from app.upstream.prices import DEFAULT_PRICES, Price, price_of
from app.upstream.wire import read_completion

from .conftest import ScanOutcome, Service, data_url, make_jpeg, run_scan, sim_configure, sim_stats
from .test_routing import deployment, routed_service, simulators

DEPLOY_DOC = Path(__file__).resolve().parent.parent / "docs" / "deploy.md"


def test_cached_prompt_tokens_are_priced_at_the_cached_rate_and_reasoning_is_not_counted_twice() -> None:
    price = Price(input=0.15, cached_input=0.075, output=0.60)
    # 3,000 prompt tokens of which 1,024 cached; 100 completion tokens of which 40 reasoning.
    usd = price.cost((3000, 100, 40, 1024))
    assert usd == pytest.approx((1976 * 0.15 + 1024 * 0.075 + 100 * 0.60) / 1e6, rel=1e-12)
    assert price.cost((0, 0, 0, 0)) == 0.0
    # A provider that reports more cached than prompt tokens is not paid to be called.
    assert price.cost((10, 0, 0, 50)) == pytest.approx(10 * 0.075 / 1e6)


def test_a_dated_snapshot_takes_its_models_price_and_an_unknown_model_has_none() -> None:
    assert price_of("gpt-4o-mini-2024-07-18", DEFAULT_PRICES) == DEFAULT_PRICES["gpt-4o-mini"]
    assert price_of("gpt-5-mini", DEFAULT_PRICES) == Price(0.25, 0.025, 2.00)
    assert price_of("gpt-5-nano", DEFAULT_PRICES) is None  # not gpt-5's
    assert price_of("my-azure-deployment", DEFAULT_PRICES) is None


def test_gemini_thinking_reported_only_in_the_total_is_billed_as_completion() -> None:
    reply = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 300, "completion_tokens": 20, "total_tokens": 420},
    }
    assert read_completion(orjson.dumps(reply), ChatResult()) == (300, 120, 100, 0)
    openai = {**reply, "usage": {"prompt_tokens": 300, "completion_tokens": 120, "total_tokens": 420}}
    assert read_completion(orjson.dumps(openai), ChatResult()) == (300, 120, 0, 0)


def _listed(**more: Any) -> str:
    entry = {
        "name": "a",
        "provider": "compatible",
        "base_url": "http://127.0.0.1:1/v1",
        "vision_model": "m",
        "answer_model": "m",
        "rpm": 1,
        "tpm": 1,
        **more,
    }
    return json.dumps([entry])


def test_a_deployments_prices_are_read_and_checked() -> None:
    (listed,) = parse_deployments(_listed(prices={"m": {"input": 1, "output": 2.5}}), None) or ()
    assert listed.prices == {"m": Price(1.0, 1.0, 2.5)}  # no cached rate: the input rate
    for bad, says in [
        ({"m": {"input": 1}}, "input and output required"),
        ({"m": {"input": 1, "output": 2, "batch": 1}}, "input and output required"),
        ({"m": {"input": -1, "output": 2}}, r"prices\.m\.input"),
        ({"m": {"input": "1", "output": 2}}, r"prices\.m\.input"),
        ([1], "an object of models"),
    ]:
        with pytest.raises(DeploymentError, match=says):
            parse_deployments(_listed(prices=bad), None)


async def _scans(svc: Service, count: int, user: str) -> list[ScanOutcome]:
    """`count` scans of `user` at once, each of a photo of its own."""
    return await asyncio.gather(
        *(
            run_scan(svc.client, json={"image_url": data_url(make_jpeg(seed))}, headers={"X-User-ID": user})
            for seed in range(1000, 1000 + count)
        )
    )


def _priced(stats: dict[str, Any], price: Price) -> float:
    tokens = stats["tokens"]
    return price.cost((tokens["prompt"], tokens["completion"], tokens["reasoning"], tokens["cached"]))


def _spend_query() -> str:
    section = DEPLOY_DOC.read_text().split("## What the scans cost", 1)[1]
    found = re.search(r"```sql\n(.*?)```", section, re.S)
    assert found, "deploy.md's spend query"
    return found.group(1)


async def test_a_scans_stored_cost_is_the_priced_usage_of_every_call_retries_and_hedges_included(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch, db: asyncpg.Connection
) -> None:
    payer = f"payer-{uuid.uuid4().hex[:8]}"  # the database is the session's: rows of other tests
    fast = SimConfig(time_scale=0.002, latency_sigma=0.0, text_tokens=40)
    # Half of "slow"'s replies are held before their first byte: hedged on "fast", and the
    # held attempt is cancelled before its reply (the simulator counts no tokens for it).
    slow_config = SimConfig(**{**fast.to_dict(), "hold_rate": 0.5, "hold_s": 120.0, "seed": 7})
    prices = {"fast": Price(0.15, 0.075, 0.60), "slow": Price(1.10, 0.275, 4.40)}
    async with simulators(1, fast) as (fast_sim,), simulators(1, slow_config) as (slow_sim,):
        listed = [
            deployment(name, served, prices={"gpt-4o-mini": dataclasses.asdict(price)})
            for name, served, price in (
                ("slow", slow_sim, prices["slow"]),
                ("fast", fast_sim, prices["fast"]),
            )
        ]
        settings = {"hedge_min_s": 0.2, "hedge_max_s": 0.4, "hedge_budget": 1.0, "openai_read_timeout_s": 5.0}
        async with routed_service(database_url, sim, monkeypatch, listed, **settings) as svc:
            outcomes = []
            for wave in range(4):  # a few at a time: the other deployment has room for a hedge
                if wave == 2:  # on "fast": two 429s (retried), a refused vision reply (billed, not retried)
                    await sim_configure(fast_sim, reject_next=2, refuse_next=1, refuse_kinds=["vision"])
                outcomes += await _scans(svc, 4, payer)
            hedged = sum(
                svc.metric("ecoscan_upstream_hedges_total", {"stage": s, "outcome": "won"})
                for s in ("vision", "answer")
            )
            retried = svc.metric("ecoscan_upstream_retries_total", {"model": "gpt-4o-mini", "reason": "429"})
            metered = {
                name: svc.metric(
                    "ecoscan_upstream_cost_usd_total", {"deployment": name, "model": "gpt-4o-mini"}
                )
                for name in prices
            }
            observed = svc.metric("ecoscan_scan_cost_usd_sum")
            probes = sum(
                svc.metric("ecoscan_upstream_probes_total", {"upstream": name, "outcome": outcome})
                for name in prices
                for outcome in ("ok", "failed")
            )
            stats = {"fast": await sim_stats(fast_sim), "slow": await sim_stats(slow_sim)}

    ids = [uuid.UUID(o.events[0].data["job_id"]) for o in outcomes]
    rows = await db.fetch("SELECT status, error_code, cost_usd FROM scans WHERE id = ANY($1)", ids)
    terminals = sorted(o.terminal.event for o in outcomes)
    assert terminals == ["done"] * 15 + ["error"], [o.terminal.data for o in outcomes]
    # Probes are the service's own calls, in no scan's cost: had a breaker opened, the
    # simulators' counts would hold theirs.
    assert probes == 0
    assert hedged >= 1 and retried >= 1 and stats["slow"]["holds_injected"] >= 1, (hedged, retried)
    assert stats["fast"]["refusals_injected"] == 1
    # What each deployment's simulator says it served, priced at that deployment's prices.
    expected = {name: _priced(stats[name], price) for name, price in prices.items()}
    assert expected["slow"] > 0 and expected["fast"] > 0
    assert metered == pytest.approx(expected, rel=1e-9)
    costs = [row["cost_usd"] for row in rows]
    assert all(isinstance(cost, Decimal) and cost > 0 for cost in costs), costs
    assert float(sum(costs)) == pytest.approx(sum(expected.values()), rel=1e-9)
    assert observed == pytest.approx(sum(expected.values()), rel=1e-9)
    refused = next(row for row in rows if row["status"] == "failed")
    assert refused["error_code"] == "UPSTREAM_REFUSED" and refused["cost_usd"] > 0  # the refusal was billed

    # The documented spend query, on the same rows.
    spend = await db.fetch(_spend_query())
    (day,) = [r for r in spend if r["user_id"] == payer]
    assert day["scans"] == 16 and day["unpriced_scans"] == 0
    assert day["cost_usd"] == sum(costs)


async def test_a_model_with_no_price_leaves_the_scans_cost_unknown_not_zero(
    database_url: str,
    sim: RunningSimulator,
    monkeypatch: pytest.MonkeyPatch,
    db: asyncpg.Connection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    user = f"unpriced-{uuid.uuid4().hex[:8]}"
    fast = SimConfig(time_scale=0.002, latency_sigma=0.0, text_tokens=40)
    async with simulators(1, fast) as (served,):
        listed = [deployment("only", served, vision_model="gpt-4o-mini", answer_model="gpt-4.1-nano")]
        async with routed_service(database_url, sim, monkeypatch, listed) as svc:
            (outcome,) = await _scans(svc, 1, user)
            unpriced = svc.metric(
                "ecoscan_upstream_unpriced_calls_total", {"deployment": "only", "model": "gpt-4.1-nano"}
            )
            priced = svc.metric(
                "ecoscan_upstream_cost_usd_total", {"deployment": "only", "model": "gpt-4o-mini"}
            )
            observed = svc.metric("ecoscan_scan_cost_usd_count")
    assert outcome.terminal.event == "done"
    warned = [r.getMessage() for r in caplog.records if "no price for model" in r.getMessage()]
    assert warned == ["deployment only: no price for model gpt-4.1-nano: its calls' cost is unknown "
                      "(set `prices` on the deployment; docs/configuration.md#prices)"]  # fmt: skip
    assert unpriced == 1 and priced > 0 and observed == 0
    row = await db.fetchrow(
        "SELECT cost_usd FROM scans WHERE id = $1", uuid.UUID(outcome.events[0].data["job_id"])
    )
    assert row is not None and row["cost_usd"] is None
    spend = await db.fetch(_spend_query())
    assert [(r["scans"], r["cost_usd"], r["unpriced_scans"]) for r in spend if r["user_id"] == user] == [
        (1, None, 1)
    ]
