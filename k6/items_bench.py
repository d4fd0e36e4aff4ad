"""Tokens and CPU per scan for a photo of one item and a photo of three, side by side.

One service process (`uvicorn app.main:app`, reply caches off) against the simulator in
this process (time-scaled: the service's CPU is what is measured, not the wait), PostgreSQL
at DATABASE_URL (its database `items_bench`, created if missing). Each round runs
`--scans` scans, `--users` at a time, of one kind; the kinds alternate for `--rounds`
rounds so that a loaded box weighs on both alike. A scan of each kind sends its own
photo (no cache could serve it) and a note that makes the simulator see one item
("생수병") or three ("생수병, 라벨, 플라스틱 뚜껑": the bottle, its label, its cap).

Per kind: the service's user+system CPU (/proc) per completed scan, the prompt and
completion tokens the simulator billed per scan, and what its limiter charged (the TPM
budget's view), and the scans/s of the rounds.

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres .venv/bin/python k6/items_bench.py
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from PIL import Image

from app.sim.config import SimConfig
from app.sim.server import RunningSimulator, run_simulator

ROOT = Path(__file__).resolve().parent.parent
KINDS = {1: "생수병", 3: "생수병, 라벨, 플라스틱 뚜껑"}
SCAN_URL = "/api/v1/scan/classify/completion"
START_TIMEOUT_S = 60.0
TICKS = os.sysconf("SC_CLK_TCK")


def photo(seed: int) -> str:
    rng = random.Random(seed)
    img = Image.new("RGB", (320, 240), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(8):
        x, y = rng.randrange(300), rng.randrange(220)
        img.paste(tuple(rng.randrange(256) for _ in range(3)), (x, y, x + 20, y + 20))
    out = io.BytesIO()
    img.save(out, "JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


async def database(url: str) -> str:
    conn = await asyncpg.connect(url)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = 'items_bench'"):
            await conn.execute("CREATE DATABASE items_bench")
    finally:
        await conn.close()
    return url.rsplit("/", 1)[0] + "/items_bench"


async def stats(sim: RunningSimulator) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=sim.url) as client:
        found: dict[str, Any] = (await client.get("/sim/stats")).json()
        return found


async def one_scan(client: httpx.AsyncClient, seed: int, note: str, items: int) -> bool:
    body = {"image_url": photo(seed), "user_input": note}
    async with client.stream("POST", SCAN_URL, json=body, headers={"X-User-ID": f"bench-{seed % 50}"}) as r:
        text = (await r.aread()).decode()
    ok = "event: done" in text and f'"count":{items}' in text
    if not ok and os.environ.get("ITEMS_BENCH_DEBUG"):
        print(r.status_code, text[-600:], file=sys.stderr)
    return ok


async def round_of(url: str, kind: int, seeds: range, users: int) -> tuple[int, float]:
    queue = list(seeds)
    done = 0

    async def user(client: httpx.AsyncClient) -> None:
        nonlocal done
        while queue:
            seed = queue.pop()
            ok = await one_scan(client, seed, KINDS[kind], kind)  # (not `done += await`: lost updates)
            done += ok

    began = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await asyncio.gather(*(user(client) for _ in range(users)))
    return done, time.perf_counter() - began


async def main(args: argparse.Namespace) -> None:
    db = await database(os.environ["DATABASE_URL"])
    # No rate limits (0): the measure is CPU and tokens, not the budget.
    config = SimConfig(
        time_scale=args.time_scale, latency_sigma=0.0, text_tokens=200, api_key="bench-key", rpm=0, tpm=0
    )
    async with run_simulator(config) as sim:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SIM_", "OPENAI_"))}
        env.update(
            DATABASE_URL=db,
            OPENAI_API_KEY="bench-key",
            OPENAI_BASE_URL=sim.base_url,
            OPENAI_RPM="1000000",
            OPENAI_TPM="1000000000",
            VISION_CACHE_ENTRIES="0",
            ANSWER_CACHE_ENTRIES="0",
            MAX_INFLIGHT_PER_USER="100",
            LOG_LEVEL="WARNING",
        )
        service = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "uvicorn", "app.main:app", "--http", "app.http.protocol:HttpToolsProtocol",
            "--host", "127.0.0.1", "--port", str(port), "--no-access-log", env=env, cwd=ROOT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=url) as client, asyncio.timeout(START_TIMEOUT_S):
                while True:
                    try:
                        if (await client.get("/healthz")).status_code == 200:
                            break
                    except httpx.TransportError:
                        await asyncio.sleep(0.2)
            await round_of(url, 1, range(10**6, 10**6 + args.users), args.users)  # warm-up
            totals = {
                kind: {"scans": 0, "cpu": 0.0, "s": 0.0, "prompt": 0, "completion": 0, "charged": 0}
                for kind in KINDS
            }
            seed = 0
            for _ in range(args.rounds):
                for kind in KINDS:
                    before, cpu = await stats(sim), cpu_seconds(service.pid)
                    done, took = await round_of(url, kind, range(seed, seed + args.scans), args.users)
                    after = await stats(sim)
                    seed += args.scans
                    t = totals[kind]
                    t["scans"] += done
                    t["cpu"] += cpu_seconds(service.pid) - cpu
                    t["s"] += took
                    t["prompt"] += after["tokens"]["prompt"] - before["tokens"]["prompt"]
                    t["completion"] += after["tokens"]["completion"] - before["tokens"]["completion"]
                    t["charged"] += after["tokens_charged_total"] - before["tokens_charged_total"]
            for kind, t in totals.items():
                n = max(1, t["scans"])
                print(
                    json.dumps(
                        {
                            "items": kind,
                            "scans": t["scans"],
                            "cpu_ms_per_scan": round(t["cpu"] * 1000 / n, 2),
                            "prompt_tokens_per_scan": round(t["prompt"] / n, 1),
                            "completion_tokens_per_scan": round(t["completion"] / n, 1),
                            "charged_tokens_per_scan": round(t["charged"] / n, 1),
                            "scans_per_s": round(t["scans"] / t["s"], 1),
                        },
                        ensure_ascii=False,
                    )
                )
        finally:
            service.terminate()
            await service.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scans", type=int, default=150, help="scans per round and kind")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--users", type=int, default=20, help="scans at a time")
    parser.add_argument("--time-scale", type=float, default=0.05, help="the simulator's latencies x this")
    asyncio.run(main(parser.parse_args()))
