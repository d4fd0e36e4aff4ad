"""The asyncpg pool every query goes through: its codecs, its session policy, and the
instance tag that tells other processes which connections are alive."""

from __future__ import annotations

import urllib.parse
import uuid
from typing import TYPE_CHECKING

import asyncpg
import orjson

from app.db.batch import DrainCancelled
from app.errors import DatabaseError

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    # A plain connection or one borrowed from the pool: both run queries the same way.
    DbConn = asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]

# Errors that mean "the database did not do it", as opposed to our own bugs
# (TimeoutError, from a bounded acquire or query, is an OSError). asyncpg's
# InternalClientError derives from Exception alone, yet a restart raises it: a pooled
# connection that received the server's shutdown as a query began ("cannot switch to
# state 12; another operation (2) is in progress").
DB_ERRORS: tuple[type[Exception], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
)


def database_error(exc: Exception) -> Exception:
    """What each write of a batch that failed raises (app/db/batch.py): a `DatabaseError`
    of its own, the database's error its cause (our own bug raises as itself: a failed
    batch that was ours to blame is split, so it has one caller)."""
    cause = exc.__cause__ if isinstance(exc, DatabaseError) else exc
    if not isinstance(exc, DatabaseError) and not isinstance(cause, (*DB_ERRORS, DrainCancelled)):
        return exc
    error = DatabaseError()
    error.__cause__ = cause
    return error


def row_error(exc: Exception) -> bool:
    """Could one row of a failed batch be the cause (the server refused the statement for
    its data, or our code failed on it), rather than the database being away: no
    connection, a timeout, the server shutting down (SQLSTATE classes 08 and 57)?"""
    cause = exc.__cause__ if isinstance(exc, DatabaseError) else exc
    if isinstance(
        cause, OSError | asyncpg.InterfaceError | asyncpg.exceptions.InternalClientError | DrainCancelled
    ):
        return False
    return str(getattr(cause, "sqlstate", "") or "")[:2] not in ("08", "57")


# `DB_POOL_MAX=auto`: at most this many connections, and at most half of what the server
# had free when the process started (replicas starting together then leave each other
# room: a half, a quarter...). A scan holds a connection only for single statements, but
# each is held until the loop reads its reply: with thousands of scans in flight the loop
# lags, so the scans' writes also go many to a statement (app/db/batch.py).
AUTO_POOL_MAX = 64


async def pool_size(dsn: str, *, min_size: int, cap: int | None, timeout_s: float) -> int:
    """`DB_POOL_MAX=auto`'s size: half the server's free connections, within
    [min_size, min(cap, AUTO_POOL_MAX)]."""
    conn = await asyncpg.connect(dsn, timeout=timeout_s)
    try:
        free = await conn.fetchval(_FREE_CONNECTIONS, timeout=timeout_s)
    finally:
        await conn.close(timeout=timeout_s)
    most = min(cap, AUTO_POOL_MAX) if cap is not None else AUTO_POOL_MAX
    return max(min_size, min(most, int(free) // 2))


# Client connections the server can still take (background workers not counted).
_FREE_CONNECTIONS = """
SELECT current_setting('max_connections')::int
     - current_setting('superuser_reserved_connections')::int
     - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')
"""


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
        reset=_keep_session,
    )


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """What a released connection gets beyond asyncpg's own cleanup (an open transaction
    rolled back, listeners dropped): nothing. The default reset query (`SELECT
    pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL`) is one more round trip
    per release, three per scan, for session state this service never leaves on a pooled
    connection: LISTEN has its own connection (app/stages/rule.py), the migration lock is
    released where it is taken, and nothing SETs session variables."""


# Every connection of a process carries this tag and its instance id as its
# `application_name`, which is how other processes tell a live one from a dead one.
INSTANCE_TAG_PREFIX = "ecoscan "


def instance_tag(instance_id: uuid.UUID) -> str:
    return f"{INSTANCE_TAG_PREFIX}{instance_id}"


def tagged_dsn(dsn: str, instance_id: uuid.UUID) -> str:
    """`dsn` with `application_name` set to this instance's tag (asyncpg passes unknown
    query parameters on as server settings)."""
    parts = urllib.parse.urlsplit(dsn)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k != "application_name"]
    query.append(("application_name", instance_tag(instance_id)))
    return urllib.parse.urlunsplit(
        parts._replace(query=urllib.parse.urlencode(query, quote_via=urllib.parse.quote))
    )


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb", encoder=_jsonb_binary, decoder=_jsonb_value, schema="pg_catalog", format="binary"
    )


def _jsonb_binary(value: object) -> bytes:
    """A jsonb parameter in PostgreSQL's binary format: a version byte (1), then the JSON
    text (orjson: compact UTF-8, no str round trip)."""
    return b"\x01" + orjson.dumps(value)


def _jsonb_value(data: bytes) -> object:
    return orjson.loads(data[1:])
