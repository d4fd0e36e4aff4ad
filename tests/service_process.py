"""The service as operators run it: `uvicorn app.main:app` in a process of its own,
stopped with real signals. Its log goes to a file the test can read."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from app.sim.server import RunningSimulator

START_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 60.0


@dataclass
class ServiceProcess:
    url: str
    process: asyncio.subprocess.Process
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    async def exited(self, timeout_s: float = EXIT_TIMEOUT_S) -> int:
        async with asyncio.timeout(timeout_s):
            return await self.process.wait()


def service_env(database_url: str, sim: RunningSimulator, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIM_", "OPENAI_", "DATABASE_URL"))}
    env.update(
        DATABASE_URL=database_url,
        OPENAI_API_KEY="test-key",
        OPENAI_BASE_URL=sim.base_url,
        CPU_MAX_WORKERS="2",
        DB_POOL_MIN="1",
        DELTA_FLUSH_MS="0",
        LOG_LEVEL="INFO",
        PYTHONUNBUFFERED="1",
    )
    env.update(settings)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@asynccontextmanager
async def service_process(
    env: Mapping[str, str], log_path: Path, *, our_protocol: bool = True, access_log: bool = False
) -> AsyncIterator[ServiceProcess]:
    """Start `uvicorn app.main:app`, wait until it answers, and make sure it is gone after.
    `our_protocol=False`: the bare command, without `--http` (uvicorn's own httptools).
    `access_log`: uvicorn's access log on, as it is by default (and in the image)."""
    port = free_port()
    http = ["--http", "app.http.protocol:HttpToolsProtocol"] if our_protocol else []
    quiet = [] if access_log else ["--no-access-log"]
    with log_path.open("ab") as log_file:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "uvicorn",
            "app.main:app",
            *http,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *quiet,
            env=dict(env),
            stdout=log_file,
            stderr=log_file,
        )
    running = ServiceProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        await _wait_until_serving(running)
        yield running
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _wait_until_serving(running: ServiceProcess) -> None:
    async with (
        httpx.AsyncClient(base_url=running.url, timeout=2.0) as client,
        asyncio.timeout(START_TIMEOUT_S),
    ):
        while True:
            if running.process.returncode is not None:
                raise AssertionError(f"the service exited during start-up:\n{running.log}")
            try:
                if (await client.get("/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
