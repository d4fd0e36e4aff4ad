"""The `scans` table: one row per accepted scan, written twice — `running` when the
scan is accepted (before the stream starts, so a database outage is a clean 503),
and once more with its terminal status (each write, when the process is busy, in one
statement with other scans': app/db/batch.py). Nothing accepted goes unrecorded, and no
row stays `running`:

- The terminal write is the process's word on what the client was told, so it
  overwrites whatever the row says (a `completed` whose commit timed out client-side,
  or a sweep's `PROCESS_LOST`); the pipeline sends the terminal event only after it.
- A terminal write the database did not take is kept and retried in the background
  (`defer`) until it does: the row follows the client as soon as the database is back.
- A `running` write that failed refuses the scan, yet a hung server may still commit it
  once it answers: a terminal write for it (failed, DATABASE_UNAVAILABLE) is deferred
  the same way, and matches no row if none was written.
- Rows of a process that died are found by `sweep_lost`: every process tags its
  connections with its instance id (`app.db.pool.instance_tag`), so a `running` row
  whose instance has no connection left belongs to a dead process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import asyncpg
import orjson

from app.db.batch import GroupCommit
from app.db.pool import DB_ERRORS, INSTANCE_TAG_PREFIX, database_error, row_error
from app.db.restarts import read, write
from app.errors import DatabaseError, DatabaseUnavailable, ProcessLost, retryable_scan_codes
from app.runtime import tracing

if TYPE_CHECKING:
    from app.db.pool import DbConn

log = logging.getLogger(__name__)

_INSERT = """
    INSERT INTO scans (id, user_id, status, image_source, image_sha256, user_input, instance_id,
                       idempotency_scope, idempotency_key, request_sha256, token_sha256, retry_of)
    VALUES ($1, $2, 'running', $3, $4, $5, $6, $7, $8, $9, $10, $11)"""

# Plain inserts (no idempotency key, no retry: nothing to conflict with), many at once
# (app/db/batch.py). JSON and arrays travel as text: asyncpg reads a list inside an
# array parameter as another dimension.
_INSERT_MANY = """
    INSERT INTO scans (id, user_id, status, image_source, image_sha256, user_input, instance_id, token_sha256)
    SELECT r.id, r.user_id, 'running', r.image_source, r.image_sha256, r.user_input, $6, r.token_sha256
    FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $7::text[])
        AS r(id, user_id, image_source, image_sha256, user_input, token_sha256)"""

# A retry takes the key from the scan it retries, which must have ended (retryably: the
# caller checked); a concurrent retry that took it first leaves nothing to take here, and
# its new row then wins the unique index.
_RELEASE_KEY = """
    UPDATE scans SET idempotency_key = NULL
    WHERE id = $1 AND idempotency_scope = $2 AND idempotency_key = $3 AND status <> 'running'"""

_LOAD = """
    SELECT id, user_id, status, created_at, finished_at, event_log, token_sha256, retry_of,
           instance_id, error_step, error_code, error_message
    FROM scans WHERE id = $1"""

# A key is reusable once its scan is older than the TTL: the old row lets go of it.
_EXPIRE_KEY = """
    UPDATE scans SET idempotency_key = NULL
    WHERE idempotency_scope = $1 AND idempotency_key = $2
      AND created_at < now() - make_interval(secs => $3)"""

_FIND_KEY = """
    SELECT id, request_sha256, status, error_code
    FROM scans WHERE idempotency_scope = $1 AND idempotency_key = $2"""

_PURGE = """
    DELETE FROM scans WHERE id IN (
        SELECT id FROM scans WHERE created_at < now() - make_interval(secs => $1 * 86400)
        AND status <> 'running' LIMIT $2)"""

# Terminal rows, many at once; the ids it returns are the rows it found.
_FINISH_MANY = """
    UPDATE scans AS s SET
        status = r.status, classification = r.classification::jsonb,
        situation_tags = r.situation_tags::jsonb, disposal_rules = r.disposal_rules::jsonb,
        answer = r.answer::jsonb, reward = r.reward::jsonb, timings = r.timings::jsonb,
        error_step = r.error_step, error_code = r.error_code, error_message = r.error_message,
        event_log = r.event_log::json, cost_usd = r.cost_usd::numeric, finished_at = now()
    FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                $8::text[], $9::text[], $10::text[], $11::text[], $12::text[], $13::text[])
        AS r(id, status, classification, situation_tags, disposal_rules, answer, reward, timings,
             error_step, error_code, error_message, event_log, cost_usd)
    WHERE s.id = r.id
    RETURNING s.id"""

_FINISH = """
    UPDATE scans SET
        status = $2, classification = $3, situation_tags = $4, disposal_rules = $5,
        answer = $6, reward = $7, timings = $8, error_step = $9, error_code = $10,
        error_message = $11, event_log = $12, cost_usd = $13::numeric, finished_at = now()
    WHERE id = $1"""

# A row is lost when its instance holds no connection, and that instance must have had
# one to this server: the row was written since the server started, or the server has
# been up long enough for every live instance to have reconnected after a restart.
_SWEEP = f"""
    UPDATE scans SET status = 'failed', error_step = 'server', error_code = $2,
        error_message = $3, finished_at = now()
    WHERE status = 'running'
      AND instance_id IS DISTINCT FROM $1
      AND (instance_id IS NULL OR '{INSTANCE_TAG_PREFIX}' || instance_id::text NOT IN (
            SELECT application_name FROM pg_stat_activity
            WHERE application_name LIKE '{INSTANCE_TAG_PREFIX}%'))
      AND (created_at > pg_postmaster_start_time()
           OR now() - pg_postmaster_start_time() > make_interval(secs => $4))
      AND (instance_id IS NULL OR NOT instance_id::text = ANY(string_to_array($5, ',')))
    RETURNING id"""

_NO_CONNECTION = f"""
    '{INSTANCE_TAG_PREFIX}' || $2::text NOT IN (
        SELECT application_name FROM pg_stat_activity
        WHERE application_name LIKE '{INSTANCE_TAG_PREFIX}%')"""

# Takeover (app/scans/liveness.py): the running scans of a dead instance become this
# one's. The instance column decides: of replicas claiming at once, each row goes to one
# (SKIP LOCKED spreads them; the outer WHERE re-checks after a wait). Its lease lapsed
# in Redis *and* it holds no connection here: two witnesses, so a live process cut off
# from Redis alone never has its scans run twice.
_CLAIM = f"""
    UPDATE scans SET instance_id = $1
    WHERE id IN (
        SELECT id FROM scans WHERE status = 'running' AND instance_id = $2 AND {_NO_CONNECTION}
        ORDER BY created_at LIMIT $3 FOR UPDATE SKIP LOCKED)
      AND status = 'running' AND instance_id = $2
    RETURNING id, user_id, created_at, token_sha256"""

_RUNS_ANY = "SELECT EXISTS (SELECT 1 FROM scans WHERE status = 'running' AND instance_id = $1)"

RETRYABLE_CODES = retryable_scan_codes()
# A write's span (app/runtime/tracing.py), named and described as the database conventions say.
INSERT_SPAN = {"db.system.name": "postgresql", "db.operation.name": "INSERT", "db.collection.name": "scans"}
UPDATE_SPAN = {**INSERT_SPAN, "db.operation.name": "UPDATE"}

# Deferred terminal writes: first retry soon, then back off to a steady pace.
DEFER_FIRST_RETRY_S = 0.5
DEFER_MAX_RETRY_S = 5.0


@dataclass(frozen=True)
class TerminalRow:
    status: str  # completed | failed | cancelled
    result: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] | None = None
    error: tuple[str, str, str] | None = None  # (step, code, message)
    events: str | None = None  # the event log as sent, terminal event included (EventLog.to_json)
    cost_usd: float | None = None  # what its upstream calls cost; None: unknown (app/upstream/prices.py)

    def text_args(self) -> tuple[str | None, ...]:
        """`args` with the JSON values as text (`_FINISH_MANY`'s columns)."""
        status, *values = self.args()
        return (status, *(_json_text(v) for v in values[:6]), *values[6:])

    def args(self) -> tuple[Any, ...]:
        r = self.result
        step, code, message = self.error or (None, None, None)
        return (
            self.status,
            r.get("classification"),
            r.get("situation_tags"),
            r.get("disposal_rules"),
            r.get("answer"),
            r.get("reward"),
            self.timings,
            step,
            code,
            message,
            self.events,
            None if self.cost_usd is None else repr(self.cost_usd),  # as text: numeric, exactly
        )


def _json_text(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


@dataclass(frozen=True)
class _NewRow:
    """A plain `running` row, for `_INSERT_MANY`."""

    id: uuid.UUID
    user_id: str | None
    image_source: str
    image_sha256: str | None
    user_input: str | None
    token_sha256: str | None


# What a scan refused because its `running` row could not be written records, should the
# row appear after all: the client was told DATABASE_UNAVAILABLE.
_REFUSED_ROW = TerminalRow(
    "failed", error=("server", DatabaseUnavailable.code, DatabaseUnavailable.default_message)
)


@dataclass(frozen=True)
class StoredScan:
    id: uuid.UUID
    user_id: str | None
    status: str
    created_at: datetime
    finished_at: datetime | None
    event_log: str | None
    token_sha256: str | None
    retry_of: uuid.UUID | None = None  # the attempt this one retries (same Idempotency-Key)
    instance_id: uuid.UUID | None = None  # the process that runs (ran) it
    error_step: str | None = None
    error_code: str | None = None
    error_message: str | None = None


@dataclass(frozen=True)
class IdempotencyClaim:
    """A POST's `Idempotency-Key`, scoped to its caller, and what its request hashed to."""

    scope: str
    key: str
    request_sha256: str


class KeyTaken(Exception):
    """The idempotency key already names a scan (`scan_id`), which is `status` now (its
    `error_code` if it failed)."""

    def __init__(
        self,
        scan_id: uuid.UUID,
        request_sha256: str | None,
        status: str = "running",
        error_code: str | None = None,
    ) -> None:
        super().__init__(str(scan_id))
        self.scan_id = scan_id
        self.request_sha256 = request_sha256
        self.status = status
        self.error_code = error_code

    @property
    def ended_retryably(self) -> bool:
        """Its scan ended with an error a retry may cure: the key starts a new attempt."""
        return self.status in ("failed", "cancelled") and self.error_code in RETRYABLE_CODES


class ScanStore:
    def __init__(
        self, pool: asyncpg.Pool[asyncpg.Record], *, instance_id: uuid.UUID, timeout_s: float
    ) -> None:
        self.instance_id = instance_id
        self._pool = pool
        self._timeout_s = timeout_s
        self._deferred: dict[uuid.UUID, TerminalRow] = {}
        self._retrying: asyncio.Task[None] | None = None
        self._inserts = GroupCommit(self._insert_many, error=database_error, split=row_error)
        self._finishes = GroupCommit(self._finish_many, error=database_error, split=row_error)

    @property
    def deferred(self) -> int:
        """Terminal rows waiting for the database."""
        return len(self._deferred)

    async def create(
        self,
        scan_id: uuid.UUID,
        *,
        user_id: str | None,
        image_source: str,
        image_sha256: str | None,
        user_input: str | None,
        claim: IdempotencyClaim | None = None,
        token_sha256: str | None = None,
        retry_of: uuid.UUID | None = None,
    ) -> None:
        """Insert the `running` row; `KeyTaken` if `claim`'s key names another scan
        (the unique index decides, so concurrent duplicates cannot both insert). With
        `retry_of`, the key is first taken from that ended scan, in one transaction."""
        key = (claim.scope, claim.key, claim.request_sha256) if claim else (None, None, None)
        args = (
            scan_id,
            user_id,
            image_source,
            image_sha256,
            user_input,
            self.instance_id,
            *key,
            token_sha256,
            retry_of,
        )
        try:
            if claim is None and retry_of is None:
                row = _NewRow(scan_id, user_id, image_source, image_sha256, user_input, token_sha256)
                await self._inserts.submit(row)
            elif retry_of is None or claim is None:
                await self._execute(_INSERT, *args)
            else:
                await self._retry(retry_of, claim, args)
        except asyncio.CancelledError:
            self.defer(scan_id, _REFUSED_ROW)  # its INSERT may commit yet: no row stays `running`
            raise
        except DatabaseError as exc:
            if claim is None or not isinstance(exc.__cause__, asyncpg.UniqueViolationError):
                # The scan is refused (503), but an INSERT that timed out here may still
                # commit once a hung server answers again: that row is failed in the
                # background (no row: the write matches none).
                self.defer(scan_id, _REFUSED_ROW)
                raise
            taken = await self.find_key(claim)
            if taken is None:  # its scan was purged in between: a rare retry
                raise
            raise taken from None

    async def find_key(self, claim: IdempotencyClaim, ttl_s: float | None = None) -> KeyTaken | None:
        """The scan `claim`'s key already names, if any (expiring it first if `ttl_s`)."""
        if ttl_s is not None:
            await self._execute(_EXPIRE_KEY, claim.scope, claim.key, ttl_s)
        rows = await self._read(_FIND_KEY, claim.scope, claim.key)
        return KeyTaken(*rows[0].values()) if rows else None

    async def _retry(self, retry_of: uuid.UUID, claim: IdempotencyClaim, args: tuple[Any, ...]) -> None:
        try:
            async with self._pool.acquire(timeout=self._timeout_s) as conn, conn.transaction():
                await conn.execute(_RELEASE_KEY, retry_of, claim.scope, claim.key, timeout=self._timeout_s)
                await conn.execute(_INSERT, *args, timeout=self._timeout_s)
        except DB_ERRORS as exc:
            raise DatabaseError() from exc

    async def load(self, scan_id: uuid.UUID) -> StoredScan | None:
        rows = await self._read(_LOAD, scan_id)
        return StoredScan(**dict(rows[0])) if rows else None

    async def purge(self, *, older_than_days: float, batch: int) -> int:
        """Delete up to `batch` finished scans older than the retention; how many."""
        status = await self._execute(_PURGE, older_than_days, batch)
        return int(status.split()[-1])

    async def finish(self, scan_id: uuid.UUID, row: TerminalRow) -> None:
        """Write the terminal row once; `DatabaseError` if the database did not take it."""
        self._deferred.pop(scan_id, None)  # this write supersedes any older one
        with tracing.span("UPDATE scans", UPDATE_SPAN, client=True):
            if not await self._finishes.submit((scan_id, row)):
                raise ProcessLost(f"scan {scan_id} has no row")

    def defer(self, scan_id: uuid.UUID, row: TerminalRow) -> None:
        """Keep writing `row` in the background until the database takes it."""
        self._deferred[scan_id] = row
        if self._retrying is None or self._retrying.done():
            self._retrying = asyncio.create_task(self._retry_deferred(), name="scan-rows-retry")

    async def sweep_lost(
        self, *, restart_grace_s: float, spared: Sequence[uuid.UUID] = ()
    ) -> list[uuid.UUID]:
        """Mark `running` rows of dead processes failed / PROCESS_LOST, but those of
        `spared` instances (their scans are for takeover to find); their ids."""
        rows = await self._fetch(
            _SWEEP,
            self.instance_id,
            ProcessLost.code,
            ProcessLost.default_message,
            restart_grace_s,
            # As text: a uuid[] parameter costs the first sweep a type introspection
            # round trip, which start-up should not wait for.
            ",".join(str(instance) for instance in spared),
        )
        return [r["id"] for r in rows]

    async def claim_orphans(self, dead: uuid.UUID, limit: int) -> list[asyncpg.Record]:
        """Up to `limit` running scans of the dead instance `dead`, now this one's
        (`id, user_id, created_at, token_sha256`)."""
        return await self._fetch(_CLAIM, self.instance_id, dead, limit)

    async def runs_any(self, instance: uuid.UUID) -> bool:
        """Whether `instance` still has a `running` row."""
        rows = await self._read(_RUNS_ANY, instance)
        return bool(rows[0][0])

    async def close(self, timeout_s: float) -> None:
        """Shutdown: one last bounded try for the deferred rows, then give up on them
        (the next process's sweep records them as PROCESS_LOST)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._inserts.close()
                await self._finishes.close()
        if self._retrying is not None:
            self._retrying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retrying
        if self._deferred:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._write_deferred()
        if self._deferred:
            log.error("%d terminal scan rows could not be written before exit", len(self._deferred))

    async def _retry_deferred(self) -> None:
        delay = DEFER_FIRST_RETRY_S
        while self._deferred:
            await asyncio.sleep(delay)
            await self._write_deferred()
            delay = min(delay * 2, DEFER_MAX_RETRY_S)

    async def _write_deferred(self) -> None:
        for scan_id, row in list(self._deferred.items()):
            try:
                await self._execute(_FINISH, scan_id, *row.args())
            except DatabaseError:
                return  # still down: try again later, in order
            if self._deferred.get(scan_id) is row:
                del self._deferred[scan_id]
            log.info("scan %s: terminal row %s recorded after a database outage", scan_id, row.status)

    async def _insert_many(self, rows: Sequence[_NewRow]) -> list[None]:
        columns = [[getattr(r, name) for r in rows] for name in _NewRow.__dataclass_fields__]
        token_sha256 = columns.pop()
        await self._execute(_INSERT_MANY, *columns, self.instance_id, token_sha256)
        return [None] * len(rows)

    async def _finish_many(self, rows: Sequence[tuple[uuid.UUID, TerminalRow]]) -> list[bool]:
        """Whether each scan's row was there to take its end."""
        values = [(scan_id, *row.text_args()) for scan_id, row in rows]
        found = {
            r["id"] for r in await self._fetch(_FINISH_MANY, *(list(c) for c in zip(*values, strict=True)))
        }
        return [scan_id in found for scan_id, _ in rows]

    # Across a database restart (app/db/restarts.py), a read is sent again on a fresh
    # connection, a write only if it was never sent; `DatabaseError` when it cannot be done.
    async def _execute(self, query: str, *args: Any) -> str:
        async def statement(conn: DbConn) -> str:
            status: str = await conn.execute(query, *args, timeout=self._timeout_s)
            return status

        return await write(self._pool, statement, timeout_s=self._timeout_s)

    async def _read(self, query: str, *args: Any) -> list[asyncpg.Record]:
        return await read(
            self._pool,
            lambda conn: conn.fetch(query, *args, timeout=self._timeout_s),
            timeout_s=self._timeout_s,
        )

    async def _fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        """A statement that writes and returns rows."""
        return await write(
            self._pool,
            lambda conn: conn.fetch(query, *args, timeout=self._timeout_s),
            timeout_s=self._timeout_s,
        )
