"""Upstream economy: OpenAI calls and tokens per scan with the reply caches off, cold and warm.

Starts the simulator (time-scaled, unlimited) and the service on loopback, sends a mix
of scans over HTTP and reads what each scenario cost as deltas of the simulator's
/sim/stats, plus the service's reply-cache lookups from /metrics:

1. caches off (VISION_CACHE_ENTRIES=0, ANSWER_CACHE_ENTRIES=0);
2. caches on, cold: the mix once on a fresh service;
3. caches on, warm: the same mix again on that service.

Scenario 1 and scenarios 2-3 each get a new simulator too, so OpenAI's prompt cache (which
the simulator models) starts empty as well. The mix: --scans scans of 640x480 photo-like
JPEGs (k6/make_images.py's generator, one seed per photo); a share (--repeat) re-sends a
photo sent earlier in the run, a share (--question) carries a `user_input` question,
both drawn independently per scan with a fixed --seed.

    .venv/bin/python k6/cache_economy.py
    .venv/bin/python k6/cache_economy.py --scans 50 --concurrency 4

Needs the machine's PostgreSQL (--database-url); a fresh database is created and dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import random
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import aconnect_sse

import make_images
from budget_bench import free_port, psql

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SCAN_PATH = "/api/v1/scan/classify/completion"
CACHES_OFF = {"VISION_CACHE_ENTRIES": "0", "ANSWER_CACHE_ENTRIES": "0"}
QUESTIONS = (
    "어떻게 버려요?",
    "이거 재활용 되나요?",
    "라벨은 떼야 하나요?",
    "씻어서 버려야 해요?",
    "일반쓰레기로 버려도 돼요?",
    "뚜껑은 따로 버리나요?",
    "How do I throw this away?",
    "Can this go in the recycling bin?",
)
SIM_COLUMNS = ("vision", "answer", "prompt", "completion", "cached", "charged")  # keys of Row.sim
CACHE_LINE = re.compile(r'^ecoscan_cache_requests_total\{cache="(\w+)",outcome="(\w+)"\} (\S+)$')


@dataclass(frozen=True)
class Scan:
    photo: int  # the photo's seed
    question: str | None


@dataclass(frozen=True)
class Workload:
    mix: list[Scan]
    photos: dict[int, str]  # seed -> data URL
    concurrency: int


@dataclass(frozen=True)
class Row:
    scenario: str
    outcomes: Counter[str]
    sim: dict[str, float]  # deltas of /sim/stats
    cache: dict[str, float]  # "vision hit" -> lookups


def plan_mix(scans: int, repeat: float, question: float, seed: int) -> list[Scan]:
    """Each scan a new photo or (with probability `repeat`) one sent earlier, and a
    question with probability `question`, drawn independently."""
    rng = random.Random(seed)
    sent: list[int] = []
    mix = []
    for _ in range(scans):
        photo = rng.choice(sent) if sent and rng.random() < repeat else len(sent)
        if photo == len(sent):
            sent.append(photo)
        mix.append(Scan(photo, rng.choice(QUESTIONS) if rng.random() < question else None))
    return mix


def photo_url(seed: int) -> str:
    variant = make_images.Variant(f"economy-{seed}", "economy", 640, 480, 5000 + seed)
    out = io.BytesIO()
    make_images.photo(variant).save(out, "JPEG", quality=make_images.QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


async def send_scan(client: httpx.AsyncClient, body: dict[str, str], user: str) -> str:
    """One scan read to its terminal event: "done", an error code, or the HTTP status."""
    headers = {"X-User-ID": user}
    async with aconnect_sse(client, "POST", SCAN_PATH, json=body, headers=headers) as source:
        if source.response.status_code != 200:
            await source.response.aread()
            return f"HTTP {source.response.status_code}"
        async for event in source.aiter_sse():
            if event.event == "done":
                return "done"
            if event.event == "error":
                return str(json.loads(event.data)["code"])
    return "no terminal event"


async def send_mix(base_url: str, work: Workload) -> Counter[str]:
    """The mix in order, `concurrency` scans at a time, each worker its own user."""
    queue: asyncio.Queue[Scan] = asyncio.Queue()
    for scan in work.mix:
        queue.put_nowait(scan)
    outcomes: Counter[str] = Counter()

    async def worker(client: httpx.AsyncClient, user: str) -> None:
        while not queue.empty():
            scan = queue.get_nowait()
            body = {"image_url": work.photos[scan.photo]}
            if scan.question:
                body["user_input"] = scan.question
            outcomes[await send_scan(client, body, user)] += 1

    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        await asyncio.gather(*(worker(client, f"economy-{i}") for i in range(work.concurrency)))
    return outcomes


def sim_totals(stats: dict[str, Any]) -> dict[str, float]:
    """The SIM_COLUMNS of one /sim/stats snapshot."""
    return {
        "vision": stats["by_kind"]["vision"],
        "answer": stats["by_kind"]["text"],
        **{kind: stats["tokens"][kind] for kind in ("prompt", "completion", "cached")},
        "charged": stats["tokens_charged_total"],
    }


def settled_sim_stats(client: httpx.Client, seconds: float = 10) -> dict[str, Any]:
    """/sim/stats once every stream it started has ended (their tokens are counted then)."""
    deadline = time.monotonic() + seconds
    while True:
        stats: dict[str, Any] = client.get("/sim/stats").json()
        ended = stats["streams_completed"] + stats["streams_cancelled"]
        if (stats["inflight"] == 0 and ended == stats["streams_started"]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def cache_lookups(service_url: str) -> dict[str, float]:
    lookups: dict[str, float] = {}
    for line in httpx.get(service_url + "/metrics", timeout=5).text.splitlines():
        if match := CACHE_LINE.match(line):
            lookups[f"{match[1]} {match[2]}"] = float(match[3])
    return lookups


def measure(scenario: str, service_url: str, sim: httpx.Client, work: Workload) -> Row:
    """One pass of the mix; what it cost upstream and the cache lookups it made."""
    sim.post("/sim/stats/reset").raise_for_status()
    before = cache_lookups(service_url)
    outcomes = asyncio.run(send_mix(service_url, work))
    after = cache_lookups(service_url)
    cache = {key: value - before.get(key, 0.0) for key, value in after.items()}
    row = Row(scenario, outcomes, sim_totals(settled_sim_stats(sim)), cache)
    print(f"{scenario}: {dict(outcomes)}", file=sys.stderr)
    return row


def wait_ready(url: str, proc: subprocess.Popen[bytes], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready (process exit code {proc.poll()})")


@contextlib.contextmanager
def running(command: list[str], ready_url: str, log: Path, env: dict[str, str]) -> Iterator[None]:
    """A subprocess for the block's duration: ready before it, stopped (bounded) after."""
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(ready_url, proc)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


