"""Hedging benchmark: the scan-time tail with one slow deployment, with and without hedging.

Two simulated OpenAI organisations in this process (latencies scaled by --time-scale),
one of which holds --hold-rate of its replies 60 s before their first byte; the service
(in this process too, as the tests run it) routes over both, reply caches off. A closed
loop of --users runs --scans scans, once with HEDGE_BUDGET=0 (never hedge) and once with
--hedge-budget; each run reports the scans' time p50 / p99 / max (seconds, client side),
failures, and the hedges sent and won.

    .venv/bin/python k6/hedge_bench.py --scans 400 --users 20

Needs PostgreSQL (--database-url); a fresh database per run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.sim.config import SimConfig  # noqa: E402
from app.sim.server import run_simulator  # noqa: E402
from tests.conftest import data_url, make_jpeg, run_scan, running_service, settings_for  # noqa: E402


async def one_run(args: argparse.Namespace, budget: float) -> dict[str, Any]:
    name = f"ecoscan_hedge_bench_{secrets.token_hex(3)}"
    admin = await asyncpg.connect(args.database_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    base = SimConfig(time_scale=args.time_scale, rpm=100_000, tpm=100_000_000)
    slow = SimConfig(**{**base.to_dict(), "hold_rate": args.hold_rate, "hold_s": 60.0})
    try:
        async with run_simulator(base) as fast_sim, run_simulator(slow) as slow_sim:
            listed = [
                {
                    "name": label,
                    "provider": "openai",
                    "base_url": s.base_url,
                    "api_key_env": "HEDGE_BENCH_KEY",
                    "vision_model": "gpt-4o-mini",
                    "answer_model": "gpt-4o-mini",
                    "rpm": 100_000,
                    "tpm": 100_000_000,
                }
                for label, s in (("fast", fast_sim), ("slow", slow_sim))
            ]
            settings = settings_for(
                args.database_url.rsplit("/", 1)[0] + "/" + name,
                fast_sim,
                openai_api_key=None,
                openai_base_url=None,
                upstreams=json.dumps(listed),
                vision_cache_entries=0,
                answer_cache_entries=0,
                max_inflight_per_user=1000,
                hedge_budget=budget,
                log_level="ERROR",
            )
            async with running_service(settings) as svc:
                took: list[float] = []
                failed: dict[str, int] = {}
                queue = list(range(args.scans))

                async def user() -> None:
                    while queue:
                        seed = queue.pop()
                        started = time.monotonic()
                        outcome = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(seed))})
                        took.append(time.monotonic() - started)
                        if outcome.terminal.event != "done":
                            code = outcome.terminal.data.get("code", "?")
                            failed[code] = failed.get(code, 0) + 1

                await asyncio.gather(*(user() for _ in range(args.users)))
                hedges = {
                    outcome: sum(
                        svc.metric("ecoscan_upstream_hedges_total", {"stage": s, "outcome": outcome})
                        for s in ("vision", "answer")
                    )
                    for outcome in ("sent", "won", "lost", "no_budget", "no_route")
                }
    finally:
        admin = await asyncpg.connect(args.database_url)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    took.sort()
    return {
        "hedge_budget": budget,
        "scans": len(took),
        "p50_s": round(statistics.median(took), 2),
        "p99_s": round(took[int(0.99 * (len(took) - 1))], 2),
        "max_s": round(took[-1], 2),
        "failed": failed,
        "hedges": hedges,
    }


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scans", type=int, default=400)
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--time-scale", type=float, default=0.1, help="the simulators' latency scale")
    p.add_argument("--hold-rate", type=float, default=0.05, help="the slow deployment's held share")
    p.add_argument("--hedge-budget", type=float, default=0.05)
    p.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = p.parse_args()
    os.environ["HEDGE_BENCH_KEY"] = "sk-bench"
    for budget in (0.0, args.hedge_budget):
        print(json.dumps(await one_run(args, budget)), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
