"""Replicas SIGKILLed under steady load: does anybody lose their scan?

Starts the simulator (no rate limits), three `uvicorn app.main:app` replicas on one
PostgreSQL database of the run's own and the machine's Redis (a key prefix of the run's
own), and an open-loop Python load generator: `--rate` scans/s for `--duration`, each
POSTed to the next replica in turn (the next again when one refuses the connection, as a
balancer's health check would). Every `--kill-every` seconds (first at half of it) one
replica, in turn, is SIGKILLed and restarted on its port.

Each scan's reader records every event it sees. When its connection drops without a
terminal event it goes on from another replica: `GET /api/v1/scan/{id}/events` with
`Last-Event-ID` (409 `SCAN_RUNNING_ELSEWHERE` is retried every `RESUME_RETRY_S`), or,
when the drop came before the response's headers (the scan id unknown), the same POST
with the same `Idempotency-Key` (it answers with the scan if there is one). A reader
gives up `READER_BUDGET_S` after its POST.

    .venv/bin/python k6/kill_bench.py                    # 3 replicas, 3 scans/s, 180 s, a kill every 30 s
    .venv/bin/python k6/kill_bench.py --rate 5 --duration 60s --kill-every 15

Prints and writes to `--out`/report.txt: scans accepted (rows), completed, lost (accepted
and not completed), readers without a terminal event, readers with more than one, seq
gaps, readers whose end disagrees with the row, scans taken over (resumed / lost, from
the replicas' logs), and upstream calls (simulator stats) against completed scans; the
per-scan records go to `--out`/scans.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import json
import os
import re
import secrets
import signal
import time
import urllib.parse
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import redis
from httpx_sse import aconnect_sse

from cpu_per_scan import CACHES_OFF, SERVICE_RPM, SERVICE_TPM
from cpu_side_by_side import START_TIMEOUT_S, seconds
from sweep.processes import HOST, Proc, free_port, start, stop, venv_python, wait_ready

ROOT = Path(__file__).resolve().parent.parent
SCAN_PATH = "/api/v1/scan/classify/completion"
REPLICAS = 3
# The simulator's default latencies (vision 4.5 s, answer 4.8 s) scaled: ~4.7 s per scan,
# so each kill finds scans in both stages.
SIM_TIME_SCALE = "0.5"
SETTINGS = {
    **CACHES_OFF,  # every scan makes both calls: a repeated one shows in the stats
    # The budget never binds (`--set OPENAI_RPM=500` for the default): what is measured is
    # what a kill costs, not what admission's look-ahead refuses.
    "OPENAI_RPM": SERVICE_RPM,
    "OPENAI_TPM": SERVICE_TPM,
    "MAX_INFLIGHT_PER_USER": "100",
    "CPU_MAX_WORKERS": "1",  # three replicas on two shared cores
    "DB_POOL_MIN": "1",
    "LOG_LEVEL": "INFO",
}
# Per read: a stream idle this long (pings come every SSE_PING_S, 15 s) is a hung one.
READ_TIMEOUT_S = 40.0
CONNECT_TIMEOUT_S = 2.0
# From a scan's POST to its reader giving up: SCAN_DEADLINE_S (60) and room for the
# lease to lapse and the claim to run.
READER_BUDGET_S = 90.0
RESUME_RETRY_S = 0.5
# After the load ends, readers still running get this long to finish.
DRAIN_S = READER_BUDGET_S
# The rows' view is read once no row of the run is `running` or after this.
ROWS_SETTLE_S = 30.0
RESTART_TIMEOUT_S = START_TIMEOUT_S


@dataclass
class Reader:
    """One scan as its client saw it."""

    n: int
    key: str
    posted_at: float
    job_id: str | None = None
    accepted: bool = False
    refused: str | None = None  # the code of a non-200 POST answer
    seqs: list[int] = field(default_factory=list)
    terminals: list[tuple[int, str, str | None]] = field(default_factory=list)  # seq, event, code
    drops: list[str] = field(default_factory=list)  # why each connection ended early
    resumes: int = 0
    reposts: int = 0  # the POST sent again (same key): cut before its answer's headers
    replays: int = 0  # events at or before the position, sent again (an idempotent POST)
    gave_up: str | None = None
    ended_at: float | None = None


class Replicas:
    """The three replicas: fixed ports, so a restarted one is found where it was."""

    def __init__(self, env: dict[str, str], out: Path) -> None:
        self.env, self.out = env, out
        self.ports = [free_port() for _ in range(REPLICAS)]
        self.urls = [f"http://{HOST}:{port}" for port in self.ports]
        self.procs: list[Proc | None] = [None] * REPLICAS
        self.starts = [0] * REPLICAS

    def start(self, i: int) -> None:
        argv = [venv_python(), "-m", "uvicorn", "app.main:app"]
        argv += ["--http", "app.http.protocol:HttpToolsProtocol", "--host", HOST]
        argv += ["--port", str(self.ports[i]), "--no-access-log"]
        self.starts[i] += 1
        log = self.out / f"replica-{i}-{self.starts[i]}.log"
        proc = start(f"replica {i}", argv, self.env, log)
        self.procs[i] = proc
        wait_ready(proc, self.urls[i] + "/readyz", RESTART_TIMEOUT_S)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(10)

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.out.glob("replica-*.log")))

    def stop_all(self) -> None:
        for proc in self.procs:
            stop(proc)


class Load:
    def __init__(self, urls: list[str], body: dict[str, str]) -> None:
        self.urls = urls
        self.body = body
        self.readers: list[Reader] = []
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=50)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)

    async def scan(self, n: int) -> None:
        reader = Reader(n, str(uuid.uuid4()), time.monotonic())
        self.readers.append(reader)
        try:
            async with asyncio.timeout(READER_BUDGET_S):
                await self._follow(reader, n % len(self.urls))
        except TimeoutError:
            reader.gave_up = "reader budget"
        except Exception as exc:  # recorded, never lost: the report counts it
            reader.gave_up = f"{type(exc).__name__}: {exc}"
        reader.ended_at = time.monotonic()

    async def _follow(self, reader: Reader, replica: int) -> None:
        headers = {"X-User-ID": f"kb-{reader.n % 50}", "Idempotency-Key": reader.key}
        tries = 0
        while not reader.terminals:
            url = self.urls[replica]
            if reader.job_id is None:
                request = ("POST", url + SCAN_PATH, {"json": self.body, "headers": headers})
                reader.reposts += tries > 0
            else:
                last = {"Last-Event-ID": str(reader.seqs[-1] if reader.seqs else 0)}
                path = f"{url}/api/v1/scan/{reader.job_id}/events"
                request = ("GET", path, {"headers": {**headers, **last}})
                reader.resumes += 1
            outcome = await self._read(reader, *request)
            if outcome == "refused":
                return
            if outcome == "busy":
                await asyncio.sleep(RESUME_RETRY_S)
            replica = (replica + 1) % len(self.urls)  # a balancer sends the retry elsewhere
            tries += 1

    async def _read(self, reader: Reader, method: str, url: str, kwargs: dict[str, Any]) -> str:
        try:
            async with aconnect_sse(self.client, method, url, **kwargs) as source:
                response = source.response
                if response.status_code == 204:
                    reader.drops.append("204: ended at or before the position")
                    reader.gave_up = "204 without a terminal event"
                    return "refused"
                if response.status_code != 200:
                    body = json.loads(await response.aread() or b"{}")
                    code = body.get("code", str(response.status_code))
                    if code == "SCAN_RUNNING_ELSEWHERE":
                        return "busy"
                    if reader.job_id is None:
                        reader.refused = code
                    else:
                        reader.gave_up = f"{response.status_code} {code}"
                    return "refused"
                reader.accepted = True
                reader.job_id = reader.job_id or response.headers.get("x-scan-id")
                async for sse in source.aiter_sse():
                    if not sse.data:
                        continue
                    seq = int(sse.id)
                    if reader.seqs and seq <= reader.seqs[-1]:
                        reader.replays += 1
                        continue
                    reader.seqs.append(seq)
                    if sse.event in ("done", "error"):
                        reader.terminals.append((seq, sse.event, json.loads(sse.data).get("code")))
                if not reader.terminals:
                    reader.drops.append("clean end without a terminal event")
                return "ended"
        except httpx.ConnectError:
            return "busy" if reader.job_id else "next"
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout) as exc:
            if not reader.terminals:  # cut after its end: nothing was missed
                reader.drops.append(type(exc).__name__)
            return "dropped"

    async def run(self, rate: float, duration_s: float) -> None:
        tasks: list[asyncio.Task[None]] = []
        started = time.monotonic()
        n = 0
        while (at := n / rate) < duration_s:
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))
            tasks.append(asyncio.create_task(self.scan(n)))
            n += 1
        await asyncio.wait(tasks, timeout=DRAIN_S)

    async def close(self) -> None:
        await self.client.aclose()


async def killer(replicas: Replicas, every_s: float, duration_s: float, kills: list[dict[str, Any]]) -> None:
    started = time.monotonic()
    at, victim = every_s / 2, 0
    while at < duration_s:
        await asyncio.sleep(max(0.0, started + at - time.monotonic()))
        t = time.monotonic() - started
        await asyncio.to_thread(replicas.kill, victim)
        await asyncio.to_thread(replicas.start, victim)
        kills.append(
            {"replica": victim, "at_s": round(t, 1), "back_after_s": round(time.monotonic() - started - t, 1)}
        )
        at, victim = at + every_s, (victim + 1) % REPLICAS


def tiny_image() -> str:
    raw = (ROOT / "k6" / "sample-images" / "tiny-1.jpg").read_bytes()
    return "data:image/jpeg;base64," + base64.b64encode(raw).decode()


async def rows(database_url: str, settle_s: float) -> dict[str, asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        running = "SELECT count(*) FROM scans WHERE status = 'running'"
        for _ in range(int(settle_s)):  # a row still running after the drain: its sweep's
            if not await conn.fetchval(running):
                break
            await asyncio.sleep(1.0)
        found = await conn.fetch("SELECT id, status, error_code, event_log FROM scans")
        return {str(r["id"]): r for r in found}
    finally:
        await conn.close()


def stage_runs(event_log: Any) -> collections.Counter[str]:
    """How many times each stage started in a stored log (more than once: run again)."""
    entries = json.loads(event_log) if isinstance(event_log, str) else event_log or []
    return collections.Counter(e[3] for e in entries if e[2] == "stage" and e[4].get("status") == "started")


def quantile(readers: list[Reader], q: float) -> str:
    took = sorted(r.ended_at - r.posted_at for r in readers if r.ended_at is not None and r.terminals)
    return f"{took[min(len(took) - 1, int(q * len(took)))]:.1f}" if took else "n/a"


def report(
    args: argparse.Namespace,
    readers: list[Reader],
    by_id: dict[str, asyncpg.Record],
    stats: dict[str, Any],
    logs: str,
    kills: list[dict[str, Any]],
) -> str:
    accepted = [r for r in readers if r.accepted]
    statuses = collections.Counter((row["status"], row["error_code"]) for row in by_id.values())
    completed = statuses[("completed", None)]
    lost = {f"{s}/{c}": n for (s, c), n in statuses.items() if s != "completed"}
    no_terminal = [r for r in accepted if not r.terminals]
    several = [r for r in accepted if len(r.terminals) > 1]
    gaps = [r for r in accepted if r.seqs and r.seqs != list(range(r.seqs[0], r.seqs[0] + len(r.seqs)))]
    late_start = [r for r in accepted if r.seqs and r.seqs[0] != 1]
    disagree = []
    for r in accepted:
        row = by_id.get(r.job_id or "")
        if r.terminals and row is not None:
            _, event, code = r.terminals[-1]
            if (event == "done") != (row["status"] == "completed") or (
                event == "error" and code != row["error_code"]
            ):
                disagree.append(r)
    unknown = [r for r in readers if not r.accepted and r.refused is None]
    resumed = [r for r in accepted if r.resumes]
    runs = collections.Counter[str]()
    for row in by_id.values():
        for stage, n in stage_runs(row["event_log"]).items():
            runs[stage] += n - 1
    vision, text = stats["by_kind"]["vision"], stats["by_kind"]["text"]
    dropped = [r for r in accepted if r.drops]
    swept = sum(int(n) for n in re.findall(r"sweep: (\d+) scans of dead processes marked PROCESS_LOST", logs))
    refused = collections.Counter(r.refused for r in readers if r.refused)
    lines = [
        f"{REPLICAS} replicas, {args.rate:g} scans/s for {args.duration}, SIGKILL + restart every"
        f" {args.kill_every:g} s, sim time scale {SIM_TIME_SCALE}, settings {args.set}",
        f"kills: {kills}",
        f"POSTs: {len(readers)}; refused {sum(refused.values())} {dict(refused)};"
        f" never answered {len(unknown)}",
        f"scans accepted (rows): {len(by_id)}; readers with a scan id: {len(accepted)}",
        f"completed: {completed}; not completed (lost): {sum(lost.values())} {lost}",
        f"readers without a terminal event: {len(no_terminal)}"
        + "".join(f"\n  {r.job_id}: drops {r.drops}, gave up: {r.gave_up}" for r in no_terminal[:10]),
        f"readers with more than one terminal event: {len(several)}; with a seq gap: {len(gaps)};"
        f" not starting at 1: {len(late_start)}; whose end disagrees with the row: {len(disagree)}",
        f"readers whose connection dropped: {len(dropped)}; that went on from another replica: {len(resumed)}"
        f" ({sum(r.resumes for r in resumed)} GETs, 409s included); POSTs sent again with their key:"
        f" {sum(r.reposts for r in readers)}, events they replayed: {sum(r.replays for r in readers)}",
        f"POST to terminal event, s: all p50 {quantile(accepted, 0.5)}, p99 {quantile(accepted, 0.99)};"
        f" readers that went on elsewhere p50 {quantile(resumed, 0.5)}, max {quantile(resumed, 1.0)}",
        f"taken over: resumed {logs.count('claimed: resumed')}, lost {logs.count('claimed: lost')};"
        f" swept as PROCESS_LOST: {swept}",
        f"upstream calls: vision {vision}, text {text} for {completed} completed scans"
        f" (+{vision - completed} vision, +{text - completed} text);"
        f" stages started again in the stored logs: {dict(runs)}",
    ]
    return "\n".join(lines)


async def bench(args: argparse.Namespace) -> str:
    duration_s = seconds(args.duration)
    base = args.database_url
    name = f"ecoscan_killbench_{secrets.token_hex(3)}"
    database_url = urllib.parse.urlunsplit(urllib.parse.urlsplit(base)._replace(path="/" + name))
    admin = await asyncpg.connect(base)
    await admin.execute(f'CREATE DATABASE "{name}"')
    prefix = f"ecoscan-killbench-{secrets.token_hex(3)}"
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("replica-*.log"):
        old.unlink()
    sim: Proc | None = None
    replicas: Replicas | None = None
    try:
        sim_port = free_port()
        sim_argv = [venv_python(), "-m", "app.sim", "--host", HOST, "--port", str(sim_port)]
        sim_argv += ["--time-scale", SIM_TIME_SCALE, "--rpm", "0", "--tpm", "0"]
        sim = start("simulator", sim_argv, dict(os.environ), args.out / "sim.log")
        sim_url = f"http://{HOST}:{sim_port}"
        wait_ready(sim, sim_url + "/sim/stats", START_TIMEOUT_S)
        env = {
            **os.environ,
            "DATABASE_URL": database_url,
            "REDIS_URL": args.redis_url,
            "REDIS_PREFIX": prefix,
            "OPENAI_API_KEY": "sim",
            "OPENAI_BASE_URL": sim_url + "/v1",
            "PYTHONUNBUFFERED": "1",
            **SETTINGS,
            **dict(kv.split("=", 1) for kv in args.set),
        }
        replicas = Replicas(env, args.out)
        for i in range(REPLICAS):  # one after the other: each runs the migrations at start-up
            replicas.start(i)
        async with httpx.AsyncClient() as control:
            await control.post(sim_url + "/sim/stats/reset")
        load = Load(replicas.urls, {"image_url": tiny_image()})
        kills: list[dict[str, Any]] = []
        try:
            await asyncio.gather(
                load.run(args.rate, duration_s), killer(replicas, args.kill_every, duration_s, kills)
            )
        finally:
            await load.close()
        by_id = await rows(database_url, ROWS_SETTLE_S)
        async with httpx.AsyncClient() as control:
            stats = (await control.get(sim_url + "/sim/stats")).json()
        with (args.out / "scans.jsonl").open("w") as f:
            for r in load.readers:
                f.write(json.dumps(asdict(r)) + "\n")
        return report(args, load.readers, by_id, stats, replicas.logs(), kills)
    finally:
        if replicas is not None:
            replicas.stop_all()
        stop(sim)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
        client = redis.Redis.from_url(args.redis_url)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
        if keys:
            client.delete(*keys)
        client.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=3.0, help="scans started per second")
    p.add_argument("--duration", default="180s")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills (the first at half)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another setting")
    p.add_argument("--out", type=Path, default=ROOT / "k6" / "results" / "kill-bench")
    p.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help="a server where the run creates (and drops) a database of its own",
    )
    p.add_argument(
        "--redis-url", default="redis://127.0.0.1:6379/0", help="the run's keys take a prefix of their own"
    )
    args = p.parse_args()
    text = asyncio.run(bench(args))
    print(text)
    (args.out / "report.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
