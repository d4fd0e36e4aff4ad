"""What the in-process benches (k6/affinity_bench.py, k6/hedge_bench.py) share: a fresh
database per run, a service routing over simulated OpenAI deployments with reply caches
off, and a closed loop of users timing their scans."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.sim.server import RunningSimulator  # noqa: E402
from tests.conftest import ScanOutcome, Service, running_service, settings_for  # noqa: E402

KEY_ENV = "IN_PROCESS_BENCH_KEY"


@asynccontextmanager
async def service_over(
    database_url: str, prefix: str, deployments: dict[str, RunningSimulator], **settings: Any
) -> AsyncIterator[Service]:
    """The service, on a database of its own (dropped after), routing over `deployments`
    (name -> simulator, each an OpenAI organisation of its own), reply caches off."""
    name = f"{prefix}_{secrets.token_hex(3)}"
    admin = await asyncpg.connect(database_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    os.environ[KEY_ENV] = "sk-bench"
    listed = [
        {
            "name": label,
            "provider": "openai",
            "base_url": sim.base_url,
            "api_key_env": KEY_ENV,
            "vision_model": "gpt-4o-mini",  # the defaults: a photo is 2,833 tokens at `low`
            "answer_model": "gpt-4o-mini",
            "rpm": 100_000,
            "tpm": 100_000_000,
        }
        for label, sim in deployments.items()
    ]
    try:
        config = settings_for(
            database_url.rsplit("/", 1)[0] + "/" + name,
            next(iter(deployments.values())),
            openai_api_key=None,
            openai_base_url=None,
            upstreams=json.dumps(listed),
            vision_cache_entries=0,
            answer_cache_entries=0,
            max_inflight_per_user=1000,
            log_level="ERROR",
            **settings,
        )
        async with running_service(config) as svc:
            yield svc
    finally:
        admin = await asyncpg.connect(database_url)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def closed_loop(
    users: int, scans: list[Any], scan: Callable[[Any], Awaitable[ScanOutcome]]
) -> tuple[list[float], dict[str, int]]:
    """`users` scanning `scans` (taken from its end) back to back: each scan's time, sorted,
    and the codes of those that did not end in `done`."""
    took: list[float] = []
    failed: dict[str, int] = {}

    async def user() -> None:
        while scans:
            item = scans.pop()
            started = time.monotonic()
            outcome = await scan(item)
            took.append(time.monotonic() - started)
            if outcome.terminal.event != "done":
                code = outcome.terminal.data.get("code", "?")
                failed[code] = failed.get(code, 0) + 1

    await asyncio.gather(*(user() for _ in range(users)))
    return sorted(took), failed
