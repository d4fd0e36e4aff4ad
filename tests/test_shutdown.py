"""Deploys, as they happen: a real `uvicorn app.main:app` process with scans in flight,
stopped with real signals (SIGTERM drains, SIGKILL loses the process), against the
real PostgreSQL."""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from app.sim.server import RunningSimulator

from .conftest import SCAN_URL, data_url, eventually, make_jpeg, run_scan, scan_row, sim_configure
from .service_process import ServiceProcess, service_env, service_process
from .streamed_scan import StreamedScan

# The simulator's latency per call is its median times this: ~0.9 s vision + ~1 s answer.
SCAN_OF_TWO_SECONDS = 0.2


async def start_scans(svc: ServiceProcess, count: int) -> list[StreamedScan]:
    scans = [StreamedScan(svc.url, seed, user=f"user-{seed}") for seed in range(100, 100 + count)]
    async with asyncio.timeout(30):
        await asyncio.gather(*(s.started.wait() for s in scans))
    return scans


async def refused_while_draining(svc: ServiceProcess) -> tuple[httpx.Response, httpx.Response]:
    """/readyz and a new scan, once the process has taken the signal."""
    async with httpx.AsyncClient(base_url=svc.url, timeout=10) as client:

        async def not_ready() -> bool:
            return (await client.get("/readyz")).status_code == 503

        assert await eventually(not_ready, attempts=100, interval=0.02)
        ready = await client.get("/readyz")
        scan = await client.post(SCAN_URL, json={"image_url": data_url(make_jpeg(1))})
        return ready, scan


def lost_counted(metrics: httpx.Response) -> float:
    """ecoscan_scans_lost_total in a /metrics answer."""
    (value,) = re.findall(r"(?m)^ecoscan_scans_lost_total (\S+)$", metrics.text)
    return float(value)


def swept_in_log(log: str) -> int:
    """Rows the process's sweeps marked PROCESS_LOST, as its log lines say."""
    return sum(int(n) for n in re.findall(r"sweep: (\d+) scans of dead processes marked PROCESS_LOST", log))


def assert_clean_log(log: str) -> None:
    assert "Traceback" not in log, log
    assert "ASGI callable returned without completing response" not in log, log


async def test_sigterm_drains_every_scan_in_flight_to_done(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection, tmp_path: Path
) -> None:
    await sim_configure(sim, time_scale=SCAN_OF_TWO_SECONDS)
    env = service_env(database_url, sim, SHUTDOWN_DRAIN_S="25")
    async with service_process(env, tmp_path / "service.log") as svc:
        scans = await start_scans(svc, 10)
        svc.signal(signal.SIGTERM)
        ready, refused = await refused_while_draining(svc)
        await asyncio.gather(*(s.task for s in scans))
        code = await svc.exited(timeout_s=20)

    assert ready.json()["checks"]["accepting"] == "no (shutting down)"
    assert refused.status_code == 503 and refused.json()["code"] == "SERVER_SHUTTING_DOWN"
    assert int(refused.headers["Retry-After"]) >= 1
    for scan in scans:
        assert [e.event for e in scan.terminals()] == ["done"], scan.events[-1]
        row = await scan_row(db, str(scan.job_id))
        assert row["status"] == "completed"
    assert code in (0, -signal.SIGTERM), svc.log
    assert "drained" in svc.log
    assert_clean_log(svc.log)


async def test_scans_longer_than_the_drain_end_with_server_shutdown(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection, tmp_path: Path
) -> None:
    await sim_configure(sim, time_scale=5.0)  # ~20 s per call: longer than the drain
    env = service_env(database_url, sim, SHUTDOWN_DRAIN_S="1")
    async with service_process(env, tmp_path / "service.log") as svc:
        scans = await start_scans(svc, 4)
        svc.signal(signal.SIGTERM)
        await asyncio.gather(*(s.task for s in scans))
        code = await svc.exited(timeout_s=20)

    assert code in (0, -signal.SIGTERM), svc.log
    for scan in scans:
        terminal = scan.terminals()
        assert len(terminal) == 1 and terminal[0].event == "error", scan.events
        data: dict[str, Any] = terminal[0].data
        assert data["code"] == "SERVER_SHUTDOWN" and data["retryable"] is True
        row = await scan_row(db, str(scan.job_id))
        assert (row["status"], row["error_code"]) == ("cancelled", "SERVER_SHUTDOWN")
        assert row["error_step"] == data["step"] == "vision"
    assert_clean_log(svc.log)


async def test_second_sigterm_ends_the_drain_at_once(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection, tmp_path: Path
) -> None:
    await sim_configure(sim, time_scale=5.0)
    env = service_env(database_url, sim, SHUTDOWN_DRAIN_S="120")
    async with service_process(env, tmp_path / "service.log") as svc:
        scans = await start_scans(svc, 2)
        svc.signal(signal.SIGTERM)
        await refused_while_draining(svc)
        svc.signal(signal.SIGTERM)
        await asyncio.gather(*(s.task for s in scans))
        await svc.exited(timeout_s=20)
    assert all(s.terminals()[0].data["code"] == "SERVER_SHUTDOWN" for s in scans)


async def test_an_idle_process_exits_on_sigterm_at_once(
    database_url: str, sim: RunningSimulator, tmp_path: Path
) -> None:
    env = service_env(database_url, sim)
    async with service_process(env, tmp_path / "service.log") as svc:
        async with httpx.AsyncClient(base_url=svc.url) as client:
            assert (
                await run_scan(client, json={"image_url": data_url(make_jpeg(3))})
            ).terminal.event == "done"
        svc.signal(signal.SIGTERM)
        code = await svc.exited(timeout_s=15)
    assert code in (0, -signal.SIGTERM), svc.log
    assert_clean_log(svc.log)


async def test_rows_of_a_killed_process_are_swept_as_process_lost_at_start_up(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection, tmp_path: Path
) -> None:
    await sim_configure(sim, time_scale=5.0)
    env = service_env(database_url, sim)
    async with service_process(env, tmp_path / "first.log") as first:
        scans = await start_scans(first, 3)
        first.signal(signal.SIGKILL)
        await first.exited()
        await asyncio.gather(*(s.task for s in scans), return_exceptions=True)
    ids = [s.job_id for s in scans]
    assert {r["status"] for r in await db.fetch("SELECT status FROM scans WHERE id = ANY($1)", ids)} == {
        "running"
    }

    async with service_process(env, tmp_path / "second.log") as second:

        async def swept() -> bool:
            rows = await db.fetch("SELECT status, error_code FROM scans WHERE id = ANY($1)", ids)
            return all((r["status"], r["error_code"]) == ("failed", "PROCESS_LOST") for r in rows)

        assert await eventually(swept, attempts=100, interval=0.1), second.log
        # Each row swept counts once in the sweeping process's ecoscan_scans_lost_total: these
        # three, and any other dead process's rows it found (the log says how many).
        async with httpx.AsyncClient(base_url=second.url, timeout=10) as client:

            async def counted() -> bool:
                return lost_counted(await client.get("/metrics")) == swept_in_log(second.log)

            assert await eventually(counted, attempts=50, interval=0.1), second.log
            assert lost_counted(await client.get("/metrics")) >= len(ids)
        # A live process's scans are never swept, by itself or by another process.
        live = await start_scans(second, 1)
        async with service_process(env, tmp_path / "third.log") as third:
            assert await eventually(lambda: "start-up sweep" in third.log, attempts=100, interval=0.1)
            row = await scan_row(db, str(live[0].job_id))
            assert row["status"] == "running"
        live[0].task.cancel()
        await asyncio.gather(live[0].task, return_exceptions=True)
