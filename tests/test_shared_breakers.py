"""Breakers shared by two replicas through one real Redis (app/upstream/shared_breaker.py):
what one replica finds broken the other stops calling, a deployment coming back is probed
once across both, and Redis going away leaves each replica's breakers working alone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from app.sim.server import RunningSimulator
from app.upstream.shared_breaker import SYNC_S
from tests.redis_server import RedisServer

from .conftest import Service, eventually, running_service, settings_for, sim_configure, sim_stats
from .test_routing import deployment, scans, simulators

OPEN_S = 3.0  # the first cooldown (UPSTREAM_OPEN_S); a failed probe doubles it (to 3 s at most)
# How long a change may take to reach the other replica: a few syncs.
SPREAD_ATTEMPTS = int(4 * SYNC_S / 0.02)


@asynccontextmanager
async def two_replicas(
    database_url: str,
    sim: RunningSimulator,
    monkeypatch: pytest.MonkeyPatch,
    deployments: list[dict[str, Any]],
    redis: tuple[str, str],
) -> AsyncIterator[tuple[Service, Service]]:
    for d in deployments:
        if "api_key_env" in d:
            monkeypatch.setenv(d["api_key_env"], f"sk-{d['name']}")
    settings = settings_for(
        database_url,
        sim,
        openai_api_key=None,
        openai_base_url=None,
        upstreams=json.dumps(deployments),
        redis_url=redis[0],
        redis_prefix=redis[1],
        upstream_open_s=OPEN_S,
        max_inflight_per_user=100,
        vision_cache_entries=0,
        answer_cache_entries=0,
    )
    async with running_service(settings) as a, running_service(settings) as b:
        yield a, b


async def spreads(predicate: Callable[[], bool]) -> bool:
    """True once `predicate` holds, within the few syncs a change takes to spread."""
    return await eventually(predicate, attempts=SPREAD_ATTEMPTS, interval=0.02)


def state(svc: Service, upstream: str) -> float | None:
    return svc.metric("ecoscan_upstream_state", {"upstream": upstream})


def served_by(outcomes: list[Any], stage: str) -> set[str]:
    return {o.terminal.data["upstreams"][stage] for o in outcomes}


@pytest.mark.timeout(120)
async def test_one_replicas_failures_open_the_breaker_the_other_honours(
    database_url: str,
    sim: RunningSimulator,
    monkeypatch: pytest.MonkeyPatch,
    redis_server_url: str,
    redis_prefix: str,
) -> None:
    redis = (redis_server_url, redis_prefix)
    async with simulators(2) as (primary, standby):
        listed = [deployment("primary", primary), deployment("standby", standby, priority=1)]
        async with two_replicas(database_url, sim, monkeypatch, listed, redis) as (a, b):
            assert served_by(await scans(b, 1), "answer") == {"primary"}
            await sim_configure(primary, error_rate=1.0, error_status=503)
            found = await scans(a, 3)
            assert [o.terminal.event for o in found] == ["done"] * 3
            assert state(a, "primary") == 1
            # `b` never saw a failure, yet within a few syncs it knows, and calls elsewhere.
            assert await eventually(lambda: state(b, "primary") == 1, attempts=SPREAD_ATTEMPTS, interval=0.02)
            routed = {"upstream": "primary", "stage": "vision"}
            sent_by_b = b.metric("ecoscan_upstream_routed_total", routed)
            honoured = await scans(b, 4)
            assert [o.terminal.event for o in honoured] == ["done"] * 4
            assert served_by(honoured, "answer") == {"standby"}
            assert b.metric("ecoscan_upstream_routed_total", routed) == sent_by_b

            # Open, it gets only the service's own probes (one replica's at a time, claimed
            # in Redis), never a scan's call, on either replica.
            failed = {"upstream": "primary", "outcome": "failed"}

            def probes() -> float:
                return a.metric("ecoscan_upstream_probes_total", failed) + b.metric(
                    "ecoscan_upstream_probes_total", failed
                )

            assert await eventually(lambda: probes() >= 2, attempts=3000, interval=0.01)
            busy = await asyncio.gather(scans(a, 4), scans(b, 4))
            assert all(o.terminal.event == "done" for outcomes in busy for o in outcomes)
            calls = sum(
                svc.metric("ecoscan_upstream_routed_total", {"upstream": "primary", "stage": stage})
                for svc in (a, b)
                for stage in ("vision", "answer")
            )
            counted = calls + probes()
            got = (await sim_stats(primary))["requests_total"]
            assert counted <= got <= counted + 2  # the scans' calls before it opened, then probes
            assert state(a, "primary") in (1, 2) and state(b, "primary") in (1, 2)

            # Back: one replica's probe closes it for both.
            await sim_configure(primary, error_rate=0.0)
            assert await eventually(lambda: state(a, "primary") == state(b, "primary") == 0, attempts=3000)
            assert served_by(await scans(b, 2), "answer") == {"primary"}


@pytest.mark.timeout(120)
async def test_a_key_taken_out_on_one_replica_is_out_on_the_other(
    database_url: str,
    sim: RunningSimulator,
    monkeypatch: pytest.MonkeyPatch,
    redis_server_url: str,
    redis_prefix: str,
) -> None:
    redis = (redis_server_url, redis_prefix)
    async with simulators(2) as (refusing, good):
        keyless = {**deployment("refusing", refusing), "provider": "compatible"}
        del keyless["api_key_env"]  # the simulator answers 401 without a key
        listed = [keyless, deployment("good", good, priority=1)]
        async with two_replicas(database_url, sim, monkeypatch, listed, redis) as (a, b):
            assert [o.terminal.event for o in await scans(a, 1)] == ["done"]
            assert state(a, "refusing") == 3
            assert await spreads(lambda: state(b, "refusing") == 3)
            before = (await sim_stats(refusing))["requests_total"]
            assert served_by(await scans(b, 3), "vision") == {"good"}
            assert (await sim_stats(refusing))["requests_total"] == before


@pytest.mark.timeout(120)
async def test_redis_away_leaves_each_replicas_breakers_working_alone(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch, own_redis: RedisServer
) -> None:
    async with simulators(2) as (primary, standby):
        listed = [deployment("primary", primary), deployment("standby", standby, priority=1)]
        async with two_replicas(database_url, sim, monkeypatch, listed, (own_redis.url, "away")) as (a, b):
            assert a.metric("ecoscan_upstream_breakers_shared") == 1
            own_redis.stop()
            await sim_configure(primary, error_rate=1.0, error_status=503)
            outcomes = await scans(a, 4)
            assert [o.terminal.event for o in outcomes] == ["done"] * 4  # no scan saw Redis go
            assert state(a, "primary") == 1  # its own breaker opened all the same
            assert await spreads(lambda: a.metric("ecoscan_upstream_breakers_shared") == 0)
            assert (a.metric("ecoscan_upstream_breaker_redis_errors_total") or 0) >= 1
            assert state(b, "primary") == 0  # nothing reached it: Redis was away
            own_redis.start()
            assert await eventually(
                lambda: a.metric("ecoscan_upstream_breakers_shared") == 1, attempts=500, interval=0.02
            )
            # What `a` found during the outage is written once Redis answers: `b` learns it.
            assert await eventually(lambda: state(b, "primary") == 1, attempts=SPREAD_ATTEMPTS, interval=0.02)
