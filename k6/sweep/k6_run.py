"""Running one k6 script for a point, and the digest of its end-of-test summary."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.stages.order import stage_names

from .grid import Point
from .processes import K6_DIR, start, stop

SCRIPTS = {"closed": "closed.js", "arrival": "arrival.js", "scan": "scan.js"}
# The `done` event's timings a point keeps, besides the total: `prepare` (before any
# stage), then each stage's, in the product's order.
TIMED = ("prepare", *stage_names())
K6_GRACE_S = 30  # the scripts' default GRACEFUL: in-flight scans get this long at the end


def k6_env(
    point: Point, base_url: str, level: int | float, duration: str, summary: Path | None
) -> dict[str, str]:
    """The scripts' environment for this point at `level` (VUs or rate) for `duration`."""
    fixed = point.fixed
    env = dict(os.environ)
    env.update({"BASE_URL": base_url, "FORM": fixed.form, "IMAGE_SET": fixed.image_set})
    if fixed.scenario == "arrival":
        env.update({"RATE": str(level), "DURATION": duration})
    elif fixed.scenario == "scan":
        env.update({"VUS": str(level), "HOLD": duration})
    else:
        env.update({"VUS": str(level), "DURATION": duration})
    env.update(dict(fixed.k6_env))
    env.pop("SUMMARY_JSON", None)
    if summary is not None:
        env["SUMMARY_JSON"] = str(summary)
    return env


def stage_env() -> dict[str, str]:
    """`STAGE_NAMES` for k6/lib/scan.js, which makes a `stage_<name>_ms` trend of each. k6
    lets a script declare metrics only in its init context, which can make no request
    (and sees no stream yet), so the names come in with the environment."""
    return {"STAGE_NAMES": ",".join(stage_names())}


def run_k6(
    k6: str,
    script: str,
    env: dict[str, str],
    log_path: Path,
    timeout: float,
    *,
    extra: tuple[str, ...] = (),
    on_start: Callable[[int], None] | None = None,
) -> int:
    """Run `script` to its end (or `timeout`, then fail) and return k6's exit code;
    `on_start` gets k6's pid, e.g. to sample its CPU."""
    # --address "": no REST API server on :6565, so parallel k6 runs do not collide.
    argv = [k6, "run", "--quiet", "--no-color", "--address", "", *extra, str(K6_DIR / script)]
    proc = start("k6", argv, {**env, **stage_env()}, log_path)
    if on_start is not None:
        on_start(proc.popen.pid)
    try:
        return proc.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"k6 ran past its hard timeout of {timeout:.0f}s:\n{proc.tail()}") from None
    finally:
        stop(proc)


def k6_digest(summary: dict[str, Any]) -> dict[str, Any]:
    """The figures a point keeps from k6's raw summary (counts, rates, trend stats)."""
    metrics: dict[str, Any] = summary.get("metrics", {})

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
    trends += [(name, f"stage_{name}_ms") for name in TIMED]
    for prefix, name in trends:
        v = values(name)
        for stat, key in (("avg", "avg"), ("p95", "p(95)"), ("max", "max")):
            out[f"{prefix}_{stat}"] = v.get(key)
    return out
