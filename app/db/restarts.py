"""Statements that ride out a database restart.

A restart (`pg_ctl restart -m fast`, a failover) breaks every pooled connection at once
and refuses new ones for a moment ("the database system is starting up"). Within
`DB_TIMEOUT_S`, counted from the first attempt, a statement is sent again on a fresh
connection after such a failure:
- `read`: whenever it met one, before or after it was sent (reading twice is harmless);
- `write`: only when it was never sent (the failure came while taking a connection): a
  write whose reply was lost may have committed.
Taking a connection is bounded by what is left of that window, the statement by its own
timeout (as before: at most `DB_TIMEOUT_S` for the connection and as much for the
statement). What cannot be done fails as the retryable `DatabaseError`, its cause the
last failure.
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

__all__ = ["broken_connection", "read", "write"]

T = TypeVar("T")
Statement = Callable[["DbConn"], Awaitable[T]]

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


async def read(pool: asyncpg.Pool[asyncpg.Record], statement: Statement[T], *, timeout_s: float) -> T:
    """`statement(conn)`, again on a fresh connection after a broken one, within `timeout_s`."""
    return await _ride(pool, statement, timeout_s, repeatable=True)


async def write(pool: asyncpg.Pool[asyncpg.Record], statement: Statement[T], *, timeout_s: float) -> T:
    """`statement(conn)`, again only if no connection could be had, within `timeout_s`."""
    return await _ride(pool, statement, timeout_s, repeatable=False)


async def _ride(
    pool: asyncpg.Pool[asyncpg.Record], statement: Statement[T], timeout_s: float, *, repeatable: bool
) -> T:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pause = FIRST_PAUSE_S
    while True:
        sent = False
        try:
            async with pool.acquire(timeout=max(deadline - loop.time(), 0.0)) as conn:
                sent = True
                try:
                    return await statement(conn)
                except DB_ERRORS as exc:
                    if broken_connection(exc):
                        conn.terminate()  # released closed: the pool opens a fresh one in its place
                    raise
        except DB_ERRORS as exc:
            again = broken_connection(exc) and (repeatable or not sent)
            if not again or loop.time() + pause >= deadline:
                raise DatabaseError() from exc
        await asyncio.sleep(pause)
        pause = min(pause * 2, MAX_PAUSE_S)
