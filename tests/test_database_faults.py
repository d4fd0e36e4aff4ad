"""PostgreSQL going away under load, on a cluster of the test's own (the embedded
server in a temp directory), stopped and started again with `pg_ctl` while scans run:
no row is left `running`, every stream ends in exactly one terminal event that agrees
with its row, and the service is whole afterwards (pool, rule listener)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import urllib.parse
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from httpx_sse import aconnect_sse

from app.db.embedded import EmbeddedPostgres
from app.db.migrations import apply_migrations, bundled_migrations
from app.db.pool import DB_ERRORS, create_pool, database_error, row_error
from app.db.restarts import broken_connection
from app.db.taxonomy import Classification, load_taxonomy
from app.errors import DatabaseError
from app.scans.store import ScanStore
from app.sim.server import RunningSimulator
from app.stages.rule import RuleBook

from .conftest import (
    SCAN_URL,
    Service,
    data_url,
    eventually,
    make_jpeg,
    run_scan,
    running_service,
    settings_for,
    sim_configure,
)
from .service_process import service_env, service_process

PG_CTL_TIMEOUT_S = 60
LOAD_PROGRESS_TIMEOUT_S = 60  # for a few scans to end under load, on a slow shared machine


class ControlledPostgres:
    """An embedded cluster the test may stop and start."""

    def __init__(self, data_dir: Path, embedded: EmbeddedPostgres, dsn: str) -> None:
        self.data_dir = data_dir
        self.embedded = embedded
        self.dsn = dsn
        self._socket_dir = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(dsn).query))["host"]

    async def stop(self) -> None:
        await self._pg_ctl(["-w", "-m", "fast", "stop"])

    async def start(self) -> None:
        await self._pg_ctl(["-w", *self._options(), "start"])

    async def restart(self) -> None:
        """`pg_ctl restart -m fast`: every connection is cut, the server is back a moment later."""
        await self._pg_ctl(["-w", "-m", "fast", *self._options(), "restart"])

    def _options(self) -> list[str]:
        return ["-o", '-h ""', "-o", f"-k {self._socket_dir}", "-l", str(self.data_dir / "log")]

    def freeze(self) -> None:
        """SIGSTOP the postmaster and every backend: a server that hangs, not one that
        refuses (connections stay open, queries never answer)."""
        for pid in self._processes():
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self._processes():
            os.kill(pid, signal.SIGCONT)

    def _processes(self) -> list[int]:
        postmaster = int((self.data_dir / "postmaster.pid").read_text().split()[0])
        children = [
            int(stat.parent.name)
            for stat in Path("/proc").glob("[0-9]*/stat")
            if _parent_pid(stat) == postmaster
        ]
        return [postmaster, *children]

    async def _pg_ctl(self, args: list[str]) -> None:
        from pgserver import _commands

        user = self.embedded.system_user
        run = _commands.pg_ctl  # type: ignore[attr-defined]
        await asyncio.to_thread(run, args, pgdata=self.data_dir, user=user, timeout=PG_CTL_TIMEOUT_S)


def _parent_pid(stat: Path) -> int | None:
    try:
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'.
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


@pytest.fixture
async def controlled_pg() -> AsyncIterator[ControlledPostgres]:
    # Not tmp_path: each pytest session makes /tmp/pytest-of-<user> private again, which
    # locks out the `pgserver` user postgres runs as under root.
    with tempfile.TemporaryDirectory(prefix="ecoscan-faults-pg-") as tmp:
        data_dir = Path(tmp) / "pgdata"
        embedded = EmbeddedPostgres(str(data_dir))
        dsn = await embedded.start()
        try:
            yield ControlledPostgres(data_dir, embedded, dsn)
        finally:
            await embedded.stop()


RESTARTS = 3
READ_TIMEOUT_S = 30.0  # DB_TIMEOUT_S of statements made while the server is down: its start fits
PAPER = Classification("재활용폐기물", "종이", "신문지")


class Load:
    """Scans in a loop from `workers` users until stopped; every outcome kept."""

    def __init__(self, svc: Service, workers: int) -> None:
        self.svc = svc
        self.streams: list[tuple[str, str, str | None]] = []  # (job_id, terminal event, code)
        self.rejected: list[tuple[int, str]] = []
        self.bad: list[str] = []
        self.errors: list[dict[str, Any]] = []  # the `error` events' data
        self.ended = asyncio.Condition()  # notified as each stream ends
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._worker(w)) for w in range(workers)]

    async def stop(self) -> None:
        self._stop.set()
        async with asyncio.timeout(60):
            await asyncio.gather(*self._tasks)

    async def _worker(self, worker: int) -> None:
        seed = worker * 1000
        async with httpx.AsyncClient(base_url=self.svc.url, timeout=60) as client:
            while not self._stop.is_set():
                seed += 1
                await self._one(client, worker, seed)

    async def _one(self, client: httpx.AsyncClient, worker: int, seed: int) -> None:
        request: dict[str, Any] = {"json": {"image_url": data_url(make_jpeg(seed))}}
        async with aconnect_sse(
            client, "POST", SCAN_URL, headers={"X-User-ID": f"w{worker}"}, **request
        ) as src:
            if src.response.status_code != 200:
                body = json.loads(await src.response.aread())
                self.rejected.append((src.response.status_code, body["code"]))
                await asyncio.sleep(0.05)
                return
            events = [(sse.event, json.loads(sse.data)) async for sse in src.aiter_sse() if sse.data]
        terminals = [(name, data) for name, data in events if name in ("done", "error")]
        if len(terminals) != 1 or events[-1][0] not in ("done", "error"):
            self.bad.append(f"{events[0][1].get('job_id')}: {[n for n, _ in events]}")
            return
        name, data = terminals[0]
        self.streams.append((data["job_id"], name, data.get("code")))
        if name == "error":
            self.errors.append(data)
        async with self.ended:
            self.ended.notify_all()

    async def wait_for_streams(self, count: int) -> None:
        """Until `count` more streams have ended (bounded: a stuck service fails the test)."""
        target = len(self.streams) + count
        async with asyncio.timeout(LOAD_PROGRESS_TIMEOUT_S), self.ended:
            await self.ended.wait_for(lambda: len(self.streams) >= target)


async def test_postgres_restart_under_load_leaves_no_row_running(
    controlled_pg: ControlledPostgres, sim: RunningSimulator
) -> None:
    await sim_configure(sim, time_scale=0.05)  # ~0.5 s per scan
    settings = settings_for(
        controlled_pg.dsn, sim, db_timeout_s=1.0, scan_deadline_s=20.0, db_pool_min=2, log_level="ERROR"
    )
    async with running_service(settings) as svc:
        load = Load(svc, workers=8)
        await asyncio.sleep(1.5)
        await controlled_pg.stop()
        await asyncio.sleep(3.0)
        await controlled_pg.start()
        await asyncio.sleep(2.0)
        await load.stop()

        assert not load.bad, load.bad
        assert {code for _, code in load.rejected} <= {"DATABASE_UNAVAILABLE"}, load.rejected
        assert load.rejected, "the outage refused no scan: it did not happen under load"
        assert await eventually(
            lambda: svc.metric("ecoscan_scan_rows_deferred") == 0, attempts=300, interval=0.1
        )
        # The service is whole again: scans complete, the rule listener is back.
        outcome = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(77))})
        assert outcome.terminal.event == "done", outcome.events[-1]
        assert await eventually(
            lambda: svc.metric("ecoscan_rules_listener_up") == 1, attempts=300, interval=0.1
        )
        ready = await svc.client.get("/readyz")
        assert ready.status_code == 200, ready.json()

    rows = await _rows(controlled_pg)
    assert not [job for job, (status, _) in rows.items() if status == "running"]
    for job_id, event, code in load.streams:
        expected = ("completed", None) if event == "done" else ("failed", code)
        assert rows[job_id] == expected, (job_id, event, code)
    assert any(event == "done" for _, event, _ in load.streams)


@pytest.mark.timeout(240)
async def test_postgres_restarts_under_load_fail_no_scan_a_retry_would_save(
    controlled_pg: ControlledPostgres, sim: RunningSimulator
) -> None:
    """`pg_ctl restart -m fast` while scans run: pooled connections meet the shutdown
    mid-query (asyncpg's InternalClientError, "connection was closed") and new ones meet
    "the database system is starting up". No scan may end INTERNAL_ERROR, none may fail in
    a read (the rule lookup) that a retry within DB_TIMEOUT_S carries across; only a write
    the restart cut once sent (not safe to send twice) may fail or refuse a scan."""
    await sim_configure(sim, time_scale=0.05)
    settings = settings_for(
        controlled_pg.dsn,
        sim,
        db_timeout_s=5.0,
        scan_deadline_s=30.0,
        db_pool_min=4,
        rules_cache_ttl_s=0.0,  # every scan reads its rule from the database
        log_level="ERROR",
    )
    async with running_service(settings) as svc:
        load = Load(svc, workers=8)
        for _ in range(RESTARTS):
            await load.wait_for_streams(8)
            await controlled_pg.restart()
        await load.wait_for_streams(8)
        await load.stop()

        assert not load.bad, load.bad
        assert not [e for e in load.errors if e.get("code") == "INTERNAL_ERROR"], load.errors
        assert not [e for e in load.errors if e.get("step") == "rule"], load.errors
        # Only writes the restart cut may fail; the refusals say to retry.
        assert {e.get("code") for e in load.errors} <= {"DATABASE_ERROR"}, load.errors
        assert {code for _, code in load.rejected} <= {"DATABASE_UNAVAILABLE"}, load.rejected
        outcome = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(78))})
        assert outcome.terminal.event == "done", outcome.events[-1]
    print(f"restarts={RESTARTS} streams={len(load.streams)} errors={load.errors} rejected={load.rejected}")


async def test_readyz_answers_within_its_timeout_while_postgres_is_down(
    controlled_pg: ControlledPostgres, sim: RunningSimulator
) -> None:
    settings = settings_for(controlled_pg.dsn, sim, db_timeout_s=1.0, log_level="ERROR")
    async with running_service(settings) as svc:
        await controlled_pg.stop()
        try:
            async with asyncio.timeout(5):
                ready = await svc.client.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["checks"]["database"] == "unreachable"
        finally:
            await controlled_pg.start()
        assert await eventually(lambda: _ready(svc), attempts=200, interval=0.05), (
            "not ready again after the database came back"
        )


async def _ready(svc: Service) -> bool:
    return (await svc.client.get("/readyz")).status_code == 200


async def test_frozen_postgres_under_load_client_and_row_agree(
    controlled_pg: ControlledPostgres, sim: RunningSimulator
) -> None:
    await sim_configure(sim, time_scale=0.05)
    settings = settings_for(
        controlled_pg.dsn, sim, db_timeout_s=1.0, scan_deadline_s=20.0, db_pool_min=2, log_level="ERROR"
    )
    async with running_service(settings) as svc:
        load = Load(svc, workers=8)
        await asyncio.sleep(1.5)
        controlled_pg.freeze()
        try:
            async with asyncio.timeout(5):
                ready = await svc.client.get("/readyz")
            assert ready.status_code == 503
            await asyncio.sleep(4.0)
        finally:
            controlled_pg.thaw()
        await asyncio.sleep(2.0)
        await load.stop()
        assert not load.bad, load.bad
        assert await eventually(
            lambda: svc.metric("ecoscan_scan_rows_deferred") == 0, attempts=300, interval=0.1
        )

    rows = await _rows(controlled_pg)
    assert not [job for job, (status, _) in rows.items() if status == "running"]
    for job_id, event, code in load.streams:
        expected = ("completed", None) if event == "done" else ("failed", code)
        assert rows[job_id] == expected, (job_id, event, code)


async def test_a_running_row_committed_after_its_insert_timed_out_ends_failed(
    controlled_pg: ControlledPostgres,
) -> None:
    """A scan's `running` INSERT times out against a hung server, so the scan is refused
    (DATABASE_UNAVAILABLE), but the server commits it once it answers again. The row must
    not stay `running` (it did, now and then, under load: the test above saw it)."""
    conn = await asyncpg.connect(controlled_pg.dsn)
    try:
        await apply_migrations(conn, bundled_migrations())
    finally:
        await conn.close()
    pool = await asyncpg.create_pool(controlled_pg.dsn, min_size=1, max_size=1)
    store = ScanStore(pool, instance_id=uuid.uuid4(), timeout_s=1.0)

    async def create(scan_id: uuid.UUID) -> None:
        await store.create(scan_id, user_id="u", image_source="data_url", image_sha256=None, user_input=None)

    try:
        # Prepared once while the server answers: the refused INSERT then goes out whole.
        await create(uuid.uuid4())
        refused = uuid.uuid4()
        controlled_pg.freeze()
        try:
            with pytest.raises(DatabaseError):
                await create(refused)
        finally:
            controlled_pg.thaw()
        assert await eventually(lambda: store.deferred == 0, attempts=300, interval=0.1)
        failed = ("failed", "DATABASE_UNAVAILABLE")
        assert (await _rows(controlled_pg)).get(str(refused), failed) == failed  # or no row at all
    finally:
        await store.close(5.0)
        await pool.close()


async def test_statements_started_while_postgres_is_down_succeed_once_it_is_back(
    controlled_pg: ControlledPostgres,
) -> None:
    """A scan's result and its rule, read while the server is away (refused, then "starting
    up"), and a new scan's row, written then, are done on a fresh connection once it is
    back, within DB_TIMEOUT_S: the write was never sent, so sending it is safe."""
    pool = await create_pool(controlled_pg.dsn, min_size=1, max_size=2, timeout_s=READ_TIMEOUT_S)
    try:
        async with pool.acquire() as conn:
            await apply_migrations(conn, bundled_migrations())
            taxonomy = await load_taxonomy(conn)
        store = ScanStore(pool, instance_id=uuid.uuid4(), timeout_s=READ_TIMEOUT_S)
        rules = RuleBook(pool, recyclable=taxonomy.recyclable, ttl_s=0.0, timeout_s=READ_TIMEOUT_S)
        scan_id, later_id = uuid.uuid4(), uuid.uuid4()
        await store.create(scan_id, user_id="u", image_source="data_url", image_sha256=None, user_input=None)
        await controlled_pg.stop()
        try:
            done = asyncio.gather(
                store.load(scan_id),
                rules.find(PAPER),
                store.create(
                    later_id, user_id="u", image_source="data_url", image_sha256=None, user_input=None
                ),
            )
            await asyncio.sleep(0.2)
            assert not done.done(), "gave up while the server was away"
        finally:
            await controlled_pg.start()
        stored, rule, _ = await done
        assert stored is not None and stored.status == "running"
        assert rule.matched_by == "exact"
        assert (await _rows(controlled_pg))[str(later_id)] == ("running", None)
        await store.close(5.0)
    finally:
        await pool.close()


async def test_a_connection_broken_by_a_restart_is_a_retryable_database_error() -> None:
    """asyncpg's InternalClientError derives from Exception alone: unlisted, a restart that
    raised it reached the pipeline's catch-all (INTERNAL_ERROR, not retryable)."""
    cut = asyncpg.exceptions.InternalClientError(
        "cannot switch to state 12; another operation (2) is in progress"
    )
    assert isinstance(cut, DB_ERRORS) and broken_connection(cut)
    error = database_error(cut)
    assert isinstance(error, DatabaseError) and error.retryable and not row_error(error)
    for blip in (
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.CannotConnectNowError("the database system is starting up"),
        asyncpg.InterfaceError("cannot perform operation: another operation is in progress"),
        ConnectionRefusedError(111, "Connection refused"),
    ):
        assert isinstance(blip, DB_ERRORS) and broken_connection(blip), blip
    for lasting in (TimeoutError(), asyncpg.UniqueViolationError("duplicate key"), asyncpg.DataError("bad")):
        assert not broken_connection(lasting), lasting


async def test_sigterm_while_postgres_hangs_still_exits(
    controlled_pg: ControlledPostgres, sim: RunningSimulator, tmp_path: Path
) -> None:
    env = service_env(controlled_pg.dsn, sim, DB_TIMEOUT_S="1")
    async with service_process(env, tmp_path / "service.log") as svc:
        controlled_pg.freeze()
        try:
            svc.signal(signal.SIGTERM)
            # Every close is bounded (CLOSE_TIMEOUT_S = 5 s each: pool, listener, client).
            code = await svc.exited(timeout_s=45)
        finally:
            controlled_pg.thaw()
    assert code in (0, -signal.SIGTERM), svc.log


async def _rows(pg: ControlledPostgres) -> dict[str, tuple[str, str | None]]:
    conn = await asyncpg.connect(pg.dsn)
    try:
        records = await conn.fetch("SELECT id, status, error_code FROM scans")
    finally:
        await conn.close()
    return {str(r["id"]): (r["status"], r["error_code"]) for r in records}
