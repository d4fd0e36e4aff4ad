"""The asyncpg pool every query goes through: its codecs, its session policy, and the
instance tag that tells other processes which connections are alive."""

from __future__ import annotations

import urllib.parse
import uuid
from typing import TYPE_CHECKING

import asyncpg
import orjson

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    # A plain connection or one borrowed from the pool: both run queries the same way.
    DbConn = asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]

# Errors that mean "the database did not do it", as opposed to our own bugs
# (TimeoutError, from a bounded acquire or query, is an OSError).
DB_ERRORS: tuple[type[Exception], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    OSError,
)


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
