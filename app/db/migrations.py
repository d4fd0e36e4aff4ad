"""Migrations: the SQL files in `app/data/migrations`, applied in name order at start-up
under an advisory lock so two workers starting together apply them once. Each file is
idempotent, and a file is re-applied when its text changes (its checksum is recorded), so
editing seed data takes effect on restart."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

log = logging.getLogger(__name__)


if TYPE_CHECKING:
    from app.db.pool import DbConn

# Any constant works; it only has to be the same in every worker.
_MIGRATION_LOCK_ID = 0x6563_6F73_6361_6E


@dataclass(frozen=True)
class Migration:
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def bundled_migrations() -> list[Migration]:
    folder = resources.files("app") / "data" / "migrations"
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name)
    return [Migration(f.name, f.read_text(encoding="utf-8")) for f in files]


async def apply_migrations(conn: DbConn, migrations: list[Migration]) -> list[str]:
    """Apply what is new or changed; return the names applied."""
    applied: list[str] = []
    await conn.execute("SELECT pg_advisory_lock($1)", _MIGRATION_LOCK_ID)
    try:
        await conn.execute(
            """CREATE TABLE IF NOT EXISTS schema_migrations (
                   name text PRIMARY KEY,
                   checksum text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"""
        )
        done = {
            r["name"]: r["checksum"] for r in await conn.fetch("SELECT name, checksum FROM schema_migrations")
        }
        for m in migrations:
            if done.get(m.name) == m.checksum:
                continue
            async with conn.transaction():
                await conn.execute(m.sql)
                await conn.execute(
                    """INSERT INTO schema_migrations (name, checksum) VALUES ($1, $2)
                       ON CONFLICT (name) DO UPDATE
                       SET checksum = EXCLUDED.checksum, applied_at = now()""",
                    m.name,
                    m.checksum,
                )
            applied.append(m.name)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _MIGRATION_LOCK_ID)
    return applied
