"""uvicorn's access log as operators get it (`uvicorn app.main:app`, its default logging):
on in development (the built-in simulator) as in production, the simulator's own requests
kept out of it, and a scan's capability token (`?token=`) masked."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from app.sim.server import RunningSimulator

from .conftest import SCAN_URL, data_url, eventually, make_jpeg
from .service_process import service_env, service_process

SECRET = "s3cr3t-capability-token"


@pytest.mark.parametrize("upstream", ["built-in simulator", "configured"])
async def test_the_access_log_is_the_same_in_dev_and_prod_and_masks_scan_tokens(
    database_url: str, sim: RunningSimulator, tmp_path: Path, upstream: str
) -> None:
    env = service_env(database_url, sim)
    if upstream == "built-in simulator":
        del env["OPENAI_API_KEY"], env["OPENAI_BASE_URL"]
    job = uuid.uuid4()
    async with (
        service_process(env, tmp_path / "service.log", access_log=True) as svc,
        httpx.AsyncClient(base_url=svc.url, timeout=60) as client,
    ):
        scan = await client.post(SCAN_URL, json={"image_url": data_url(make_jpeg(71))})
        assert scan.status_code == 200 and "event: done" in scan.text
        by_query = await client.get(f"/api/v1/scan/{job}/events", params={"token": SECRET, "after": "0"})
        by_header = await client.get(f"/api/v1/scan/{job}", headers={"X-Scan-Token": SECRET})
        assert by_query.status_code == by_header.status_code == 404
        assert await eventually(lambda: f'"GET /api/v1/scan/{job} HTTP/1.1" 404' in svc.log, attempts=500)
    log = svc.log
    assert f'"POST {SCAN_URL} HTTP/1.1" 200' in log
    assert f'"GET /api/v1/scan/{job}/events?token=***&after=0 HTTP/1.1" 404' in log
    assert SECRET not in log
    # The simulator's requests (dev) are not the service's: they stay out of its access log.
    assert "/chat/completions" not in log
