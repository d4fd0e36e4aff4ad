"""Per-user caps after a Redis fault (app/limits/shared_user_caps.py): scans that end while
Redis hangs cannot remove their slots then; when Redis comes back with its data (a pause,
or a restart that loads what it had written), those slots must go at once, not refuse
their user until they expire (`SLOT_TTL_S`), and the cap must still hold exactly."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from app.limits.shared_user_caps import SLOT_TTL_S
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
from tests.test_replicas import burst_admissions

CAP = 2
USER = "paused-user"
# Polls of the services' metrics: bounded well past what each step needs on a loaded
# machine (a removal fails within 2 x REDIS_TIMEOUT_S; a resend comes every RESEND_S of
# app/runtime/redis_fallback.py), and still short of SLOT_TTL_S, after which the slots
# would have expired on their own.
POLL_INTERVAL_S = 0.05
POLL_ATTEMPTS = int(SLOT_TTL_S / 3 / POLL_INTERVAL_S)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["paused", "restarted-with-its-data"])
async def test_a_user_is_admitted_at_once_when_redis_returns_with_the_slots_of_ended_scans(
    database_url: str, sim: RunningSimulator, fault: str
) -> None:
    server = RedisServer(persistent=fault != "paused")
    await asyncio.to_thread(server.start)
    try:
        settings = settings_for(
            database_url, sim, redis_url=server.url, redis_prefix=f"caps-{fault}", max_inflight_per_user=CAP
        )
        await sim_configure(sim, stall_rate=1.0, stall_s=30.0)
        async with running_service(settings) as a, running_service(settings) as b:
            async with contextlib.AsyncExitStack() as held:
                for seed in range(CAP):
                    await held.enter_async_context(stalled_scan(a, USER, seed=60 + seed))
                refused = await run_scan(
                    b.client, json={"image_url": data_url(make_jpeg(70))}, headers={"X-User-ID": USER}
                )
                assert (refused.status, refused.body["code"]) == (429, "USER_CONCURRENCY_LIMIT")
                server.freeze()
            # The clients left: `a` cancels both scans while Redis hangs, and their slots'
            # removal fails.
            assert await eventually(
                lambda: (
                    a.metric("ecoscan_scans_in_flight") == 0
                    and a.metric("ecoscan_user_caps_unreleased_slots") == CAP
                ),
                attempts=POLL_ATTEMPTS,
                interval=POLL_INTERVAL_S,
            )
            if fault == "paused":
                server.thaw()
            else:
                await asyncio.to_thread(server.kill)
                await asyncio.to_thread(server.start)
            assert await eventually(
                lambda: a.metric("ecoscan_user_caps_unreleased_slots") == 0,
                attempts=POLL_ATTEMPTS,
                interval=POLL_INTERVAL_S,
            )
            # The user has nothing running: admitted at once, on the other replica, up to
            # the cap and no further.
            statuses = await burst_admissions([b], USER, per_replica=CAP + 1)
            assert sorted(statuses) == [200] * CAP + [429], statuses
    finally:
        await asyncio.to_thread(server.close)
