"""The sweep's reports, rebuilt from the point files: runs.csv, points.csv, table.md
and the charts.

Rebuilt from what is on disk every time, so an interrupted or resumed sweep (or
``--report-only``) reports every run it has. runs.csv has a row per run; points.csv
and table.md a row per grid point, the median over its runs (rounds of ``--repeat``).
"""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path
from typing import Any

from .aggregate import AutoVsBest, Pivot, Row, auto_vs_best, pivots, points_of, run_row
from .charts import write_charts
from .grid import Point
from .k6_run import TIMED
from .prometheus import WAITS


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


def fmt_ms(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value / 1000:.2f}s"
    return f"{value:.0f}ms" if value >= 10 else f"{value:.1f}ms"


def fmt_rate(row: Row) -> str:
    """Median scans/s, with the runs' range when there is more than one."""
    rate = row.get("throughput")
    if rate is None:
        return "-"
    if row.get("runs", 1) > 1 and row.get("throughput_min") is not None:
        return f"{rate:.2f} ({row['throughput_min']:.2f}–{row['throughput_max']:.2f})"
    return f"{rate:.2f}"


def fmt_slots(row: Row, name: str, limit: str | None) -> str:
    """`avg / max` of a gauge over the run, `of N` for its limit (`of N–M`: its average
    and largest size, when an automatic limit moved)."""
    avg, top = row.get(f"slots_{name}_avg"), row.get(f"slots_{name}_max")
    if avg is None:
        return "-"
    text = f"{avg:.1f} / {top:.0f}"
    size, largest = (row.get(f"slots_{limit}_{stat}") for stat in ("avg", "max")) if limit else (None, None)
    if size is None or largest is None:
        return text
    return text + f" of {size:.0f}" + (f"–{largest:.0f}" if round(largest) != round(size) else "")


def triple(row: Row, prefix: str) -> str:
    return " / ".join(fmt_ms(row.get(f"{prefix}_{stat}_ms")) for stat in ("avg", "p95", "max"))


def timing_cells(level: Any, row: Row) -> list[str]:
    rate = row.get("failure_rate")
    fail = "-" if rate is None else f"{rate * 100:.1f}"
    cells = [str(level), *(triple(row, name) for name in (*TIMED, "total"))]
    cells += [fail, f"{row.get('rejected') or 0:.0f}", fmt_rate(row)]
    cpu_ms = row.get("cpu_ms_per_scan")
    cells += [f"{row.get('cpu_avg_pct') or 0:.0f}% / {row.get('cpu_max_pct') or 0:.0f}%"]
    cells += ["-" if cpu_ms is None else f"{cpu_ms:.2f}", f"{row.get('rss_max_mb') or 0:.0f} MB"]
    return cells


def wait_cells(level: Any, row: Row) -> list[str]:
    cells = [str(level), fmt_rate(row)]
    cells += [fmt_ms(row.get(f"wait_{name}_ms")) for name, _, _ in WAITS]
    cells += [str(row.get("binding") or "-")]
    cells += [fmt_slots(row, "inflight", "inflight_limit")]
    cells += [fmt_slots(row, "cpu_busy", "cpu_limit"), fmt_slots(row, "cpu_queued", "cpu_queue_limit")]
    cells += [fmt_slots(row, f"{stage}_gate", f"{stage}_gate_limit") for stage in ("vision", "answer")]
    cells += [fmt_slots(row, "budget_waiting", None)]
    return cells


WAIT_HEADER = [
    "scans/s",
    *(f"wait {name.replace('_', ' ')}" for name, _, _ in WAITS),
    "held by",
    "in flight",
    "CPU busy",
    "CPU queued",
    "vision gate",
    "answer gate",
    "budget queued",
]
TIMING_HEADER = [*TIMED, "total", "fail %", "rejected", "scans/s", "CPU avg / max", "CPU ms / scan"]
TIMING_HEADER.append("RSS max")


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def per_config(points: list[tuple[Point, Row]], header: list[str], cells: Any) -> list[str]:
    """One table per configuration, a row per load level."""
    lines: list[str] = []
    level_header = "rate/s" if points and points[0][0].level_name == "rate" else "VUs"
    for label, group in itertools.groupby(points, key=lambda pr: pr[0].label):
        rows = []
        for point, row in group:
            if row.get("error"):
                rows.append([str(point.level), f"error: {str(row['error'])[:80]}"])
            else:
                rows.append(cells(point.level, row))
        lines += ["", f"### {label}", "", *md_table([level_header, *header], rows)]
    return lines


