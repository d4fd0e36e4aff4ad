"""PostgreSQL: where the server comes from, the asyncpg pool, and migrations.

With no `DATABASE_URL` the service runs an embedded PostgreSQL from the `pgserver`
package (server binaries shipped in the wheel, data in a local directory reused
across runs). Migrations are the SQL files in `app/data/migrations`, applied in
name order at start-up under an advisory lock so two workers starting together
apply them once. Each file is idempotent, and a file is re-applied when its text
changes (its checksum is recorded), so editing seed data takes effect on restart.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    # A plain connection or one borrowed from the pool: both run queries the same way.
    DbConn = asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]

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


class EmbeddedPostgres:
    """A pgserver-managed PostgreSQL. Starting it blocks (initdb, pg_ctl), so it runs
    in a thread; it is stopped when the last process using the data directory exits."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        self._server: Any = None

    async def start(self) -> str:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self._server = await asyncio.to_thread(self._start_blocking)
        uri: str = self._server.get_uri()
        return uri

    def _start_blocking(self) -> Any:
        from pgserver import get_server  # type: ignore[attr-defined]  # lazily: only embedded mode needs it

        return get_server(self.data_dir, cleanup_mode="stop")

    async def stop(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await asyncio.to_thread(server.cleanup)


async def create_pool(
    dsn: str, *, min_size: int, max_size: int, timeout_s: float
) -> asyncpg.Pool[asyncpg.Record]:
    return await asyncpg.create_pool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        command_timeout=timeout_s,
        timeout=timeout_s,
        # JSON columns come back as Python objects, not strings.
        init=_init_connection,
    )


async def _init_connection(conn: asyncpg.Connection) -> None:
    import json

    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
