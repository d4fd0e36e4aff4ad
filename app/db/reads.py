"""Reads that ride out a database restart.

A restart (`pg_ctl restart -m fast`, a failover) breaks every pooled connection at once
and refuses new ones for a moment ("the database system is starting up"). A read is safe
to send again, so one that meets such a failure is sent again on a fresh connection until
it succeeds or `DB_TIMEOUT_S`, counted from its first attempt, runs out; then it fails as
the retryable `DatabaseError`. A write is not repeated here: one whose reply was lost may
have committed (the terminal rows have their own retry, app/scans/store.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import asyncpg

from app.db.pool import DB_ERRORS
from app.errors import DatabaseError

if TYPE_CHECKING:
    from app.db.pool import DbConn

__all__ = ["broken_connection", "read"]

T = TypeVar("T")

# Pauses between attempts: the first short (a fast restart takes well under a second),
# doubled up to the last, so a server that stays away is not hammered.
FIRST_PAUSE_S = 0.05
MAX_PAUSE_S = 0.5


def broken_connection(exc: BaseException) -> bool:
    """Did the connection or the server go away (a fresh connection may succeed), rather
    than the server refusing the statement or not answering in time?"""
    if isinstance(exc, TimeoutError):  # a hung server: another attempt would wait again
        return False
    if isinstance(exc, asyncpg.exceptions.InternalClientError | OSError):
        return True  # e.g. "cannot switch to state ..." on a connection the server shut
    if isinstance(exc, asyncpg.InterfaceError):
        return not isinstance(exc, ValueError)  # a bad argument is our bug, not a blip
    sqlstate = str(getattr(exc, "sqlstate", "") or "")
    # 08: connection exceptions; 57P: admin/crash shutdown, "cannot connect now".
    return sqlstate.startswith(("08", "57P"))


async def read(
    pool: asyncpg.Pool[asyncpg.Record], query: Callable[[DbConn], Awaitable[T]], *, timeout_s: float
) -> T:
    """`query(conn)` on a pooled connection, again on a fresh one after a broken
    connection, all within `timeout_s`; `DatabaseError` (its cause the last failure)
    when it cannot be done."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pause = FIRST_PAUSE_S
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                return await _attempt(pool, query, deadline - loop.time())
        except DB_ERRORS as exc:
            if not broken_connection(exc) or loop.time() + pause >= deadline:
                raise DatabaseError() from exc
        await asyncio.sleep(pause)
        pause = min(pause * 2, MAX_PAUSE_S)


async def _attempt(
    pool: asyncpg.Pool[asyncpg.Record], query: Callable[[DbConn], Awaitable[T]], timeout_s: float
) -> T:
    async with pool.acquire(timeout=timeout_s) as conn:
        try:
            return await query(conn)
        except DB_ERRORS as exc:
            if broken_connection(exc):
                conn.terminate()  # released closed: the pool opens a fresh one in its place
            raise
