"""One process at its defaults under many users: what the self-sizing limits do at scale.

Starts the simulator (no rate limits; `--sim-time-scale` sets the upstream time per scan:
0.215 is ~1.9 s, 1.075 ~9.5 s, 3.17 ~28 s; `--latency-sigma` its spread) and one service
with nothing but the budget (never binding), the reply caches (off) and the per-user cap
(k6's users are distinct anyway) set, then a k6 closed loop of `--vus` users for
`--duration`. Prints completed
scans/s, failures by code, refusals, scans in flight, RSS per scan in flight, the event
loop's lag (p99 and max) and CPU ms per completed scan.

    .venv/bin/python k6/scale_bench.py --vus 3000 --duration 100s --sim-time-scale 3.17
    .venv/bin/python k6/scale_bench.py --vus 200 --sim-time-scale 0.215 --compare k6/lean_floor:app --repeat 2

`--compare` runs another app the same way, alternately with this one (`--repeat` times
each: this box drifts), and prints the ratios of completed scans/s and CPU per scan.

The simulator and k6 run at `--nice` 10: on a box of two cores they stand for the
machines a real load and a real provider would be on, and the service gets the CPU first.

`--set KEY=VALUE` passes more settings (e.g. `--set VISION_CONCURRENCY=64` for the old
fixed gates). The lean floor (`--app k6/lean_floor:app`) keeps no metrics: its figures
come from k6 alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path

from cpu_per_scan import ANSWER_TOKENS
from cpu_side_by_side import DEFAULTS, START_TIMEOUT_S, WARMUP, seconds, service
from sweep.k6_run import K6_GRACE_S, run_k6
from sweep.processes import (
    HOST,
    Proc,
    ensure_database,
    find_k6,
    free_port,
    start,
    stop,
    venv_python,
    wait_ready,
)
from sweep.prometheus import LOOP_LAG, Window, scrape, total
from sweep.sampler import Sampler

ROOT = Path(__file__).resolve().parent.parent
SCRAPE_EVERY_S = 1.0
# A neighbour on the box: busy its duty (argv[1]) of every 0.1 s, asleep the rest.
NEIGHBOUR = """
import sys, time
duty = float(sys.argv[1])
while True:
    end = time.perf_counter() + duty * 0.1
    while time.perf_counter() < end:
        pass
    time.sleep((1 - duty) * 0.1)
"""
AFTER_SCRAPE_TRIES = 6


class Watcher(threading.Thread):
    """Scrapes /metrics every second during the run: scans in flight and the limits."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.in_flight: list[float] = []
        self.limits: list[dict[str, float]] = []
        self.series: list[dict[str, float]] = []  # a row a second, written next to the report
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(SCRAPE_EVERY_S):
            samples = scrape(self.url)
            if samples:
                self.in_flight.append(total(samples, "ecoscan_admission_slots_in_use"))
                self.limits.append({lab["limit"]: v for lab, v in samples.get("ecoscan_limit", [])})
                self.series.append(
                    {
                        "t": time.monotonic(),
                        "in_flight": self.in_flight[-1],
                        "utilisation": total(samples, "ecoscan_loop_utilisation"),
                        "lag_max_s": total(samples, "ecoscan_event_loop_lag_max_seconds"),
                        "lags_over_250ms": total(samples, f"{LOOP_LAG}_count")
                        - total(samples, f"{LOOP_LAG}_bucket", le="0.25"),
                        "completed": total(samples, "ecoscan_scans_total", outcome="completed"),
                        "refused": total(samples, "ecoscan_scans_total", outcome="rejected"),
                        **self.limits[-1],
                    }
                )

    def stop(self) -> None:
        self._halt.set()
        self.join()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vus", type=int, default=200)
    p.add_argument("--duration", default="60s")
    p.add_argument("--sim-time-scale", default="0.215")
    p.add_argument(
        "--latency-sigma", default="0.25", help="the spread of call latencies (0: users march in step)"
    )
    p.add_argument("--app", default="app.main:app", help="the ASGI app (k6/lean_floor:app: the lean floor)")
    p.add_argument("--compare", help="another ASGI app run the same way, alternately (k6/lean_floor:app)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each app, interleaved")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another setting")
    p.add_argument(
        "--nice",
        type=int,
        default=10,
        help="niceness of the simulator and k6, which stand for other machines: the service "
        "measured gets the CPU first (0: they compete on equal terms)",
    )
    p.add_argument(
        "--neighbours",
        type=int,
        default=0,
        help="processes that burn CPU during the measured run, each --neighbour-duty of the time "
        "(not niced): the box a service shares with others, reproducibly",
    )
    p.add_argument("--neighbour-duty", type=float, default=0.6)
    p.add_argument("--out", type=Path, default=ROOT / "k6" / "results" / "scale-bench")
    p.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
    )
    args = p.parse_args()
    duration_s = seconds(args.duration)
    extra = dict(kv.split("=", 1) for kv in args.set)
    ensure_database(args.database_url)
    k6 = find_k6(None)
    apps = [args.app] + ([args.compare] if args.compare else [])
    results: dict[str, list[tuple[float, float]]] = {app: [] for app in apps}
    for run in range(args.repeat):
        for n, app in enumerate(apps):
            out = args.out / f"run-{run + 1}-{n + 1}"
            results[app].append(run_point(args, app, out, k6, duration_s, extra))
    if args.compare:
        for run in range(args.repeat):
            (mine, my_cpu), (theirs, their_cpu) = results[args.app][run], results[args.compare][run]
            print(
                f"run {run + 1}: scans/s {mine:.2f} vs {theirs:.2f} ({mine / theirs:.3f}); "
                f"CPU ms per scan {my_cpu:.2f} vs {their_cpu:.2f} ({my_cpu / their_cpu:.3f})"
            )
    return 0


