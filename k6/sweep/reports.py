"""The sweep's reports, rebuilt from the point files: points.csv, table.md and charts.

Rebuilt from what is on disk every time, so an interrupted or resumed sweep (or
``--report-only``) reports every point it has.
"""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .grid import Point, short
from .k6_run import TIMED

Rows = list[tuple[Point, dict[str, Any]]]
METRIC_COLUMNS = (
    "loop_lag_max_ms",
    "loop_lag_p99_ms",
    "loop_lag_gauge_max_ms",
    "vision_queue_avg_ms",
    "vision_service_avg_ms",
    "answer_queue_avg_ms",
    "answer_service_avg_ms",
    "cpu_queue_avg_ms",
    "upstream_429",
)


def load_result(path: Path, point: Point) -> dict[str, Any] | None:
    """The stored result of `point`, or None when absent or written for another config."""
    try:
        result: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return result if result.get("config") == json.loads(json.dumps(point.config)) else None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write through a temporary file: an interrupted sweep never leaves half a result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def csv_row(point: Point, result: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"config": point.label}
    row.update({short(k): v for k, v in point.settings})
    fixed = point.fixed
    row.update({"scenario": fixed.scenario, "form": fixed.form, "image_set": fixed.image_set})
    row[point.level_name] = point.level
    row["error"] = str(result.get("error", "")).split("\n", 1)[0]
    k6 = result.get("k6", {})
    for key in ("completed", "failed", "rejected", "dropped"):
        row[key] = None if k6.get(key) is None else int(k6[key])
    for key in ("success_rate", "throughput"):
        row[key] = k6.get(key)
    for key in ("ttfb_avg", "ttfb_p95", "total_avg", "total_p95", "total_max"):
        row[key + "_ms"] = k6.get(key)
    for stage in TIMED:
        for stat in ("avg", "p95", "max"):
            row[f"{stage}_{stat}_ms"] = k6.get(f"{stage}_{stat}")
    resources = result.get("resources", {})
    service = resources.get("service", {})
    completed = k6.get("completed")
    cpu_s = service.get("cpu_s")
    row["cpu_ms_per_scan"] = cpu_s * 1000 / completed if cpu_s is not None and completed else None
    row["cpu_avg_pct"] = service.get("cpu_avg")
    row["cpu_max_pct"] = service.get("cpu_max")
    row["rss_max_mb"] = service.get("rss_max_mb")
    row["sim_cpu_avg_pct"] = resources.get("simulator", {}).get("cpu_avg")
    row["k6_cpu_avg_pct"] = resources.get("k6", {}).get("cpu_avg")
    metrics = result.get("metrics", {})
    row.update({key: metrics.get(key) for key in METRIC_COLUMNS})
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


def table_cells(point: Point, result: dict[str, Any]) -> list[str]:
    k6, res = result["k6"], result["resources"]["service"]
    fail = "-" if k6["failure_rate"] is None else f"{k6['failure_rate'] * 100:.1f}"
    cells = [str(point.level)]
    cells += [triple(k6, name) for name in (*TIMED, "total")]
    cells += [fail, f"{k6['rejected']:.0f}", f"{k6['throughput']:.2f}"]
    per_scan = res.get("cpu_s", 0.0) * 1000 / k6["completed"] if k6.get("completed") else None
    cells += [f"{res['cpu_avg']:.0f}% / {res['cpu_max']:.0f}%"]
    cells += ["-" if per_scan is None else f"{per_scan:.2f}", f"{res['rss_max_mb']:.0f} MB"]
    return cells


def write_table(path: Path, rows: Rows, title: str) -> None:
    lines = [f"# {title}", ""]
    if rows:
        fixed = rows[0][0].fixed
        lines.append(
            f"Scenario `{fixed.scenario}`, {fixed.duration} per point, form {fixed.form}, "
            f"{fixed.image_set} images, sim time scale {fixed.sim_time_scale}, "
            f"uvicorn workers {fixed.workers}. Stage cells: avg / p95 / max (from the `done` "
            "event's timings); CPU is % of one core (service process tree)."
        )
    level_header = "rate/s" if rows and rows[0][0].level_name == "rate" else "VUs"
    header = [level_header, *TIMED, "total", "fail %", "rejected"]
    header += ["scans/s", "CPU avg / max", "CPU ms / scan", "RSS max"]
    for label, group in itertools.groupby(rows, key=lambda r: r[0].label):
        lines += ["", f"## {label}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for point, result in group:
            if "error" in result:
                lines.append(f"| {point.level} | error: {str(result['error']).splitlines()[0][:80]} |")
            else:
                lines.append("| " + " | ".join(table_cells(point, result)) + " |")
    path.write_text("\n".join(lines) + "\n")


CHARTS: tuple[tuple[str, str, Callable[[dict[str, Any]], float]], ...] = (
    ("throughput.png", "completed scans/s", lambda r: r["k6"]["throughput"]),
    ("latency_p95.png", "p95 total scan time (s)", lambda r: (r["k6"]["total_p95"] or 0) / 1000),
    ("cpu.png", "service CPU avg (% of one core)", lambda r: r["resources"]["service"]["cpu_avg"]),
)


def write_charts(out: Path, rows: Rows) -> list[Path]:
    """One line per configuration, load level on x; points that failed are left out."""
    import matplotlib  # only here: the import costs a second and the sweep may never chart

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [(p, r) for p, r in rows if "error" not in r]
    if not good:
        return []
    xlabel = "arrival rate (scans/s)" if good[0][0].level_name == "rate" else "VUs"
    for name, ylabel, value in CHARTS:
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
    return [out / name for name, _, _ in CHARTS]


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
