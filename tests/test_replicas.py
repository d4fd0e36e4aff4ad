"""Two service instances sharing one Redis (as two replicas would): the budget is
shared, per-user caps count both, and Redis going away never stops either."""

from __future__ import annotations

import pytest

from app.sim.server import RunningSimulator
from tests.conftest import (
    data_url,
    eventually,
    make_jpeg,
    run_scan,
    running_service,
    settings_for,
    sim_configure,
)
from tests.redis_server import RedisServer
from tests.test_lifecycle import stalled_scan


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
