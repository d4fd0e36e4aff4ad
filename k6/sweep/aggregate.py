"""From runs to points: one row per run, the median of a point's runs, the pivot of
scans/s by CPU lane width × gate size, and the `auto` points against the best grid point.

Pure functions over the point files' contents, so the reports (and the tests) can
rebuild them from disk at any time.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .grid import Point, config_label, short, sized_by_service
from .k6_run import TIMED
from .prometheus import SLOTS, WAITS

Row = dict[str, Any]
# Columns of /metrics deltas a row carries (result["metrics"]).
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
    *(f"wait_{name}_{stat}" for name, _, _ in WAITS for stat in ("ms", "p95_ms", "s")),
    "binding",
)
SLOT_COLUMNS = tuple(f"slots_{name}_{stat}" for name, _, _ in SLOTS for stat in ("avg", "max"))
# The pivot: CPU lane width down, stage gate sizes across.
PIVOT_ROWS = "CPU_MAX_WORKERS"
PIVOT_COLUMNS = ("VISION_CONCURRENCY", "ANSWER_CONCURRENCY")
UNSET = "default"  # an axis the grid does not vary: the service's default


def run_row(point: Point, result: dict[str, Any]) -> Row:
    """One run's figures, flat (a row of runs.csv)."""
    row: Row = {"config": point.label}
    row.update({short(k): v for k, v in point.settings})
    fixed = point.fixed
    row.update({"scenario": fixed.scenario, "form": fixed.form, "image_set": fixed.image_set})
    row[point.level_name] = point.level
    row["repeat"] = point.repeat
    row["error"] = str(result.get("error", "")).split("\n", 1)[0]
    k6 = result.get("k6", {})
    for key in ("completed", "failed", "rejected", "dropped"):
        row[key] = None if k6.get(key) is None else int(k6[key])
    for key in ("success_rate", "failure_rate", "throughput"):
        row[key] = k6.get(key)
    for key in ("ttfb_avg", "ttfb_p95", "total_avg", "total_p95", "total_max"):
        row[key + "_ms"] = k6.get(key)
    for stage in TIMED:
        for stat in ("avg", "p95", "max"):
            row[f"{stage}_{stat}_ms"] = k6.get(f"{stage}_{stat}")
    resources = result.get("resources", {})
    service = resources.get("service", {})
    completed, cpu_s = k6.get("completed"), service.get("cpu_s")
    row["cpu_ms_per_scan"] = cpu_s * 1000 / completed if cpu_s is not None and completed else None
    row["cpu_avg_pct"] = service.get("cpu_avg")
    row["cpu_max_pct"] = service.get("cpu_max")
    row["rss_max_mb"] = service.get("rss_max_mb")
    row["sim_cpu_avg_pct"] = resources.get("simulator", {}).get("cpu_avg")
    row["k6_cpu_avg_pct"] = resources.get("k6", {}).get("cpu_avg")
    metrics = result.get("metrics", {})
    row.update({key: metrics.get(key) for key in METRIC_COLUMNS})
    slots = result.get("slots", {})
    row.update({key: slots.get(key) for key in SLOT_COLUMNS})
    row["sim_429"] = result.get("sim", {}).get("rate_limited_total")
    row["thresholds_ok"] = k6.get("thresholds_ok")
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def median_row(runs: list[Row]) -> Row:
    """A point's row from its runs' (a row of points.csv): numbers are the median over
    the runs without an error; `throughput_min`/`_max`/`_spread_pct` say how far apart
    the runs were; `binding` is the limit most runs named."""
    good = [r for r in runs if not r.get("error")]
    out: Row = {}
    for key in dict.fromkeys(k for r in runs for k in r):
        values = [r.get(key) for r in good]
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if key in ("repeat", "error"):
            continue
        if numbers and len(numbers) == len([v for v in values if v is not None]):
            out[key] = round(statistics.median(numbers), 3)
        else:
            present = [v for v in values if v is not None] or [runs[0].get(key)]
            out[key] = Counter(present).most_common(1)[0][0]
    out["runs"] = len(good)
    out["errors"] = len(runs) - len(good)
    out["error"] = "" if good else runs[-1].get("error", "")
    rates = [r["throughput"] for r in good if r.get("throughput") is not None]
    out["throughput_min"] = min(rates) if rates else None
    out["throughput_max"] = max(rates) if rates else None
    median = statistics.median(rates) if rates else 0
    out["throughput_spread_pct"] = round((max(rates) - min(rates)) / median * 100, 1) if median else None
    return out


