"""One point of the sweep: fresh simulator and service, warm-up, measured k6 run, digest.

Fresh processes per point, so no point inherits another's pools, caches or budget.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .grid import Point, expected_run_s
from .k6_run import K6_GRACE_S, SCRIPTS, k6_digest, k6_env, run_k6
from .processes import HOST, Proc, free_port, http_get, http_post, start, stop, venv_python, wait_ready
from .prometheus import GaugeSampler, metrics_digest, scrape
from .sampler import Sampler


@dataclass(frozen=True)
class Context:
    """What every point of one sweep shares."""

    k6: str
    out: Path
    database_url: str
    start_timeout: float
    py_spy: str | None = None  # py-spy binary: profile the service during the measured run

    @property
    def logs(self) -> Path:
        return self.out / "logs"


PROFILER_WRITE_S = 60.0  # after the run, for py-spy to finish and write its file


@dataclass(frozen=True)
class Services:
    simulator: Proc
    service: Proc
    sim_url: str
    base_url: str


def sim_argv(point: Point, port: int) -> list[str]:
    fixed = point.fixed
    argv = [venv_python(), "-m", "app.sim", "--host", HOST, "--port", str(port)]
    argv += ["--time-scale", str(fixed.sim_time_scale)]
    argv += ["--rpm", str(fixed.sim_rpm), "--tpm", str(fixed.sim_tpm)]
    for key, value in fixed.sim_set:
        argv += ["--" + key.lower().replace("_", "-"), value]
    return argv


def service_env(point: Point, sim_port: int, database_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "DATABASE_URL": database_url,
            "OPENAI_API_KEY": "sim",
            "OPENAI_BASE_URL": f"http://{HOST}:{sim_port}/v1",
            "OPENAI_RPM": str(point.fixed.service_rpm),
            "OPENAI_TPM": str(point.fixed.service_tpm),
            **point.service_settings(),
        }
    )
    return env


def service_argv(point: Point, port: int) -> list[str]:
    # "k6/lean_floor:app": a module in a folder of the repo, imported from that folder.
    app_dir, _, app = point.fixed.app.rpartition("/")
    argv = [venv_python(), "-m", "uvicorn", app, "--http", "app.http.protocol:HttpToolsProtocol"]
    argv += ["--app-dir", app_dir] if app_dir else []
    argv += ["--host", HOST, "--port", str(port)]
    argv += ["--workers", str(point.fixed.workers)]
    if not point.fixed.access_log:
        argv.append("--no-access-log")
    return argv


@contextlib.contextmanager
def running_services(ctx: Context, point: Point) -> Iterator[Services]:
    """The simulator and the service on free loopback ports, both ready; stopped on exit."""
    sim = service = None
    try:
        sim_port, port = free_port(), free_port()
        sim = start(
            "simulator", sim_argv(point, sim_port), dict(os.environ), ctx.logs / f"{point.stem}.sim.log"
        )
        sim_url = f"http://{HOST}:{sim_port}"
        wait_ready(sim, sim_url + "/sim/stats", ctx.start_timeout)
        env = service_env(point, sim_port, ctx.database_url)
        service = start("service", service_argv(point, port), env, ctx.logs / f"{point.stem}.service.log")
        base_url = f"http://{HOST}:{port}"
        wait_ready(service, base_url + "/readyz", ctx.start_timeout)
        yield Services(sim, service, sim_url, base_url)
    finally:
        stop(service)
        stop(sim)


def warm_up(ctx: Context, point: Point, base_url: str) -> None:
    """A few seconds of light load first: the first scans pay one-off costs (imports,
    connection pools, caches) that would otherwise land in the measured run."""
    warmup_s = point.fixed.warmup_s
    if warmup_s <= 0:
        return
    arrival = point.fixed.scenario == "arrival"
    level, duration = (1 if arrival else 2), f"{warmup_s:g}s"
    env = k6_env(point, base_url, level, duration, None)
    env.update({"VUS": str(level), "RATE": str(level), "DURATION": duration})
    script = SCRIPTS["arrival" if arrival else "closed"]
    log = ctx.logs / f"{point.stem}.warmup.log"
    run_k6(ctx.k6, script, env, log, warmup_s + 60, extra=("--no-thresholds",))


@dataclass(frozen=True)
class Measured:
    exit_code: int  # k6's
    resources: dict[str, Any]  # CPU and RSS per process tree
    slots: dict[str, float | None]  # the limit gauges over the run


def measured_run(ctx: Context, point: Point, services: Services, summary: Path) -> Measured:
    """The point's k6 run with its processes and the service's limit gauges sampled."""
    env = k6_env(point, services.base_url, point.level, point.fixed.duration, summary)
    sampler = Sampler({"service": services.service.popen.pid, "simulator": services.simulator.popen.pid})
    sampler.start()
    gauges = GaugeSampler(services.base_url)
    gauges.start()
    profiler = start_profiler(ctx, point, services.service.popen.pid)
    try:
        timeout = expected_run_s(point) + K6_GRACE_S + 90
        log = ctx.logs / f"{point.stem}.k6.log"
        script = SCRIPTS[point.fixed.scenario]
        exit_code = run_k6(ctx.k6, script, env, log, timeout, on_start=lambda pid: sampler.add("k6", pid))
    finally:
        resources = sampler.stop()
        slots = gauges.stop()
        finish_profiler(profiler)
    return Measured(exit_code, resources, slots)


def finish_profiler(profiler: Proc | None) -> None:
    """py-spy writes its file when its --duration is over; stopped, it would write nothing."""
    if profiler is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            profiler.popen.wait(PROFILER_WRITE_S)
        stop(profiler)


def start_profiler(ctx: Context, point: Point, pid: int) -> Proc | None:
    """py-spy on the service's process tree for the measured run, sampling without pausing
    it (--nonblocking) and only threads holding the GIL, for as long as k6 loads: collapsed
    stacks in points/<stem>.py-spy.txt, which `python k6/profile_shares.py` reads."""
    if ctx.py_spy is None:
        return None
    argv = [ctx.py_spy, "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--gil"]
    argv += ["--duration", str(max(1, int(expected_run_s(point))))]
    argv += ["--rate", "200", "--format", "raw", "-o", str(ctx.out / "points" / f"{point.stem}.py-spy.txt")]
    return start("py-spy", argv, dict(os.environ), ctx.logs / f"{point.stem}.py-spy.log")


def run_point(ctx: Context, point: Point) -> dict[str, Any]:
    """Run `point` and return its result (what points/<stem>.json holds)."""
    started = time.time()
    with running_services(ctx, point) as services:
        warm_up(ctx, point, services.base_url)
        http_post(services.sim_url + "/sim/stats/reset")
        before = scrape(services.base_url)
        summary_path = ctx.out / "points" / f"{point.stem}.k6-summary.json"
        summary_path.unlink(missing_ok=True)
        measured = measured_run(ctx, point, services, summary_path)
        after = scrape(services.base_url)
        sim_stats = json.loads(http_get(services.sim_url + "/sim/stats")[1] or b"{}")
    if not summary_path.exists():
        raise RuntimeError(
            f"k6 exited with {measured.exit_code} and wrote no summary; see {point.stem}.k6.log"
        )
    summary = json.loads(summary_path.read_text())
    return {
        "config": point.config,
        "label": point.label,
        "k6_exit": measured.exit_code,  # 99 = a threshold was crossed
        "k6": k6_digest(summary),
        "resources": measured.resources,
        "metrics": metrics_digest(before, after),
        "slots": measured.slots,
        "sim": sim_stats,
        "elapsed_s": round(time.time() - started, 1),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
