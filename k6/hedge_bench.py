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
import statistics
from typing import Any

from app.sim.config import SimConfig
from app.sim.server import run_simulator
from in_process import closed_loop, service_over
from tests.conftest import data_url, make_jpeg, run_scan


async def one_run(args: argparse.Namespace, budget: float) -> dict[str, Any]:
    base = SimConfig(time_scale=args.time_scale, rpm=100_000, tpm=100_000_000)
    slow = SimConfig(**{**base.to_dict(), "hold_rate": args.hold_rate, "hold_s": 60.0})
    async with (
        run_simulator(base) as fast_sim,
        run_simulator(slow) as slow_sim,
        service_over(
            args.database_url,
            "ecoscan_hedge_bench",
            {"fast": fast_sim, "slow": slow_sim},
            hedge_budget=budget,
        ) as svc,
    ):
        took, failed = await closed_loop(
            args.users,
            list(range(args.scans)),
            lambda seed: run_scan(svc.client, json={"image_url": data_url(make_jpeg(seed))}),
        )
        hedges = {
            outcome: sum(
                svc.metric("ecoscan_upstream_hedges_total", {"stage": s, "outcome": outcome})
                for s in ("vision", "answer")
            )
            for outcome in ("sent", "won", "lost", "no_budget", "no_route")
        }
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
    for budget in (0.0, args.hedge_budget):
        print(json.dumps(await one_run(args, budget)), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
