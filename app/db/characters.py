"""A user's collection of characters (what the reward stage records), read back."""

from __future__ import annotations

from typing import Any

import asyncpg

from app.db.pool import DB_ERRORS
from app.errors import DatabaseUnavailable

_COLLECTION = """
    SELECT c.code, c.name, c.dialog, o.acquired_at, o.scan_id
    FROM character_ownership o JOIN characters c ON c.code = o.character_code
    WHERE o.user_id = $1
    ORDER BY o.acquired_at DESC"""


class Collections:
    def __init__(self, pool: asyncpg.Pool[asyncpg.Record], *, timeout_s: float) -> None:
        self._pool = pool
        self._timeout_s = timeout_s

    async def of(self, user_id: str) -> list[dict[str, Any]]:
        try:
            async with self._pool.acquire(timeout=self._timeout_s) as conn:
                rows = await conn.fetch(_COLLECTION, user_id, timeout=self._timeout_s)
        except DB_ERRORS:
            raise DatabaseUnavailable() from None
        return [
            {
                "code": r["code"],
                "name": r["name"],
                "dialog": r["dialog"],
                "acquired_at": r["acquired_at"].isoformat(),
                "scan_id": str(r["scan_id"]),
            }
            for r in rows
        ]