def points_of(runs: list[tuple[Point, Row]]) -> list[tuple[Point, Row]]:
    """The runs grouped by grid point (in the order the points first ran), each the median."""
    grouped: dict[Point, list[Row]] = {}
    for point, row in runs:
        grouped.setdefault(point.cell, []).append(row)
    return [(cell, median_row(rows)) for cell, rows in grouped.items()]


def varying_axes(points: list[tuple[Point, Row]]) -> set[str]:
    """The settings that take more than one value in the grid: the others (one `--set`
    value for every point) need not be named in a pivot's or comparison's title."""
    values: dict[str, set[str]] = {}
    for point, _ in points:
        for k, v in point.settings:
            values.setdefault(k, set()).add(v)
    return {k for k, vs in values.items() if len(vs) > 1}


def pivot_key(point: Point, names: tuple[str, ...]) -> str:
    settings = dict(point.settings)
    return "/".join(settings.get(n, UNSET) for n in names) if any(n in settings for n in names) else UNSET


@dataclass
class Pivot:
    """Scans/s at one load level (and one value of every other axis): CPU lane width down,
    gate sizes across; each cell a point's median row."""

    title: str
    rows: list[str]
    columns: list[str]
    cells: dict[tuple[str, str], Row]
    column_name: str

    def best(self) -> tuple[str, str] | None:
        done = {k: r for k, r in self.cells.items() if r.get("throughput") is not None}
        return max(done, key=lambda k: done[k]["throughput"]) if done else None


def pivots(points: list[tuple[Point, Row]]) -> list[Pivot]:
    """One pivot per load level and combination of the other axes; none when the grid
    varies neither the CPU lane nor a gate."""
    axes = {name for point, _ in points for name, _ in point.settings}
    gate_axes = tuple(n for n in PIVOT_COLUMNS if n in axes)
    if PIVOT_ROWS not in axes and not gate_axes:
        return []
    column_name = "/".join(short(n) for n in gate_axes) or "gates"
    varied = varying_axes(points)
    out: dict[tuple[Any, ...], Pivot] = {}
    for point, row in points:
        others = tuple(
            (k, v) for k, v in point.settings if k != PIVOT_ROWS and k not in gate_axes and k in varied
        )
        title = f"{point.level_name}={point.level}" + (f", {config_label(dict(others))}" if others else "")
        pivot = out.setdefault((point.level, others), Pivot(title, [], [], {}, column_name))
        r, c = pivot_key(point, (PIVOT_ROWS,)), pivot_key(point, gate_axes)
        pivot.rows += [] if r in pivot.rows else [r]
        pivot.columns += [] if c in pivot.columns else [c]
        pivot.cells[(r, c)] = row
    return list(out.values())


@dataclass(frozen=True)
class AutoVsBest:
    """An `auto` point beside the best grid point at its load level."""

    group: str  # the load level (and the axes neither point sets to auto)
    best: Point
    best_row: Row
    auto: Point
    auto_row: Row

    @property
    def ratio(self) -> float | None:
        best, auto = self.best_row.get("throughput"), self.auto_row.get("throughput")
        return auto / best if best and auto is not None else None

    @property
    def within_spread(self) -> bool:
        """Whether the two points' runs overlap (min–max): then the ratio is no verdict."""
        ranges = [(r.get("throughput_min"), r.get("throughput_max")) for r in (self.best_row, self.auto_row)]
        (best_lo, best_hi), (auto_lo, auto_hi) = ranges
        if best_lo is None or best_hi is None or auto_lo is None or auto_hi is None:
            return False
        return bool(auto_hi >= best_lo and best_hi >= auto_lo)


def auto_vs_best(points: list[tuple[Point, Row]]) -> list[AutoVsBest]:
    """Each point with an `auto` setting against the fastest point (median scans/s)
    without one at the same load level and values of the axes that have no `auto`."""
    auto_axes = {k for point, _ in points for k, v in point.settings if sized_by_service(v)}
    varied = varying_axes(points)
    groups: dict[tuple[Any, ...], list[tuple[Point, Row]]] = {}
    for point, row in points:
        fixed_axes = tuple((k, v) for k, v in point.settings if k not in auto_axes and k in varied)
        groups.setdefault((point.level, fixed_axes), []).append((point, row))
    out = []
    for (level, fixed_axes), members in groups.items():
        grid = [(p, r) for p, r in members if not p.is_auto and r.get("throughput") is not None]
        if not grid:
            continue
        best, best_row = max(grid, key=lambda pr: pr[1]["throughput"])
        group = f"{best.level_name}={level}" + (f", {config_label(dict(fixed_axes))}" if fixed_axes else "")
        out += [AutoVsBest(group, best, best_row, p, r) for p, r in members if p.is_auto]
    return out
