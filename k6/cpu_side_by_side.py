"""CPU per completed scan of two builds side by side, under one load at the same time.

On a shared machine the speed drifts between runs by more than a small change saves, so
runs one after the other compare badly. Here two service processes run at once, this
checkout's and another's (`--other DIR`: a `git worktree` of an older commit, say), on
one simulator, and one k6 closed loop sends each user's scans to them turn by turn: both
see the same load at the same moments, and the ratio of their CPU per scan is the figure
to read (the absolute values are those of half the load each).

    git worktree add /tmp/before <commit>
    .venv/bin/python k6/cpu_side_by_side.py --other /tmp/before --repeat 3
    .venv/bin/python k6/cpu_side_by_side.py --other . --other-app k6/lean_floor:app

Both run on this checkout's virtualenv: the other checkout's dependencies must be
installed in it too. The recipe is k6/cpu_per_scan.py's (tiny JSON uploads, ~2 s of upstream time per scan,
~60-token answers, no rate limits, reply caches off, stage gates for 200 users).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from cpu_per_scan import (
    ANSWER_TOKENS,
    CACHES_OFF,
    RECIPE_SETTINGS,
    SERVICE_RPM,
    SERVICE_TPM,
    SIM_TIME_SCALE,
)
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
from sweep.prometheus import Samples, Window, scrape
from sweep.sampler import Sampler

# Run as a script: k6/ is on sys.path, so are cpu_per_scan and the sweep package.
ROOT = Path(__file__).resolve().parent.parent

SETTINGS = {**RECIPE_SETTINGS, **CACHES_OFF, "OPENAI_RPM": SERVICE_RPM, "OPENAI_TPM": SERVICE_TPM}
# --defaults: only what the load needs (a budget that never binds, caches off, k6's users
# each under the per-user cap, and all of them, from one address, under the per-client cap
# on bodies being received: a wave of 3,000 uploads from 127.0.0.1 is not one client's
# flood); every limit at its default, sized by the process.
DEFAULTS = {
    **CACHES_OFF,
    "OPENAI_RPM": SERVICE_RPM,
    "OPENAI_TPM": SERVICE_TPM,
    "MAX_INFLIGHT_PER_USER": "100",
    "BODY_BUFFER_MAX_BYTES_PER_CLIENT": str(256 * 1024 * 1024),
}
START_TIMEOUT_S = 90.0
KEEP_ALIVE_S = 75  # uvicorn's --timeout-keep-alive in the Dockerfile and deploy/k8s
WARMUP = ("2", "5s")  # users, duration: the first scans' one-off costs stay out of the run


def service(
    name: str,
    checkout: Path,
    app: str,
    sim_port: int,
    database_url: str,
    logs: Path,
    procs: list[Proc],
    settings: dict[str, str] = SETTINGS,
    backlog: int | None = None,
) -> str:
    """Start `checkout`'s `app` (ready when this returns; in `procs` as soon as it runs);
    `backlog`: uvicorn's listen backlog, for thousands of users connecting at once."""
    app_dir, _, module = app.rpartition("/")
    port = free_port()
    # -P: not this checkout's working directory first on sys.path, but PYTHONPATH: each
    # service imports its own checkout's `app` package (--app-dir: an app in a folder).
    argv = [venv_python(), "-P", "-m", "uvicorn", module, "--http", "app.http.protocol:HttpToolsProtocol"]
    argv += ["--app-dir", str(checkout / app_dir), "--host", HOST, "--port", str(port), "--no-access-log"]
    # The image's idle timeout (Dockerfile), not uvicorn's 5 s: a k6 on this box, crowded by
    # the service it loads, can take longer than 5 s to send a user's next scan after the
    # last answer, and its Go client reuses a connection whose FIN it has not yet read: the
    # POST goes into a closed socket and k6 logs `write: broken pipe` for a request the
    # service never received (and does not retry a POST). Real clients behind the ingress
    # never meet that 5 s close; the bench should not either.
    argv += ["--timeout-keep-alive", str(KEEP_ALIVE_S)]
    argv += ["--backlog", str(backlog)] if backlog else []
    env = {
        **os.environ,
        "PYTHONPATH": str(checkout),
        "DATABASE_URL": database_url,
        "OPENAI_API_KEY": "sim",
        "OPENAI_BASE_URL": f"http://{HOST}:{sim_port}/v1",
        **settings,
    }
    procs.append(proc := start(name, argv, env, logs / f"{name}.log"))
    url = f"http://{HOST}:{port}"
    wait_ready(proc, url + "/readyz", START_TIMEOUT_S)
    return url


def seconds(duration: str) -> float:
    """k6's `40s`, `2m` or `1m30s` in seconds."""
    total, number = 0.0, ""
    for ch in duration:
        if ch.isdigit() or ch == ".":
            number += ch
        elif ch in "hms" and number:
            total += float(number) * {"h": 3600, "m": 60, "s": 1}[ch]
            number = ""
        else:
            raise argparse.ArgumentTypeError(f"not a k6 duration: {duration!r}")
    if number:
        raise argparse.ArgumentTypeError(f"not a k6 duration (a unit is missing): {duration!r}")
    return total


