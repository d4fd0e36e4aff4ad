"""Negotiation in one flight, over real HTTP: a burst of scans at a deployment that refuses
a parameter costs one refused call, not one per call in flight."""

from __future__ import annotations

import asyncio

import pytest

from app.sim.config import SimConfig
from app.sim.server import RunningSimulator, run_simulator

from .conftest import data_url, make_jpeg, run_scan, sim_stats
from .test_routing import routed_service


async def test_a_burst_at_a_deployment_refusing_temperature_costs_one_refused_call(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An Azure deployment named as the operator chose: the service cannot tell its model
    # (a reasoning model, which refuses `temperature` other than 1) and sends the vision
    # stage's temperature 0; the answer's deployment takes what it is sent.
    azure = SimConfig(
        flavor="azure",
        time_scale=0.002,
        latency_sigma=0.0,
        text_tokens=40,
        reasoning_scale=0.0,
        deployments=("ecoscan-vision=gpt-5-mini", "ecoscan-answer=gpt-4o-mini"),
    )
    async with run_simulator(azure) as az:
        listed = [
            {
                "name": "azure",
                "provider": "azure",
                "base_url": f"{az.url}/openai/v1/",
                "api_key_env": "KEY_AZURE",
                "vision_model": "ecoscan-vision",
                "answer_model": "ecoscan-answer",
                "token_param": "max_completion_tokens",
                "rpm": 6000,
                "tpm": 10_000_000,
            }
        ]
        # A wait long enough never to run out on a loaded box: the test is about who goes.
        async with routed_service(database_url, sim, monkeypatch, listed, negotiation_wait_s=30.0) as svc:
            outcomes = await asyncio.gather(
                *(
                    run_scan(
                        svc.client,
                        json={"image_url": data_url(make_jpeg(seed))},
                        headers={"X-User-ID": f"u{seed}"},
                    )
                    for seed in range(20)
                )
            )
            stats = await sim_stats(az)
            negotiated = svc.metric(
                "ecoscan_upstream_negotiated_total", {"upstream": "azure", "parameter": "temperature"}
            )
    assert [o.terminal.event for o in outcomes] == ["done"] * 20, [o.terminal.data for o in outcomes]
    # One vision call was refused (temperature); no answer call was; all the rest went negotiated.
    assert stats["by_status"].get("400", 0) == 1, stats["by_status"]
    assert negotiated == 1
    assert stats["by_status"]["200"] == 40
