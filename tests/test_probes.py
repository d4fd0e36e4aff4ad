"""Health from our own probes, over real HTTP: a deployment that comes back serves its
share again within 5 s however long it was down and however it failed, no user's scan is
its probe, and a short outage of the only deployment is ridden out by the scans in it."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from app.sim.server import RunningSimulator

from .conftest import Service, data_url, eventually, make_jpeg, run_scan
from .test_routing import deployment, routed_service, scans, simulators

# The probes' backoff reaches its cap (1, 2, then every 3 s) after three failed probes:
# from then on the outage is "long" to the breaker, whatever its length.
LONG = 3


async def switch(sim: RunningSimulator, outage: str) -> None:
    """The outage switch, on the control port (with `refuse` the API port is closed)."""
    async with httpx.AsyncClient(base_url=sim.control_url) as client:
        (await client.patch("/sim/config", json={"outage": outage})).raise_for_status()


def routed(svc: Service, name: str) -> float:
    return sum(
        svc.metric("ecoscan_upstream_routed_total", {"upstream": name, "stage": s})
        for s in ("vision", "answer")
    )


@pytest.mark.parametrize("outage", ["503", "refuse", "hang"])
async def test_a_deployment_back_from_a_long_outage_serves_its_share_within_5_s(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch, outage: str
) -> None:
    async with simulators(2) as (a, b):
        listed = [deployment("a", a), deployment("b", b)]
        # A hung reply is given up after 1 s (the probe's own wait is PROBE_TIMEOUT_S).
        async with routed_service(database_url, sim, monkeypatch, listed, openai_read_timeout_s=1.0) as svc:
            await switch(a, outage)
            during = await scans(svc, 6)
            assert svc.metric("ecoscan_upstream_state", {"upstream": "a"}) in (1, 2)  # open, or probing
            failed = {"upstream": "a", "outcome": "failed"}
            assert await eventually(
                lambda: svc.metric("ecoscan_upstream_probes_total", failed) >= LONG, attempts=3000
            )
            users_sent = routed(svc, "a")
            await scans(svc, 4)  # open: every scan goes to b, none is a's probe
            assert routed(svc, "a") == users_sent
            await switch(a, "none")
            back_at = time.monotonic()
            assert await eventually(
                lambda: svc.metric("ecoscan_upstream_state", {"upstream": "a"}) == 0, attempts=3000
            )
            took = time.monotonic() - back_at
            assert routed(svc, "a") == users_sent  # closed by the service's own probe
            after = await scans(svc, 8)
    assert [o.terminal.event for o in [*during, *after]] == ["done"] * 14
    assert took < 5.0, took
    assert "a" in {o.terminal.data["upstreams"]["vision"] for o in after}  # a serves again


@pytest.mark.parametrize("outage", ["503", "refuse"])
async def test_a_short_outage_of_the_only_deployment_fails_no_scan(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch, outage: str
) -> None:
    async with (
        simulators(1) as (a,),
        routed_service(database_url, sim, monkeypatch, [deployment("only", a)]) as svc,
    ):
        await switch(a, outage)
        body = {"image_url": data_url(make_jpeg(1))}
        in_flight = [
            asyncio.ensure_future(run_scan(svc.client, json={"image_url": data_url(make_jpeg(s))}))
            for s in range(8)
        ]
        failed = {"upstream": "only", "outcome": "failed"}
        assert await eventually(
            lambda: svc.metric("ecoscan_upstream_probes_total", failed) >= LONG, attempts=3000
        )
        started_during = asyncio.ensure_future(run_scan(svc.client, json=body))
        await asyncio.sleep(0.2)
        await switch(a, "none")
        outcomes = await asyncio.gather(*in_flight, started_during)
        returned = svc.metric("ecoscan_upstream_ride_outs_total", {"stage": "vision", "outcome": "returned"})
    assert [o.terminal.event for o in outcomes] == ["done"] * 9, [o.terminal.data for o in outcomes]
    assert returned >= 1  # they waited for the deployment's return
