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
import os
import random
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

DEPLOYMENTS = ("org-a", "org-b")


async def one_run(args: argparse.Namespace, affinity: bool) -> dict[str, Any]:
    name = f"ecoscan_affinity_bench_{secrets.token_hex(3)}"
    admin = await asyncpg.connect(args.database_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    config = SimConfig(time_scale=args.time_scale, rpm=100_000, tpm=100_000_000)
    try:
        async with run_simulator(config) as a, run_simulator(config) as b:
            listed = [
                {
                    "name": label,
                    "provider": "openai",
                    "base_url": s.base_url,
                    "api_key_env": "AFFINITY_BENCH_KEY",
                    "vision_model": "gpt-4o-mini",  # the defaults: a photo is 2,833 tokens at `low`
                    "answer_model": "gpt-4o-mini",
                    "rpm": 100_000,
                    "tpm": 100_000_000,
                }
                for label, s in zip(DEPLOYMENTS, (a, b), strict=True)
            ]
            settings = settings_for(
                args.database_url.rsplit("/", 1)[0] + "/" + name,
                a,
                openai_api_key=None,
                openai_base_url=None,
                upstreams=json.dumps(listed),
                vision_cache_entries=0,
                answer_cache_entries=0,
                max_inflight_per_user=1000,
                upstream_cache_affinity=affinity,
                log_level="ERROR",
            )
            async with running_service(settings) as svc:
                photos = [data_url(make_jpeg(seed)) for seed in range(args.photos)]
                queue = [(p, r) for p in range(args.photos) for r in range(args.repeats)]
                random.Random(args.seed).shuffle(queue)
                took: list[float] = []
                failed: dict[str, int] = {}

                async def user() -> None:
                    while queue:
                        photo, repeat = queue.pop()
                        note = f"scan {repeat} of this photo: which bin?"
                        started = time.monotonic()
                        outcome = await run_scan(
                            svc.client, json={"image_url": photos[photo], "user_input": note}
                        )
                        took.append(time.monotonic() - started)
                        if outcome.terminal.event != "done":
                            code = outcome.terminal.data.get("code", "?")
                            failed[code] = failed.get(code, 0) + 1

                await asyncio.gather(*(user() for _ in range(args.users)))
                tokens = {
                    (stage, upstream, kind): svc.metric(
                        "ecoscan_upstream_prompt_tokens_total",
                        {"upstream": upstream, "stage": stage, "kind": kind},
                    )
                    for stage in ("vision", "answer")
                    for upstream in DEPLOYMENTS
                    for kind in ("prompt", "cached")
                }
    finally:
        admin = await asyncpg.connect(args.database_url)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
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
    os.environ["AFFINITY_BENCH_KEY"] = "sk-bench"
    for affinity in (False, True):
        print(json.dumps(await one_run(args, affinity)), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
