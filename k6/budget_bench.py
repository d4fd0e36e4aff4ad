"""Rate-budget benchmark: does ecoscan spend an OpenAI rate limit to the last request
without a 429 storm?

Starts the simulator (enforcing --sim-rpm/--sim-tpm at its default, production-like
latencies) and the service (budgeted for --service-rpm/--service-tpm) as fresh
processes on loopback ports, drives a closed k6 loop of --vus users for --duration,
polls the simulator's stats every 5 s, and reports per-window throughput from the
`scans` table, 429s seen by the simulator, and how every admitted scan ended.

    python k6/budget_bench.py --vus 200 --duration 240s --warmup 60             # Tier 1
    python k6/budget_bench.py --vus 200 --duration 240s --warmup 60 --sim-rpm 300  # lower tier
    python k6/budget_bench.py --vus 200 --duration 240s --warmup 60 --sim-shared-rpm 200  # shared key

Needs the machine's PostgreSQL (--database-url, default 127.0.0.1:5432); a fresh
database is created for each run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import make_images

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def wait_ready(url: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            get_json(url)
            return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {seconds}s")


def psql(dsn: str, sql: str) -> str:
    return subprocess.run(["psql", dsn, "-Atc", sql], check=True, capture_output=True, text=True).stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vus", type=int, default=200)
    p.add_argument("--duration", default="240s")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds excluded from the steady-state rate")
    p.add_argument("--sim-rpm", type=int, default=500)
    p.add_argument("--sim-tpm", type=int, default=500_000)
    p.add_argument(
        "--sim-shared-rpm", type=int, default=0, help="another user of the key takes this many requests/min"
    )
    p.add_argument("--service-rpm", type=int, default=500)
    p.add_argument("--service-tpm", type=int, default=500_000)
    p.add_argument("--image-set", choices=make_images.GROUPS, default="small")
    p.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--out", type=Path, default=ROOT / "k6" / "results" / "budget")
    p.add_argument("--set", action="append", default=[], help="extra service env KEY=VALUE")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    make_images.generate(sets=[args.image_set])

    db = f"ecoscan_budget_{os.getpid()}"
    psql(args.database_url, f'CREATE DATABASE "{db}"')
    dsn = args.database_url.rsplit("/", 1)[0] + "/" + db
    sim_port, svc_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    timeline: list[dict[str, Any]] = []
    stop = threading.Event()
    try:
        sim_cmd = [str(BIN / "python"), "-m", "app.sim", "--port", str(sim_port)]
        sim_cmd += ["--rpm", str(args.sim_rpm), "--tpm", str(args.sim_tpm)]
        sim_cmd += ["--shared-rpm", str(args.sim_shared_rpm)]
        procs.append(
            subprocess.Popen(sim_cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
        env = {
            **os.environ,
            "DATABASE_URL": dsn,
            "OPENAI_API_KEY": "bench",
            "OPENAI_BASE_URL": f"http://127.0.0.1:{sim_port}/v1",
            "OPENAI_RPM": str(args.service_rpm),
            "OPENAI_TPM": str(args.service_tpm),
            "LOG_LEVEL": "WARNING",
        }
        env.update(kv.split("=", 1) for kv in args.set)
        svc_log = open(args.out / "service.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                [str(BIN / "uvicorn"), "app.main:app", "--port", str(svc_port), "--no-access-log"],
                cwd=ROOT,
                env=env,
                stdout=svc_log,
                stderr=subprocess.STDOUT,
            )
        )
        wait_ready(f"http://127.0.0.1:{sim_port}/sim/stats")
        wait_ready(f"http://127.0.0.1:{svc_port}/readyz")

        def poll() -> None:
            t0 = time.monotonic()
            while not stop.wait(5.0):
                try:
                    stats = get_json(f"http://127.0.0.1:{sim_port}/sim/stats")
                except OSError:
                    continue
                timeline.append({"t": round(time.monotonic() - t0, 1), **stats})

        poller = threading.Thread(target=poll, daemon=True)
        started_at = time.time()
        poller.start()
        k6_env = {
            **os.environ,
            "BASE_URL": f"http://127.0.0.1:{svc_port}",
            "VUS": str(args.vus),
            "DURATION": args.duration,
            "IMAGE_SET": args.image_set,
            "SUMMARY_JSON": str(args.out / "k6-summary.json"),
        }
        seconds = float(args.duration.rstrip("s"))
        subprocess.run(
            [str(BIN / "k6"), "run", "--quiet", "--no-color", str(ROOT / "k6" / "closed.js")],
            env=k6_env,
            timeout=seconds + 180,
            stdout=open(args.out / "k6.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        ended_at = time.time()
        stop.set()
        poller.join()
        report(args, dsn, started_at, ended_at, timeline)
    finally:
        stop.set()
        for proc in reversed(procs):
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        psql(args.database_url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    return 0


def report(args: argparse.Namespace, dsn: str, t0: float, t1: float, timeline: list[dict[str, Any]]) -> None:
    steady_from = t0 + args.warmup
    window = t1 - steady_from
    completed = int(
        psql(
            dsn,
            "SELECT count(*) FROM scans WHERE status = 'completed' "
            f"AND finished_at >= to_timestamp({steady_from}) AND finished_at <= to_timestamp({t1})",
        )
    )
    outcomes = psql(
        dsn, "SELECT status, coalesce(error_code, ''), count(*) FROM scans GROUP BY 1, 2 ORDER BY 3 DESC"
    )
    per_30s = psql(
        dsn,
        "SELECT floor(extract(epoch FROM finished_at - to_timestamp("
        f"{t0})) / 30)::int AS w, count(*) FROM scans WHERE status = 'completed' GROUP BY 1 ORDER BY 1",
    )
    bound = min(args.sim_rpm - args.sim_shared_rpm, args.service_rpm) / 60 / 2
    rate = completed / window
    last = timeline[-1] if timeline else {}
    lines = [
        f"vus={args.vus} duration={args.duration} warmup={args.warmup}s sim_rpm={args.sim_rpm} "
        f"sim_tpm={args.sim_tpm} sim_shared_rpm={args.sim_shared_rpm} service_rpm={args.service_rpm}",
        f"steady state: {completed} completed in {window:.0f}s = {rate:.3f} scans/s "
        f"= {100 * rate / bound:.1f}% of the {bound:.3f} scans/s bound",
        f"simulator: requests {last.get('requests_total')}, 429s {last.get('rate_limited_total')}, "
        f"by_status {last.get('by_status')}",
        "429s by 5 s poll (t: cumulative): "
        + ", ".join(f"{p['t']:.0f}:{p['rate_limited_total']}" for p in timeline if p["rate_limited_total"]),
        "completed per 30 s window: " + " ".join(line.replace("|", ":") for line in per_30s.split()),
        "scan rows by outcome:",
        *("  " + line for line in outcomes.strip().splitlines()),
    ]
    text = "\n".join(lines)
    print(text)
    (args.out / "report.txt").write_text(text + "\n")
    (args.out / "timeline.json").write_text(json.dumps(timeline))


if __name__ == "__main__":
    sys.exit(main())