def completed(before: Samples, after: Samples) -> float | None:
    """Completed scans by the service's own count; None from one that keeps none (the lean
    floor): its share is what k6 saw complete less the other's."""
    if "ecoscan_scans_total" not in after:
        return None
    return Window(before, after).delta("ecoscan_scans_total", outcome="completed")


def one_run(args: argparse.Namespace, k6: str, logs: Path) -> dict[str, float]:
    sim_port = free_port()
    sim_argv = [venv_python(), "-m", "app.sim", "--host", HOST, "--port", str(sim_port)]
    sim_argv += ["--time-scale", args.sim_time_scale, "--rpm", "0", "--tpm", "0"]
    sim_argv += ["--latency-sigma", "0", "--text-tokens", ANSWER_TOKENS]
    procs: list[Proc] = []
    try:
        procs.append(sim := start("simulator", sim_argv, dict(os.environ), logs / "sim.log"))
        wait_ready(sim, f"http://{HOST}:{sim_port}/sim/stats", START_TIMEOUT_S)
        # One after the other: each runs the migrations at start-up.
        settings = DEFAULTS if args.defaults else SETTINGS
        settings = {**settings, **dict(pair.split("=", 1) for pair in args.this_env)}
        this_url = service(
            "this", args.this.resolve(), args.app, sim_port, args.database_url, logs, procs, settings
        )
        other_url = service(
            "other", args.other.resolve(), args.other_app, sim_port, args.database_url, logs, procs
        )
        this, other = procs[1], procs[2]
        env = {
            **os.environ,
            "BASE_URL": this_url,
            "BASE_URLS": f"{this_url},{other_url}",
            "FORM": "json",
            "IMAGE_SET": "tiny",
        }
        env["REQ_TIMEOUT"] = "180s"
        warm = {**env, "VUS": WARMUP[0], "DURATION": WARMUP[1]}
        run_k6(k6, "closed.js", warm, logs / "warmup.log", 120, extra=("--no-thresholds",))
        before = {url: scrape(url) for url in (this_url, other_url)}
        sampler = Sampler({"this": this.popen.pid, "other": other.popen.pid})
        sampler.start()
        try:
            measured = {
                **env,
                "VUS": str(args.vus),
                "DURATION": args.duration,
                "SUMMARY_JSON": str(logs / "k6.json"),
            }
            exit_code = run_k6(
                k6,
                "closed.js",
                measured,
                logs / "k6.log",
                seconds(args.duration) + K6_GRACE_S + 90,
                extra=("--no-thresholds",),
            )
        finally:
            resources = sampler.stop()
        if exit_code != 0:  # --no-thresholds: any exit but 0 is a failed run
            raise RuntimeError(f"k6 exited with {exit_code}; see {logs / 'k6.log'}")
        seen = json.loads((logs / "k6.json").read_text())["metrics"]["scan_completed"]["values"]["count"]
        counted = {
            name: completed(before[url], scrape(url))
            for name, url in (("this", this_url), ("other", other_url))
        }
        out = {}
        for name, other_name in (("this", "other"), ("other", "this")):
            scans = counted[name]
            if scans is None and counted[other_name] is not None:
                scans = seen - counted[other_name]
            out[name] = 1000 * resources[name]["cpu_s"] / scans if scans else float("nan")
            out[f"{name}_scans"] = scans or 0.0
        return out
    finally:
        for proc in reversed(procs):
            stop(proc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--other", type=Path, required=True, help="the other checkout (a git worktree)")
    p.add_argument(
        "--this", type=Path, default=ROOT, help="this checkout (default: the one this script is in)"
    )
    p.add_argument("--app", default="app.main:app", help="this checkout's ASGI app")
    p.add_argument(
        "--other-app", default="app.main:app", help="the other's (k6/lean_floor:app: the lean floor)"
    )
    p.add_argument(
        "--this-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for this side only (OTEL_*: traces on one side)",
    )
    p.add_argument("--vus", type=int, default=200, help="users in all, half on each")
    p.add_argument("--duration", default="40s", help="k6's duration (40s, 2m)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument(
        "--defaults",
        action="store_true",
        help="this checkout at its default limits (sized by itself) instead of the recipe's",
    )
    p.add_argument(
        "--sim-time-scale",
        default=SIM_TIME_SCALE,
        help="upstream time per scan: 0.215 is ~1.9 s (the recipe), 1.075 ~9.5 s",
    )
    p.add_argument("--out", type=Path, default=ROOT / "k6" / "results" / "cpu-side-by-side", help="logs")
    p.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
    )
    args = p.parse_args()
    seconds(args.duration)  # a bad duration fails here, not after start-up
    ensure_database(args.database_url)
    k6 = find_k6(None)
    ratios = []
    for run in range(args.repeat):
        r = one_run(args, k6, args.out / f"run-{run + 1}")
        ratios.append(r["this"] / r["other"])
        print(
            f"run {run + 1}: this {r['this']:.2f} ms per scan ({r['this_scans']:.0f} scans), "
            f"other {r['other']:.2f} ms ({r['other_scans']:.0f}), this/other {ratios[-1]:.3f}",
            flush=True,
        )
    if len(ratios) > 1:
        print(
            f"this/other: mean {sum(ratios) / len(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}"
        )
    print(json.dumps({"ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