@contextlib.contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    name = f"ecoscan_economy_{os.getpid()}"
    psql(server_url, f'CREATE DATABASE "{name}"')
    try:
        yield server_url.rsplit("/", 1)[0] + "/" + name
    finally:
        psql(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def simulator(port: int, args: argparse.Namespace, log: Path) -> contextlib.AbstractContextManager[None]:
    command = [str(BIN / "python"), "-m", "app.sim", "--port", str(port), "--rpm", "0", "--tpm", "0"]
    command += ["--time-scale", str(args.sim_time_scale), "--latency-sigma", "0"]
    return running(command, f"http://127.0.0.1:{port}/sim/stats", log, dict(os.environ))


def service(port: int, env: dict[str, str], log: Path) -> contextlib.AbstractContextManager[None]:
    command = [str(BIN / "uvicorn"), "app.main:app", "--port", str(port), "--no-access-log"]
    command += ["--http", "app.http.protocol:HttpToolsProtocol"]
    return running(command, f"http://127.0.0.1:{port}/readyz", log, env)


def on_fresh_processes(
    args: argparse.Namespace, dsn: str, work: Workload, extra_env: dict[str, str], scenarios: list[str]
) -> list[Row]:
    """The scenarios in turn on one new simulator (its prompt cache empty) and service."""
    sim_port, svc_port = free_port(), free_port()
    env = {
        **os.environ,
        "DATABASE_URL": dsn,
        "OPENAI_API_KEY": "bench",
        "OPENAI_BASE_URL": f"http://127.0.0.1:{sim_port}/v1",
        "OPENAI_RPM": "1000000",
        "OPENAI_TPM": "1000000000",
        "LOG_LEVEL": "WARNING",
        **extra_env,
    }
    logs = args.out / scenarios[0].split(",")[0].replace(" ", "-")
    with (
        simulator(sim_port, args, logs.with_suffix(".sim.log")),
        service(svc_port, env, logs.with_suffix(".service.log")),
        httpx.Client(base_url=f"http://127.0.0.1:{sim_port}", timeout=10) as sim,
    ):
        return [measure(scenario, f"http://127.0.0.1:{svc_port}", sim, work) for scenario in scenarios]


def per_scan(row: Row, key: str) -> str:
    value = row.sim[key] / max(1, row.outcomes["done"])
    return f"{value:,.2f}" if key in ("vision", "answer") else f"{value:,.0f}"


def lookups(row: Row, cache: str) -> str:
    return "/".join(
        f"{row.cache.get(f'{cache} {outcome}', 0):.0f}" for outcome in ("hit", "miss", "coalesced")
    )


def table(rows: list[Row]) -> str:
    lines = [
        "| scenario | scans | vision calls/scan | answer calls/scan | prompt tokens/scan "
        "| completion tokens/scan | cached prompt tokens/scan | tokens charged/scan "
        "| vision cache hit/miss/coalesced | answer cache hit/miss/coalesced |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        failed = sum(row.outcomes.values()) - row.outcomes["done"]
        scans = f"{row.outcomes['done']}" + (f" (+{failed} not done)" if failed else "")
        cells = [row.scenario, scans, *(per_scan(row, key) for key in SIM_COLUMNS)]
        cells += [lookups(row, "vision"), lookups(row, "answer")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_mix_arguments(p: argparse.ArgumentParser, out: Path) -> None:
    """The scan mix's options, shared with k6/cost_bench.py; `out` is where logs go."""
    p.add_argument("--scans", type=int, default=200, help="scans per pass")
    p.add_argument("--repeat", type=float, default=0.3, help="share of scans re-sending an earlier photo")
    p.add_argument("--question", type=float, default=0.5, help="share of scans with a user_input question")
    p.add_argument("--seed", type=int, default=14, help="the mix's RNG seed")
    p.add_argument("--concurrency", type=int, default=8, help="scans in flight (one user each)")
    p.add_argument("--sim-time-scale", type=float, default=0.05)
    p.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--out", type=Path, default=out, help="logs")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_mix_arguments(p, ROOT / "k6" / "results" / "cache-economy")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    mix = plan_mix(args.scans, args.repeat, args.question, args.seed)
    photos = {scan.photo: photo_url(scan.photo) for scan in mix}
    work = Workload(mix, photos, args.concurrency)
    with fresh_database(args.database_url) as dsn:
        rows = on_fresh_processes(args, dsn, work, CACHES_OFF, ["caches off"])
        rows += on_fresh_processes(args, dsn, work, {}, ["caches on, cold", "caches on, warm"])
    print(f"command: python {shlex.join(sys.argv)} ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)")
    questions = sum(scan.question is not None for scan in mix)
    print(f"mix per pass: {len(mix)} scans, {len(photos)} distinct photos, {questions} with a question\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
