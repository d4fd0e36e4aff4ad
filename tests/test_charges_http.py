"""Charges learned from the provider, end to end: the service, real PostgreSQL, the
simulator over real HTTP, its limiter counting differently from our estimate
(`SIM_CHARGE_FACTOR`, `SIM_CHARGE_HANGUL`). After learning, the service spends what the
limiter allows (>= 95 % of its TPM) and meets no 429.

The time scale is short: a small TPM, replies in milliseconds. What is measured is the
simulator's own count of what its limiter charged, between two of its stats readings,
against its refill over the wall-clock time between them; generous bounds, no pass or
fail on the box's speed beyond that."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from app.sim.config import SimConfig
from app.sim.server import RunningSimulator, run_simulator

from .conftest import data_url, make_jpeg, run_scan, running_service, settings_for, sim_stats

# Tokens per minute the key allows: with the service's scans (~1,300-1,900 tokens each,
# as the limiter counts them here) several calls a second, below what the box can run.
TPM = 720_000
ENGLISH = "Is this a plastic bottle with a paper label? Where does it go?"
KOREAN = "종이 라벨이 붙은 플라스틱 병인가요? 어디에 버려야 하나요?"


async def scan_loop(svc: Any, note: str, stop: asyncio.Event, seeds: list[int]) -> list[int]:
    """One user scanning photo after photo until `stop`; statuses of the answers."""
    statuses: list[int] = []
    while not stop.is_set():
        seeds[0] += 1
        outcome = await run_scan(
            svc.client,
            json={"image_url": data_url(make_jpeg(seeds[0])), "user_input": note},
            headers={"X-User-ID": f"u{seeds[0] % 97}"},
        )
        statuses.append(outcome.status)
        if outcome.status != 200:
            await asyncio.sleep(0.2)  # refused at admission (budget): come back soon
    return statuses


async def charged_per_s(sim: RunningSimulator, seconds: float) -> tuple[float, dict[str, Any]]:
    """Tokens the simulator's limiter charged per second over `seconds`."""
    first, started = await sim_stats(sim), time.monotonic()
    await asyncio.sleep(seconds)
    last, ended = await sim_stats(sim), time.monotonic()
    return (last["tokens_charged_total"] - first["tokens_charged_total"]) / (ended - started), last


def limited(factor: float, hangul: float) -> SimConfig:
    return SimConfig(
        time_scale=0.002,
        rpm=0,
        tpm=TPM,
        latency_sigma=0.0,
        text_tokens=40,
        charge_factor=factor,
        charge_hangul=hangul,
    )


async def spend(
    services: list[Any], upstream: RunningSimulator, note: str, seed: int
) -> tuple[float, dict[str, Any], list[int]]:
    """24 users scanning through `services` in turn: the share of the TPM the limiter
    charged once learned, its stats, the answers' statuses."""
    stop, seeds = asyncio.Event(), [seed]
    users = [
        asyncio.create_task(scan_loop(services[i % len(services)], note, stop, seeds)) for i in range(24)
    ]
    try:
        await asyncio.sleep(15)  # learning: well within a minute of traffic
        rate, stats = await charged_per_s(upstream, 20)
    finally:
        stop.set()
        statuses = [s for u in await asyncio.gather(*users) for s in u]
    return rate * 60 / TPM, stats, statuses


def ratios(svc: Any) -> dict[str, float]:
    labels = {"budget": "gpt-4o-mini"}
    return {k: svc.metric("ecoscan_upstream_charge_ratio", {**labels, "kind": k}) for k in ("image", "text")}


SERVICE = {
    "openai_rpm": 100_000,
    "openai_tpm": TPM,
    "max_inflight_per_user": 100,
    "vision_cache_entries": 0,
    "answer_cache_entries": 0,
}


@pytest.mark.parametrize(
    ("factor", "hangul", "note"),
    [(0.6, 1.0, ENGLISH), (1.5, 1.0, ENGLISH), (0.6, 0.7, KOREAN), (1.5, 1.3, KOREAN)],
    ids=["x0.6-english", "x1.5-english", "x0.6-korean", "x1.5-korean"],
)
async def test_a_limiter_counting_differently_is_spent_to_95_percent_without_429(
    database_url: str, sim: RunningSimulator, factor: float, hangul: float, note: str
) -> None:
    async with run_simulator(limited(factor, hangul)) as upstream:
        settings = settings_for(database_url, upstream, **SERVICE)
        async with running_service(settings) as svc:
            share, stats, statuses = await spend([svc], upstream, note, int(factor * 10_000 + hangul * 1000))
            learned = ratios(svc)
    assert stats["rate_limited_total"] == 0
    assert 0.95 <= share <= 1.05, (share, learned)  # the limiter's own minute is not overspent either
    assert statuses.count(200) > 0
    # What it learned is the limiter's formula (Hangul counted its way in the prompts).
    assert 0.5 * factor < learned["image"] < 1.5 * factor, learned


async def test_two_replicas_sharing_a_key_learn_apart_from_each_others_calls(
    database_url: str, sim: RunningSimulator, redis_server_url: str, redis_prefix: str
) -> None:
    """Each replica pairs only readings with no call of the other between them (calls are
    numbered in Redis): the other's calls are not mistaken for a charge of its own."""
    shared = {**SERVICE, "redis_url": redis_server_url, "redis_prefix": redis_prefix}
    async with run_simulator(limited(0.6, 0.7)) as upstream:
        settings = settings_for(database_url, upstream, **shared)
        async with running_service(settings) as a, running_service(settings) as b:
            share, stats, statuses = await spend([a, b], upstream, KOREAN, 50_000)
            learned = [ratios(a), ratios(b)]
            numbered = [
                svc.metric("ecoscan_budget_redis_calls_total", {"model": "gpt-4o-mini", "op": "sent"})
                for svc in (a, b)
            ]
    assert stats["rate_limited_total"] == 0
    assert 0.95 <= share <= 1.05, (share, learned)
    assert statuses.count(200) > 0
    assert min(numbered) > 0
    for ratio in learned:
        assert 0.4 < ratio["image"] < 0.7, learned
