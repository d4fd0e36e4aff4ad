"""Two service instances sharing one Redis (as two replicas would): the budget is
shared, per-user caps count both, and Redis going away never stops either."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
import pytest

from app.sim.server import RunningSimulator
from tests.conftest import (
    SCAN_URL,
    Service,
    data_url,
    eventually,
    make_jpeg,
    run_scan,
    running_service,
    settings_for,
    sim_configure,
)
from tests.redis_server import RedisServer
from tests.service_process import ServiceProcess, service_env, service_process
from tests.test_lifecycle import stalled_scan

BURST_TIMEOUT_S = 30.0


async def test_scans_complete_on_a_shared_budget(
    database_url: str, sim: RunningSimulator, redis_server_url: str, redis_prefix: str
) -> None:
    settings = settings_for(database_url, sim, redis_url=redis_server_url, redis_prefix=redis_prefix)
    async with running_service(settings) as a, running_service(settings) as b:
        for svc, seed in ((a, 1), (b, 2), (a, 3)):
            outcome = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(seed))})
            assert outcome.terminal.event == "done"
        model = settings.vision_model
        assert a.metric("ecoscan_budget_shared", {"model": model}) == 1
        assert a.metric("ecoscan_budget_redis_calls_total", {"model": model, "op": "grant"}) >= 1
        # Both processes have leased: each counts itself and the other.
        assert await eventually(lambda: a.metric("ecoscan_budget_share", {"model": model}) == 0.5)


async def test_the_per_user_cap_counts_every_replica(
    database_url: str, sim: RunningSimulator, redis_server_url: str, redis_prefix: str
) -> None:
    settings = settings_for(
        database_url, sim, redis_url=redis_server_url, redis_prefix=redis_prefix, max_inflight_per_user=1
    )
    await sim_configure(sim, stall_rate=1.0, stall_s=10.0)
    async with running_service(settings) as a, running_service(settings) as b:
        async with stalled_scan(a, "greedy"):
            again = await run_scan(
                b.client, json={"image_url": data_url(make_jpeg(3))}, headers={"X-User-ID": "greedy"}
            )
            assert (again.status, again.body["code"]) == (429, "USER_CONCURRENCY_LIMIT")
        await sim_configure(sim, stall_rate=0.0)
        # The slot is given back when the scan on `a` ends: `b` admits the user again.
        assert await eventually(lambda: a.metric("ecoscan_scans_in_flight") == 0, attempts=500)
        for _ in range(50):
            retry = await run_scan(
                b.client, json={"image_url": data_url(make_jpeg(4))}, headers={"X-User-ID": "greedy"}
            )
            if retry.status == 200:
                break
        assert retry.terminal.event == "done"


@pytest.mark.timeout(120)
async def test_redis_away_never_stops_a_replica(
    database_url: str, sim: RunningSimulator, own_redis: RedisServer
) -> None:
    own_redis.stop()
    settings = settings_for(
        database_url, sim, redis_url=own_redis.url, redis_prefix="away", max_inflight_per_user=1
    )
    async with running_service(settings) as svc:
        outcome = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(5))})
        assert outcome.terminal.event == "done"
        model = settings.vision_model
        assert svc.metric("ecoscan_budget_shared", {"model": model}) == 0
        assert svc.metric("ecoscan_user_caps_redis_errors_total") >= 1
        own_redis.start()
        assert await eventually(
            lambda: svc.metric("ecoscan_budget_shared", {"model": model}) == 1, attempts=500, interval=0.02
        )
        outcome = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(6))})
        assert outcome.terminal.event == "done"


async def burst_admissions(
    replicas: list[ServiceProcess] | list[Service], user: str, per_replica: int
) -> list[int]:
    """Start `per_replica` scans for one user on each replica at once and return their
    statuses. Accepted scans are held open (the simulator stalls them) until every answer
    is in, so the number accepted is the number running at once."""
    all_answered = asyncio.Event()
    statuses: list[int] = []
    expected = len(replicas) * per_replica

    async def one(client: httpx.AsyncClient, seed: int) -> None:
        body = {"image_url": data_url(make_jpeg(seed))}
        async with client.stream("POST", SCAN_URL, json=body, headers={"X-User-ID": user}) as response:
            statuses.append(response.status_code)
            if len(statuses) == expected:
                all_answered.set()
            if response.status_code == 200:
                await all_answered.wait()

    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(BURST_TIMEOUT_S):
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=r.url, timeout=BURST_TIMEOUT_S))
            for r in replicas
        ]
        await asyncio.gather(
            *(one(client, 40 + 10 * n + i) for n, client in enumerate(clients) for i in range(per_replica))
        )
    return statuses


@pytest.mark.timeout(180)
async def test_the_per_user_cap_holds_right_after_redis_restarts(
    database_url: str, sim: RunningSimulator, own_redis: RedisServer, tmp_path: Path
) -> None:
    """A restart leaves every pooled connection dead: the first command on each must not
    send its replica to counting its own scans only (2 x the cap across two replicas)."""
    cap = 2
    env = service_env(
        database_url, sim, REDIS_URL=own_redis.url, REDIS_PREFIX="restart", MAX_INFLIGHT_PER_USER=str(cap)
    )
    async with (
        service_process(env, tmp_path / "a.log") as a,
        service_process(env, tmp_path / "b.log") as b,
    ):
        # Warm both replicas' pools with several connections (admissions, event mirroring).
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=BURST_TIMEOUT_S) as to_a,
            httpx.AsyncClient(base_url=b.url, timeout=BURST_TIMEOUT_S) as to_b,
        ):
            warm = [
                run_scan(
                    client, json={"image_url": data_url(make_jpeg(seed))}, headers={"X-User-ID": f"w{seed}"}
                )
                for seed, client in enumerate([to_a, to_b] * 3)
            ]
            assert [o.terminal.event for o in await asyncio.gather(*warm)] == ["done"] * 6
        await sim_configure(sim, stall_rate=1.0, stall_s=10.0)
        await asyncio.to_thread(own_redis.stop)
        await asyncio.to_thread(own_redis.start)
        statuses = await burst_admissions([a, b], "burst", per_replica=2 * cap)
        assert sorted(statuses) == [200] * cap + [429] * (3 * cap), statuses
