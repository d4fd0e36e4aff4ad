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


@pytest.mark.parametrize(
    ("factor", "hangul", "note"),
    [(0.6, 1.0, ENGLISH), (1.5, 1.0, ENGLISH), (0.6, 0.7, KOREAN), (1.5, 1.3, KOREAN)],
    ids=["x0.6-english", "x1.5-english", "x0.6-korean", "x1.5-korean"],
)
async def test_a_limiter_counting_differently_is_spent_to_95_percent_without_429(
    database_url: str, sim: RunningSimulator, factor: float, hangul: float, note: str
) -> None:
    limited = SimConfig(
        time_scale=0.002,
        rpm=0,
        tpm=TPM,
        latency_sigma=0.0,
        text_tokens=40,
        charge_factor=factor,
        charge_hangul=hangul,
    )
    async with run_simulator(limited) as upstream:
        settings = settings_for(
            database_url,
            upstream,
            openai_tpm=TPM,
            openai_rpm=100_000,
            max_inflight_per_user=100,
            vision_cache_entries=0,
            answer_cache_entries=0,
        )
        async with running_service(settings) as svc:
            stop, seeds = asyncio.Event(), [int(factor * 10_000 + hangul * 1000)]
            users = [asyncio.create_task(scan_loop(svc, note, stop, seeds)) for _ in range(24)]
            try:
                await asyncio.sleep(15)  # learning: well within a minute of traffic
                rate, stats = await charged_per_s(upstream, 20)
            finally:
                stop.set()
                statuses = [s for u in await asyncio.gather(*users) for s in u]
            ratios = {
                kind: svc.metric("ecoscan_upstream_charge_ratio", {"budget": "gpt-4o-mini", "kind": kind})
                for kind in ("image", "text")
            }
    print(f"factor {factor} hangul {hangul}: {rate * 60 / TPM:.3f} of TPM, ratios {ratios}, {stats}")
    print({s: statuses.count(s) for s in set(statuses)})
    assert stats["rate_limited_total"] == 0
    assert rate * 60 >= 0.95 * TPM, (rate * 60 / TPM, ratios)
    assert rate * 60 <= 1.05 * TPM, (rate * 60 / TPM, ratios)  # the limiter's own minute is not overspent
    assert statuses.count(200) > 0
