"""What a scan refused by the loop pacer costs the service's process, in CPU.

Starts the simulator and one service (defaults, caches off), measures the process's CPU per
completed scan over `--scans` scans one at a time, then sends a wave of `--wave` scans at
once to a service whose `LOOP_UTILISATION_TARGET` (`--target`, 0.01 by default) its own
scans keep it over: the pacer is at its floor (a scan a second) and refuses nearly all of
the wave (`SERVER_BUSY`) before reading their bodies. The refusals' CPU is the wave's
process CPU less the few scans it admitted at the measured CPU per scan; printed beside
`ecoscan_loop_shed_cpu_seconds_total` (acceptance's own part of it).

    .venv/bin/python k6/refusal_cost.py --wave 2000
    .venv/bin/python k6/refusal_cost.py --wave 2000 --checkout ../overload-base   # another build
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
from pathlib import Path

import httpx
from PIL import Image

from cpu_side_by_side import DEFAULTS, START_TIMEOUT_S, service
from sweep.processes import HOST, Proc, ensure_database, free_port, start, stop, venv_python, wait_ready
from sweep.prometheus import scrape, total

ROOT = Path(__file__).resolve().parent.parent
SCAN = "/api/v1/scan/classify/completion"


def tiny_jpeg_url() -> str:
    out = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 140, 60)).save(out, "JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


BODY = {"image_url": tiny_jpeg_url()}
TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


async def scan(client: httpx.AsyncClient, n: int) -> int:
    async with client.stream("POST", SCAN, json=BODY, headers={"X-User-ID": f"u{n}"}) as response:
        async for _ in response.aiter_bytes():
            pass
        return response.status_code


async def measure(url: str, pid: int, scans: int, wave: int) -> None:
    limits = httpx.Limits(max_connections=wave, max_keepalive_connections=wave)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:
        for n in range(5):  # one-off costs out of the way
            await scan(client, n)
        before = process_cpu_s(pid)
        for n in range(scans):
            status = await scan(client, n)
            assert status == 200, status
        per_scan = (process_cpu_s(pid) - before) / scans
        print(f"CPU per completed scan, one at a time: {per_scan * 1000:.2f} ms ({scans} scans)")
        for name in ("new connections", "connections reused"):
            await wave_of(client, url, pid, wave, per_scan, name)


async def wave_of(
    client: httpx.AsyncClient, url: str, pid: int, wave: int, per_scan: float, name: str
) -> None:
    metrics_before = scrape(url)
    before = process_cpu_s(pid)
    statuses = await asyncio.gather(*(scan(client, n) for n in range(wave)))
    wave_cpu = process_cpu_s(pid) - before
    after = scrape(url)
    admitted = statuses.count(200)
    refused = statuses.count(503)
    shed_cpu = total(after, "ecoscan_loop_shed_cpu_seconds_total") - total(
        metrics_before, "ecoscan_loop_shed_cpu_seconds_total"
    )
    print(f"wave of {wave} ({name}): {admitted} admitted, {refused} refused, process CPU {wave_cpu:.2f} s")
    if refused:
        cost = (wave_cpu - admitted * per_scan) / refused
        print(f"  CPU per refusal (process, estimated): {cost * 1000:.3f} ms")
        print(f"  CPU per refusal (acceptance's part, measured): {shed_cpu / refused * 1000:.3f} ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scans", type=int, default=100)
    p.add_argument("--wave", type=int, default=2000)
    p.add_argument("--target", default="0.01", help="LOOP_UTILISATION_TARGET of the service")
    p.add_argument(
        "--checkout", type=Path, default=ROOT, help="the build measured (a `git worktree` of another commit)"
    )
    p.add_argument("--out", type=Path, default=ROOT / "k6" / "results" / "refusal-cost")
    p.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
    )
    args = p.parse_args()
    ensure_database(args.database_url)
    args.out.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        sim_port = free_port()
        argv = [venv_python(), "-m", "app.sim", "--host", HOST, "--port", str(sim_port)]
        argv += ["--time-scale", "0.01", "--rpm", "0", "--tpm", "0"]
        procs.append(sim := start("simulator", argv, dict(os.environ), args.out / "sim.log"))
        wait_ready(sim, f"http://{HOST}:{sim_port}/sim/stats", START_TIMEOUT_S)
        url = service(
            "service",
            args.checkout.resolve(),
            "app.main:app",
            sim_port,
            args.database_url,
            args.out,
            procs,
            {**DEFAULTS, "LOOP_UTILISATION_TARGET": args.target, "LOOP_PACING": "true"},
            backlog=4096,
        )
        asyncio.run(measure(url, procs[-1].popen.pid, args.scans, args.wave))
    finally:
        for proc in reversed(procs):
            stop(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
