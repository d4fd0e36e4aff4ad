"""The sweep's charts: a line per configuration over the load levels, and the heat map
of scans/s by CPU lane width × gate size. Points are medians over their runs; points
that failed are left out."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .aggregate import Pivot, Row
from .grid import Point

CHARTS: tuple[tuple[str, str, Callable[[Row], float]], ...] = (
    ("throughput.png", "completed scans/s", lambda r: r["throughput"]),
    ("latency_p95.png", "p95 total scan time (s)", lambda r: (r.get("total_p95_ms") or 0) / 1000),
    ("cpu.png", "service CPU avg (% of one core)", lambda r: r.get("cpu_avg_pct") or 0),
)
HEATMAP = "heatmap.png"
HEATMAPS_PER_ROW = 3
DARK_TEXT_ABOVE = 0.6  # share of the colour scale from which viridis is light


def write_charts(out: Path, points: list[tuple[Point, Row]], tables: list[Pivot]) -> list[Path]:
    import matplotlib  # only here: the import costs a second and the sweep may never chart

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [(p, r) for p, r in points if not r.get("error") and r.get("throughput") is not None]
    if not good:
        return []
    xlabel = "arrival rate (scans/s)" if good[0][0].level_name == "rate" else "VUs"
    for name, ylabel, value in CHARTS:
        fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
        for label, group in itertools.groupby(good, key=lambda pr: pr[0].label):
            pts = sorted(group, key=lambda pr: pr[0].level)
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
    written = [out / name for name, _, _ in CHARTS]
    if tables and write_heatmap(out / HEATMAP, tables, plt):
        written.append(out / HEATMAP)
    return written


def write_heatmap(path: Path, tables: list[Pivot], plt: Any) -> bool:
    """One panel per pivot (load level), on one colour scale so the panels compare."""
    rates = [r["throughput"] for t in tables for r in t.cells.values() if r.get("throughput") is not None]
    if not rates:
        return False
    cols = min(len(tables), HEATMAPS_PER_ROW)
    nrows = math.ceil(len(tables) / cols)
    size = (4.2 * cols + 1, 3.6 * nrows)
    fig, axes = plt.subplots(nrows, cols, figsize=size, dpi=110, squeeze=False, layout="constrained")
    image = None
    for index, (ax, table) in enumerate(itertools.zip_longest(axes.flat, tables)):
        if table is None:
            ax.axis("off")
            continue
        grid = [[cell_rate(table, r, c) for c in table.columns] for r in table.rows]
        image = ax.imshow(grid, cmap="viridis", vmin=0, vmax=max(rates), aspect="auto")
        ax.set_xticks(range(len(table.columns)), table.columns)
        ax.set_yticks(range(len(table.rows)), table.rows)
        ax.set_xlabel(table.column_name)
        if index % cols == 0:
            ax.set_ylabel("max_workers")
        ax.set_title(table.title, fontsize="medium")
        best = table.best()
        for i, r in enumerate(table.rows):
            for j, c in enumerate(table.columns):
                value = grid[i][j]
                text = "-" if math.isnan(value) else f"{value:.1f}"
                weight = "bold" if (r, c) == best else "normal"
                # Dark text on viridis's light (high) end and on the blank of a missing cell.
                light = math.isnan(value) or value > DARK_TEXT_ABOVE * max(rates)
                color = "black" if light else "white"
                ax.text(j, i, text, ha="center", va="center", color=color, weight=weight)
    fig.colorbar(image, ax=axes.ravel().tolist(), label="completed scans/s (median)")
    fig.savefig(path)
    plt.close(fig)
    return True


def cell_rate(table: Pivot, row: str, column: str) -> float:
    cell = table.cells.get((row, column))
    rate = None if cell is None else cell.get("throughput")
    return math.nan if rate is None else float(rate)