def run_point(
    args: argparse.Namespace, app: str, out: Path, k6: str, duration_s: float, extra: dict[str, str]
) -> tuple[float, float]:
    """One run of `app`: (completed scans/s, CPU ms per completed scan)."""
    out.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        sim_port = free_port()
        sim_argv = [venv_python(), "-m", "app.sim", "--host", HOST, "--port", str(sim_port)]
        sim_argv += ["--time-scale", args.sim_time_scale, "--rpm", "0", "--tpm", "0"]
        sim_argv += ["--latency-sigma", args.latency_sigma, "--text-tokens", ANSWER_TOKENS]
        procs.append(sim := start("simulator", sim_argv, dict(os.environ), out / "sim.log"))
        os.setpriority(os.PRIO_PROCESS, sim.popen.pid, args.nice)
        wait_ready(sim, f"http://{HOST}:{sim_port}/sim/stats", START_TIMEOUT_S)
        url = service(
            "service", ROOT, app, sim_port, args.database_url, out, procs, {**DEFAULTS, **extra}, backlog=4096
        )
        service_proc = procs[-1]
        k6_env = {**os.environ, "BASE_URL": url, "FORM": "json", "IMAGE_SET": "tiny", "REQ_TIMEOUT": "180s"}
        warm = {**k6_env, "VUS": WARMUP[0], "DURATION": WARMUP[1]}
        run_k6(k6, "closed.js", warm, out / "warmup.log", 120, extra=("--no-thresholds",))
        before = scrape(url)
        rss_idle_mb = total(before, "process_resident_memory_bytes") / 2**20
        sampler = Sampler({"service": service_proc.popen.pid})
        watcher = Watcher(url)
        sampler.start()
        watcher.start()
        neighbours = [
            subprocess.Popen([venv_python(), "-c", NEIGHBOUR, str(args.neighbour_duty)])
            for _ in range(args.neighbours)
        ]
        try:
            measured = {**k6_env, "VUS": str(args.vus), "DURATION": args.duration}
            measured["SUMMARY_JSON"] = str(out / "k6.json")
            measured["GRACEFUL"] = "0s"  # the run's window is the duration: scans cut at its end are k6's
            code = run_k6(
                k6,
                "closed.js",
                measured,
                out / "k6.log",
                duration_s + K6_GRACE_S + 120,
                extra=("--no-thresholds",),
                on_start=lambda pid: os.setpriority(os.PRIO_PROCESS, pid, args.nice),
            )
        finally:
            for neighbour in neighbours:
                neighbour.kill()
                neighbour.wait()
            watcher.stop()
            used = sampler.stop()
        after = {}
        for _ in range(AFTER_SCRAPE_TRIES):  # k6 just cut every scan in flight: the loop is busy
            if after := scrape(url):
                break
        if code != 0:
            raise SystemExit(f"k6 exited with {code}; see {out / 'k6.log'}")
        k6_metrics = json.loads((out / "k6.json").read_text())["metrics"]
        return report(
            args, app, out, before, after, watcher, k6_metrics, duration_s, rss_idle_mb, sampler, used
        )
    finally:
        for proc in reversed(procs):
            stop(proc)


