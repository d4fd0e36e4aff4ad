"""The `scans` table: one row per accepted scan, written twice — `running` when the
scan is accepted (before the stream starts, so a database outage is a clean 503),
and once more with its terminal status. Nothing accepted goes unrecorded."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg

from app.errors import DatabaseError

_INSERT = """
    INSERT INTO scans (id, user_id, status, image_source, image_sha256, user_input)
    VALUES ($1, $2, 'running', $3, $4, $5)"""

_FINISH = """
    UPDATE scans SET
        status = $2, classification = $3, situation_tags = $4, disposal_rules = $5,
        answer = $6, reward = $7, timings = $8, error_step = $9, error_code = $10,
        error_message = $11, finished_at = now()
    WHERE id = $1 AND status = 'running'"""

# Errors that mean "the database did not do it", as opposed to our own bugs.
DB_ERRORS: tuple[type[Exception], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    OSError,
)


class ScanStore:
    def __init__(self, pool: asyncpg.Pool[asyncpg.Record]) -> None:
        self._pool = pool

    async def create(
        self,
        scan_id: uuid.UUID,
        *,
        user_id: str | None,
        image_source: str,
        image_sha256: str | None,
        user_input: str | None,
    ) -> None:
        try:
            await self._pool.execute(_INSERT, scan_id, user_id, image_source, image_sha256, user_input)
        except DB_ERRORS as exc:
            raise DatabaseError() from exc

    async def finish(
        self,
        scan_id: uuid.UUID,
        status: str,
        *,
        result: dict[str, Any] | None = None,
        timings: dict[str, Any] | None = None,
        error: tuple[str | None, str, str] | None = None,  # (step, code, message)
    ) -> bool:
        """Record the terminal status; False if the row was already terminal."""
        r = result or {}
        step, code, message = error or (None, None, None)
        try:
            status_line = await self._pool.execute(
                _FINISH,
                scan_id,
                status,
                r.get("classification"),
                r.get("situation_tags"),
                r.get("disposal_rules"),
                r.get("answer"),
                r.get("reward"),
                timings,
                step,
                code,
                message,
            )
        except DB_ERRORS as exc:
            raise DatabaseError() from exc
        return status_line.endswith(" 1")
