"""What 1,000 scans cost, per documented model pair, with the reply caches off and on.

For each pair, on new processes (the simulator's prompt cache starts empty): the service
with the caches off runs k6/cache_economy.py's mix once; then a service with the caches on
runs it twice (cold, warm). A pass's cost is the sum of `scans.cost_usd` the service stored
for the scans it made (app/upstream/prices.py), per completed scan x 1,000; beside it, the
same pass priced from what the simulators say they served (`/sim/stats` tokens x the
default price), which must agree. A pair with a Gemini model gets a second simulator of
that flavour and two deployments (`UPSTREAMS`).

    .venv/bin/python k6/cost_bench.py
    .venv/bin/python k6/cost_bench.py --scans 50 --pairs gpt-4o-mini/gpt-4o-mini

Needs the machine's PostgreSQL (--database-url); a fresh database is created and dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

import cache_economy as ce
from app.upstream.prices import DEFAULT_PRICES, PRICES_READ
from budget_bench import free_port, psql

PAIRS = (
    "gpt-4o-mini/gpt-4o-mini",
    "gpt-4.1-mini/gpt-4.1-mini",
    "gpt-5-mini/gpt-5-mini",
    "gpt-5.1/gpt-5.1",
    "gpt-4o-mini/gemini-2.5-flash",
)


@dataclass(frozen=True)
class Pass:
    pair: str
    scenario: str
    done: int
    scans: int
    stored_usd: float
    unpriced: int
    sim_usd: float


def sim_usd(stats: dict[str, Any], model: str) -> float:
    tokens = stats["tokens"]
    usage = (tokens["prompt"], tokens["completion"], tokens["reasoning"], tokens["cached"])
    return DEFAULT_PRICES[model].cost(usage)


def stored(dsn: str, since: str) -> tuple[int, int, float, int]:
    """(scans, completed, USD, unpriced) of the rows created since `since`."""
    row = psql(
        dsn,
        "SELECT count(*), count(*) FILTER (WHERE status = 'completed'), coalesce(sum(cost_usd), 0),"
        f" count(*) FILTER (WHERE cost_usd IS NULL) FROM scans WHERE created_at > '{since}'",
    ).strip()
    scans, done, usd, unpriced = row.split("|")
    return int(scans), int(done), float(usd), int(unpriced)


def one_pass(
    pair: str, scenario: str, dsn: str, service_url: str, sims: dict[str, httpx.Client], work: ce.Workload
) -> Pass:
    for client in sims.values():
        client.post("/sim/stats/reset").raise_for_status()
    since = psql(dsn, "SELECT now()").strip()
    ce.measure(f"{pair} {scenario}", service_url, next(iter(sims.values())), work)
    time.sleep(0.5)  # the last terminal rows are written in a group commit
    scans, done, usd, unpriced = stored(dsn, since)
    priced = sum(sim_usd(ce.settled_sim_stats(client), model) for model, client in sims.items())
    return Pass(pair, scenario, done, scans, usd, unpriced, priced)


def pair_env(pair: str, ports: dict[str, int]) -> dict[str, str]:
    vision, answer = pair.split("/")
    if "gemini" not in answer:
        base = f"http://127.0.0.1:{ports[vision]}/v1"
        return {
            "OPENAI_API_KEY": "bench",
            "OPENAI_BASE_URL": base,
            "VISION_MODEL": vision,
            "ANSWER_MODEL": answer,
        }
    listed = [
        {"name": "openai", "provider": "openai", "base_url": f"http://127.0.0.1:{ports[vision]}/v1",
         "api_key_env": "BENCH_KEY", "vision_model": vision, "rpm": 1_000_000, "tpm": 1_000_000_000},
        {"name": "gemini", "provider": "gemini", "base_url": f"http://127.0.0.1:{ports[answer]}/v1beta/openai/",
         "api_key_env": "BENCH_KEY", "answer_model": answer, "rpm": 1_000_000, "tpm": 1_000_000_000},
    ]  # fmt: skip
    return {"UPSTREAMS": json.dumps(listed), "BENCH_KEY": "bench"}


@contextlib.contextmanager
def simulators(pair: str, args: argparse.Namespace, logs: Path) -> Iterator[dict[str, int]]:
    """One simulator per model of the pair (a Gemini model: that flavour), by model."""
    models = dict.fromkeys(pair.split("/"))
    with contextlib.ExitStack() as stack:
        ports = {}
        for model in models:
            port = ports[model] = free_port()
            command = [
                str(ce.BIN / "python"),
                "-m",
                "app.sim",
                "--port",
                str(port),
                "--rpm",
                "0",
                "--tpm",
                "0",
            ]
            command += ["--time-scale", str(args.sim_time_scale), "--latency-sigma", "0"]
            command += ["--flavor", "gemini" if model.startswith("gemini") else "openai"]
            ready = f"http://127.0.0.1:{port}/sim/stats"
            stack.enter_context(
                ce.running(command, ready, logs.with_suffix(f".{model}.sim.log"), dict(os.environ))
            )
        yield ports


def run_pair(pair: str, args: argparse.Namespace, dsn: str, work: ce.Workload) -> list[Pass]:
    passes = []
    for caches, scenarios in ((ce.CACHES_OFF, ["caches off"]), ({}, ["caches on, cold", "caches on, warm"])):
        logs = args.out / f"{pair.replace('/', '+')}-{scenarios[0].split(',')[0].replace(' ', '-')}"
        with simulators(pair, args, logs) as ports, contextlib.ExitStack() as stack:
            svc_port = free_port()
            env = {
                **os.environ,
                "DATABASE_URL": dsn,
                "OPENAI_RPM": "1000000",
                "OPENAI_TPM": "1000000000",
                "LOG_LEVEL": "WARNING",
                **pair_env(pair, ports),
                **caches,
            }
            stack.enter_context(ce.service(svc_port, env, logs.with_suffix(".service.log")))
            sims = {
                model: stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10))
                for model, port in ports.items()
            }
            url = f"http://127.0.0.1:{svc_port}"
            passes += [one_pass(pair, scenario, dsn, url, sims, work) for scenario in scenarios]
    return passes


def table(passes: list[Pass]) -> str:
    lines = [
        "| vision / answer model | scenario | scans completed | USD per 1,000 scans (stored) "
        "| USD per 1,000 (simulators' tokens x price) | unpriced scans |",
        "|---|---|---|---|---|---|",
    ]
    for p in passes:
        per_k = 1000 / max(1, p.done)
        failed = p.scans - p.done
        done = f"{p.done}" + (f" (+{failed} not completed)" if failed else "")
        cells = [p.pair.replace("/", " / "), p.scenario, done]
        cells += [f"{p.stored_usd * per_k:.4f}", f"{p.sim_usd * per_k:.4f}", str(p.unpriced)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default=",".join(PAIRS), help="vision/answer model pairs, comma-separated")
    ce.add_mix_arguments(p, ce.ROOT / "k6" / "results" / "cost")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    mix = ce.plan_mix(args.scans, args.repeat, args.question, args.seed)
    work = ce.Workload(mix, {scan.photo: ce.photo_url(scan.photo) for scan in mix}, args.concurrency)
    passes: list[Pass] = []
    with ce.fresh_database(args.database_url) as dsn:
        for pair in args.pairs.split(","):
            passes += run_pair(pair, args, dsn, work)
    when = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    print(f"command: python {shlex.join(sys.argv)} ({when}; prices read {PRICES_READ})")
    questions = sum(scan.question is not None for scan in mix)
    print(
        f"mix per pass: {len(mix)} scans, {len(work.photos)} distinct photos, {questions} with a question\n"
    )
    print(table(passes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
