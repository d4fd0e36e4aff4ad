"""The `scans` table: one row per accepted scan, written twice — `running` when the
scan is accepted (before the stream starts, so a database outage is a clean 503),
and once more with its terminal status. Nothing accepted goes unrecorded, and no
row stays `running`:

- The terminal write is the process's word on what the client was told, so it
  overwrites whatever the row says (a `completed` whose commit timed out client-side,
  or a sweep's `PROCESS_LOST`); the pipeline sends the terminal event only after it.
- A terminal write the database did not take is kept and retried in the background
  (`defer`) until it does: the row follows the client as soon as the database is back.
- Rows of a process that died are found by `sweep_lost`: every process tags its
  connections with its instance id (`app.database.instance_tag`), so a `running` row
  whose instance has no connection left belongs to a dead process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from app.database import INSTANCE_TAG_PREFIX
from app.errors import DatabaseError, ProcessLost

log = logging.getLogger(__name__)

_INSERT = """
    INSERT INTO scans (id, user_id, status, image_source, image_sha256, user_input, instance_id)
    VALUES ($1, $2, 'running', $3, $4, $5, $6)"""

_FINISH = """
    UPDATE scans SET
        status = $2, classification = $3, situation_tags = $4, disposal_rules = $5,
        answer = $6, reward = $7, timings = $8, error_step = $9, error_code = $10,
        error_message = $11, finished_at = now()
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
    RETURNING id"""

# Errors that mean "the database did not do it", as opposed to our own bugs
# (TimeoutError, from a bounded acquire or query, is an OSError).
DB_ERRORS: tuple[type[Exception], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    OSError,
)

# Deferred terminal writes: first retry soon, then back off to a steady pace.
DEFER_FIRST_RETRY_S = 0.5
DEFER_MAX_RETRY_S = 5.0


@dataclass(frozen=True)
class TerminalRow:
    status: str  # completed | failed | cancelled
    result: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] | None = None
    error: tuple[str, str, str] | None = None  # (step, code, message)

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
        )


class ScanStore:
    def __init__(
        self, pool: asyncpg.Pool[asyncpg.Record], *, instance_id: uuid.UUID, timeout_s: float
    ) -> None:
        self.instance_id = instance_id
        self._pool = pool
        self._timeout_s = timeout_s
        self._deferred: dict[uuid.UUID, TerminalRow] = {}
        self._retrying: asyncio.Task[None] | None = None

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
    ) -> None:
        args = (scan_id, user_id, image_source, image_sha256, user_input, self.instance_id)
        await self._execute(_INSERT, *args)

    async def finish(self, scan_id: uuid.UUID, row: TerminalRow) -> None:
        """Write the terminal row once; `DatabaseError` if the database did not take it."""
        self._deferred.pop(scan_id, None)  # this write supersedes any older one
        status_line = await self._execute(_FINISH, scan_id, *row.args())
        if not status_line.endswith(" 1"):
            raise ProcessLost(f"scan {scan_id} has no row")

    def defer(self, scan_id: uuid.UUID, row: TerminalRow) -> None:
        """Keep writing `row` in the background until the database takes it."""
        self._deferred[scan_id] = row
        if self._retrying is None or self._retrying.done():
            self._retrying = asyncio.create_task(self._retry_deferred(), name="scan-rows-retry")

    async def sweep_lost(self, *, restart_grace_s: float) -> list[uuid.UUID]:
        """Mark `running` rows of dead processes failed / PROCESS_LOST; their ids."""
        rows = await self._fetch(
            _SWEEP, self.instance_id, ProcessLost.code, ProcessLost.default_message, restart_grace_s
        )
        return [r["id"] for r in rows]

    async def close(self, timeout_s: float) -> None:
        """Shutdown: one last bounded try for the deferred rows, then give up on them
        (the next process's sweep records them as PROCESS_LOST)."""
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

    async def _execute(self, query: str, *args: Any) -> str:
        try:
            async with self._pool.acquire(timeout=self._timeout_s) as conn:
                status: str = await conn.execute(query, *args, timeout=self._timeout_s)
                return status
        except DB_ERRORS as exc:
            raise DatabaseError() from exc

    async def _fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        try:
            async with self._pool.acquire(timeout=self._timeout_s) as conn:
                return await conn.fetch(query, *args, timeout=self._timeout_s)
        except DB_ERRORS as exc:
            raise DatabaseError() from exc
