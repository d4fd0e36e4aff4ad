"""Prompt-cache affinity benchmark: the share of prompt tokens the providers' caches serve,
with and without UPSTREAM_CACHE_AFFINITY.

Two simulated OpenAI organisations in this process (each its own prompt cache, as OpenAI
keeps one per organisation; latencies scaled by --time-scale), the service (in this process
too, as the tests run it) routing over both, reply caches off, the default models and
detail. --photos photos are each scanned --repeats times with a new note each time (a
photo sent again: its prompt's first 1,024 tokens repeat), in a random order, by a closed
loop of --users. Each run reports, per stage and deployment, the prompt tokens and the
share of them cached, and the scans' p50 (client side).

    .venv/bin/python k6/affinity_bench.py --photos 60 --repeats 5 --users 20

Needs PostgreSQL (--database-url); a fresh database per run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from collections.abc import Awaitable
from typing import Any

from app.sim.config import SimConfig
from app.sim.server import run_simulator
from in_process import closed_loop, service_over
from tests.conftest import ScanOutcome, data_url, make_jpeg, run_scan

DEPLOYMENTS = ("org-a", "org-b")


async def one_run(args: argparse.Namespace, affinity: bool) -> dict[str, Any]:
    config = SimConfig(time_scale=args.time_scale, rpm=100_000, tpm=100_000_000)
    async with (
        run_simulator(config) as a,
        run_simulator(config) as b,
        service_over(
            args.database_url,
            "ecoscan_affinity_bench",
            dict(zip(DEPLOYMENTS, (a, b), strict=True)),
            upstream_cache_affinity=affinity,
        ) as svc,
    ):
        photos = [data_url(make_jpeg(seed)) for seed in range(args.photos)]
        queue = [(p, r) for p in range(args.photos) for r in range(args.repeats)]
        random.Random(args.seed).shuffle(queue)

        def scan(item: tuple[int, int]) -> Awaitable[ScanOutcome]:
            photo, repeat = item
            note = f"scan {repeat} of this photo: which bin?"
            return run_scan(svc.client, json={"image_url": photos[photo], "user_input": note})

        took, failed = await closed_loop(args.users, queue, scan)
        tokens = {
            (stage, upstream, kind): svc.metric(
                "ecoscan_upstream_prompt_tokens_total",
                {"upstream": upstream, "stage": stage, "kind": kind},
            )
            for stage in ("vision", "answer")
            for upstream in DEPLOYMENTS
            for kind in ("prompt", "cached")
        }
    return {
        "affinity": affinity,
        "scans": len(took),
        "failed": failed,
        "p50_s": round(statistics.median(took), 2),
        "cached_share": {
            stage: {
                "all": _share(tokens, stage, DEPLOYMENTS),
                **{u: _share(tokens, stage, (u,)) for u in DEPLOYMENTS},
            }
            for stage in ("vision", "answer")
        },
        "prompt_tokens": {
            stage: {u: int(tokens[(stage, u, "prompt")]) for u in DEPLOYMENTS}
            for stage in ("vision", "answer")
        },
    }


def _share(tokens: dict[tuple[str, str, str], float], stage: str, upstreams: tuple[str, ...]) -> float:
    prompt = sum(tokens[(stage, u, "prompt")] for u in upstreams)
    return round(sum(tokens[(stage, u, "cached")] for u in upstreams) / prompt, 3) if prompt else 0.0


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--photos", type=int, default=60)
    p.add_argument("--repeats", type=int, default=5, help="scans of each photo, each with a new note")
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--time-scale", type=float, default=0.05, help="the simulators' latency scale")
    p.add_argument("--seed", type=int, default=35, help="the scans' order")
    p.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = p.parse_args()
    for affinity in (False, True):
        print(json.dumps(await one_run(args, affinity)), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