def report(  # type: ignore[no-untyped-def]
    args, app, out, before, after, watcher, k6_metrics, duration_s, rss_idle_mb, sampler, used
) -> tuple[float, float]:
    used = used["service"]
    window = Window(before, after)
    k6_done = k6_metrics.get("scan_completed", {}).get("values", {}).get("count", 0)
    # Answers that were neither a stream nor a refusal, or none at all (a reset, a broken
    # pipe: the service counts none of those).
    k6_lost = k6_metrics.get("scan_http_errors", {}).get("values", {}).get("count", 0)
    if after:
        completed = window.delta("ecoscan_scans_total", outcome="completed")
        failed = {
            lab["code"]: v - total(before, "ecoscan_scans_total", outcome="failed", code=lab["code"])
            for lab, v in after.get("ecoscan_scans_total", [])
            if lab.get("outcome") == "failed"
        }
        rejected = {
            lab["code"]: v - total(before, "ecoscan_scans_total", outcome="rejected", code=lab["code"])
            for lab, v in after.get("ecoscan_scans_total", [])
            if lab.get("outcome") == "rejected"
        }
    else:
        completed, failed, rejected = k6_done, {}, {}
    failures = {code: n for code, n in failed.items() if n > 0}
    rss = [mb for _, mb in sampler.samples["service"]]
    in_flight = watcher.in_flight
    lines = [
        f"app {app}, {args.vus} users, {args.duration}, sim time scale {args.sim_time_scale}, "
        f"{args.neighbours} neighbours at {args.neighbour_duty}",
        f"completed scans/s: {completed / duration_s:.2f} ({completed:.0f} scans; k6 saw {k6_done:.0f})",
        f"failed: {sum(failures.values()):.0f} {failures}",
        f"refused: {sum(rejected.values()):.0f} { {code: n for code, n in rejected.items() if n > 0} }",
        f"k6 HTTP errors (no answer, or not a refusal): {k6_lost:.0f}",
        f"CPU per completed scan: {1000 * used['cpu_s'] / completed:.2f} ms" if completed else "CPU: n/a",
    ]
    if in_flight:
        peak = max(in_flight)
        lines.append(f"scans in flight: peak {peak:.0f}, median {statistics.median(in_flight):.0f}")
    if rss:
        lines.append(f"RSS: {rss_idle_mb:.0f} MB before the run, max {max(rss):.0f} MB during it")
        if in_flight and max(in_flight) > 0:
            per_scan_kb = 1024 * (max(rss) - rss_idle_mb) / max(in_flight)
            lines.append(f"RSS per scan in flight: {per_scan_kb:.1f} KB")
    if after:
        lines.append(
            f"loop lag p99 <= {window.quantile_bound_ms(LOOP_LAG, 0.99)} ms, "
            f"max {1000 * total(after, 'ecoscan_event_loop_lag_max_seconds'):.0f} ms (since start)"
        )
        for gen in ("0", "1", "2"):
            count = window.delta("ecoscan_gc_pause_seconds_count", generation=gen)
            mean = window.avg_ms("ecoscan_gc_pause_seconds", generation=gen)
            p99 = window.quantile_bound_ms("ecoscan_gc_pause_seconds", 0.99, generation=gen)
            lines.append(
                f"gc generation {gen}: {count:.0f} collections, mean pause {mean} ms, p99 <= {p99} ms"
            )
    if watcher.limits:
        last = watcher.limits[-1]
        peak = {k: max(lim.get(k, 0) for lim in watcher.limits) for k in last}
        lines.append(f"limits at the end: {last}; peak: {peak}")
    with (out / "series.jsonl").open("w") as series:
        series.writelines(json.dumps(row) + "\n" for row in watcher.series)
    text = "\n".join(lines)
    print(text)
    (out / "report.txt").write_text(text + "\n")
    return completed / duration_s, (1000 * used["cpu_s"] / completed if completed else float("nan"))


if __name__ == "__main__":
    raise SystemExit(main())