def pivot_lines(pivot: Pivot) -> list[str]:
    best = pivot.best()
    rows = []
    for r in pivot.rows:
        cells = []
        for c in pivot.columns:
            row = pivot.cells.get((r, c))
            text = "-" if row is None else fmt_rate(row)
            cells.append(f"**{text}**" if (r, c) == best else text)
        rows.append([r, *cells])
    header = [f"max_workers ↓ {pivot.column_name} →", *pivot.columns]
    return ["", f"### {pivot.title}", "", *md_table(header, rows)]


def fmt_ratio(c: AutoVsBest) -> str:
    if c.ratio is None:
        return "-"
    return f"{c.ratio:.2f}×" + (" (the runs overlap)" if c.within_spread else "")


def auto_lines(comparisons: list[AutoVsBest]) -> list[str]:
    header = ["load", "best grid point", "scans/s", "auto point", "scans/s", "auto ÷ best"]
    rows = []
    for c in comparisons:
        rows.append(
            [c.group, c.best.label, fmt_rate(c.best_row), c.auto.label, fmt_rate(c.auto_row), fmt_ratio(c)]
        )
    return md_table(header, rows)


def summary_lines(comparisons: list[AutoVsBest]) -> list[str]:
    """What the console prints at the end: each auto point beside the best grid point."""
    out = []
    for c in comparisons:
        out.append(
            f"{c.group}: auto [{c.auto.label}] {fmt_rate(c.auto_row)} scans/s vs best grid point "
            f"[{c.best.label}] {fmt_rate(c.best_row)} = {fmt_ratio(c)}"
        )
    return out


def write_table(path: Path, points: list[tuple[Point, Row]], title: str) -> None:
    lines = [f"# {title}", ""]
    if points:
        fixed = points[0][0].fixed
        runs = max(row.get("runs", 0) + row.get("errors", 0) for _, row in points)
        lines.append(
            f"Scenario `{fixed.scenario}`, {fixed.duration} per point, form {fixed.form}, "
            f"{fixed.image_set} images, sim time scale {fixed.sim_time_scale}, "
            f"uvicorn workers {fixed.workers}; {runs} run(s) per point, the grid run whole each "
            "round. Figures are medians over a point's runs; scans/s shows (min–max). Waits: "
            "average per pass through each limit; slots: avg / max over the run, of the limit."
        )
    comparisons = auto_vs_best(points)
    if comparisons:
        lines += ["", "## `auto` against the best grid point", "", *auto_lines(comparisons)]
    tables = pivots(points)
    if tables:
        lines += ["", "## Scans/s by CPU lane width × gate size (median, best in bold)"]
        for pivot in tables:
            lines += pivot_lines(pivot)
    lines += ["", "## Where scans waited, and the slots in use"]
    lines += per_config(points, WAIT_HEADER, wait_cells)
    lines += ["", "## Timings (stage cells: avg / p95 / max of the `done` event's timings)"]
    lines += per_config(points, TIMING_HEADER, timing_cells)
    path.write_text("\n".join(lines) + "\n")


def write_csv(path: Path, rows: list[Row]) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def write_reports(out: Path, runs: list[Point]) -> None:
    done = []
    for run in runs:
        result = load_result(out / "points" / run.filename, run)
        if result is not None:
            done.append((run, run_row(run, result)))
    if not done:
        print("no results yet")
        return
    grid_order = {run.cell: i for i, run in enumerate(r for r in runs if r.repeat == 1)}
    points = sorted(points_of(done), key=lambda pr: grid_order[pr[0]])
    write_csv(out / "runs.csv", [row for _, row in done])
    write_csv(out / "points.csv", [row for _, row in points])
    write_table(out / "table.md", points, f"Sweep {out.name}")
    charts = write_charts(out, points, pivots(points))
    names = ", ".join(p.name for p in charts)
    print(f"wrote {out / 'points.csv'} ({len(points)} points, {len(done)} runs), {out / 'table.md'}, {names}")
    for line in summary_lines(auto_vs_best(points)):
        print(line)
