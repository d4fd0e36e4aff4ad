"""The rule cache's LISTEN connection against a real PostgreSQL: it comes back after its
backend is killed, the cache is dropped when it does, cached rules live only briefly
while it is down, and `close()` stops a reconnect in progress.

The listener logs in as a role of its own, so a test can find and kill exactly its
backend (`pg_terminate_backend`) and hold it down (`ALTER ROLE ... NOLOGIN`, which makes
every reconnect attempt fail the way a restarting server does). Time is a `FakeClock`:
the cache's age and the reconnect backoff move only when a test advances it, so the
TTL assertions depend on no real delay.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest

from app.db.migrations import apply_migrations, bundled_migrations
from app.db.pool import create_pool
from app.db.taxonomy import Classification, load_taxonomy
from app.limits.clock import FakeClock
from app.runtime.metrics import Metrics
from app.stages.rule import (
    LISTENER_DOWN_TTL_S,
    LISTENER_INITIAL_BACKOFF_S,
    LISTENER_MAX_BACKOFF_S,
    RuleBook,
)

from .conftest import eventually

PAPER = Classification("재활용폐기물", "종이", "신문지")
WAIT_ATTEMPTS = 1000
WAIT_INTERVAL_S = 0.01


@dataclass
class Listener:
    """A RuleBook whose LISTEN connection logs in as `role`, plus the means to kill it."""

    book: RuleBook
    clock: FakeClock
    metrics: Metrics
    role: str
    admin: asyncpg.Connection

    @property
    def gauge(self) -> float | None:
        return self.metrics.registry.get_sample_value("ecoscan_rules_listener_up")

    async def backend_pids(self) -> list[int]:
        rows = await self.admin.fetch("SELECT pid FROM pg_stat_activity WHERE usename = $1", self.role)
        return [r["pid"] for r in rows]

    async def kill_backend(self) -> int:
        [pid] = await self.backend_pids()
        assert await self.admin.fetchval("SELECT pg_terminate_backend($1)", pid)
        return pid

    async def refuse_logins(self) -> None:
        await self.admin.execute(f'ALTER ROLE "{self.role}" NOLOGIN')

    async def allow_logins(self) -> None:
        await self.admin.execute(f'ALTER ROLE "{self.role}" LOGIN')


def with_user(url: str, user: str) -> str:
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}@{host}"))


@pytest.fixture
async def listener(database_url: str) -> AsyncIterator[Listener]:
    role = f"ecoscan_listener_{secrets.token_hex(3)}"
    admin = await asyncpg.connect(database_url)
    await admin.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
    await admin.execute(f'CREATE ROLE "{role}" LOGIN')
    pool = await create_pool(database_url, min_size=1, max_size=2, timeout_s=5)
    try:
        async with pool.acquire() as conn:
            await apply_migrations(conn, bundled_migrations())
            taxonomy = await load_taxonomy(conn)
        clock = FakeClock()
        book = RuleBook(pool, recyclable=taxonomy.recyclable, ttl_s=300, timeout_s=5, clock=clock)
        metrics = Metrics(process=False)
        metrics.rules_listener_up.set_function(lambda: float(book.listening))
        await book.start_listening(with_user(database_url, role))
        try:
            yield Listener(book, clock, metrics, role, admin)
        finally:
            await book.close()
    finally:
        await pool.close()
        await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        await admin.close()


async def soon(predicate: Any) -> bool:
    """`eventually` with a generous bound: reconnecting is quick, CI machines are not always."""
    return await eventually(predicate, attempts=WAIT_ATTEMPTS, interval=WAIT_INTERVAL_S)


async def hold_down(listener: Listener) -> None:
    """Kill the listener's backend while logins are refused, and wait until the
    reconnect loop has failed its first attempt and is backing off."""
    await listener.refuse_logins()
    await listener.kill_backend()
    assert await soon(lambda: not listener.book.listening)
    assert await soon(lambda: listener.clock.sleepers == 1)


async def let_it_back(listener: Listener) -> None:
    """Allow logins again and drive the backoff (fake time) until the listener is back."""
    await listener.allow_logins()

    async def back() -> bool:
        if listener.book.listening:
            return True
        if listener.clock.sleepers:  # only between attempts: time moves per failed attempt
            await listener.clock.advance(LISTENER_INITIAL_BACKOFF_S)
        return False

    assert await soon(back)


async def set_paper_title(db: asyncpg.Connection, title: str) -> dict[str, Any]:
    """Change the 종이 rule (its trigger sends NOTIFY); return the document before."""
    original: dict[str, Any] = await db.fetchval("SELECT document FROM disposal_rules WHERE middle = '종이'")
    await db.execute(
        "UPDATE disposal_rules SET document = $1 WHERE middle = '종이'", {**original, "title": title}
    )
    return original


async def restore_paper(db: asyncpg.Connection, original: dict[str, Any]) -> None:
    await db.execute("UPDATE disposal_rules SET document = $1 WHERE middle = '종이'", original)


async def paper_title(book: RuleBook) -> object:
    match = await book.find(PAPER)
    assert match.document is not None
    return match.document["title"]


async def sees_title(book: RuleBook, title: str) -> bool:
    return await paper_title(book) == title


async def test_listener_comes_back_after_its_backend_is_killed_and_notify_works_again(
    listener: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.stages.rule")
    book = listener.book
    assert book.listening and listener.gauge == 1.0
    killed = await listener.kill_backend()

    async def replaced() -> bool:
        """Listening again, on a backend that is not the killed one."""
        pids = await listener.backend_pids()
        return book.listening and bool(pids) and killed not in pids

    # The first attempt is immediate: no fake time has to pass for a killed backend.
    assert await soon(replaced)
    assert listener.gauge == 1.0

    await book.find(PAPER)
    hits = book.hits
    await book.find(PAPER)
    assert book.hits == hits + 1, "cached with the full TTL again once listening"
    marker = f"after-reconnect-{secrets.token_hex(4)}"
    original = await set_paper_title(listener.admin, marker)
    try:
        # Fake time stands still, so only the NOTIFY on the new connection can clear it.
        assert await soon(lambda: sees_title(book, marker))
    finally:
        await restore_paper(listener.admin, original)

    lost = [r for r in caplog.records if r.levelno == logging.WARNING]
    back = [r for r in caplog.records if r.levelno == logging.INFO and "reconnected" in r.getMessage()]
    assert len(lost) == 1 and "lost" in lost[0].getMessage()
    assert len(back) == 1
    assert all(r.exc_info is None for r in [*lost, *back]), "one line each, no traceback"


async def test_gauge_is_down_while_reconnecting_and_up_when_back(listener: Listener) -> None:
    await hold_down(listener)
    assert listener.gauge == 0.0 and not listener.book.listening
    # Still down after several backoff rounds: attempts fail while logins are refused.
    await listener.clock.advance(LISTENER_MAX_BACKOFF_S)
    assert listener.gauge == 0.0
    await let_it_back(listener)
    assert listener.gauge == 1.0


async def test_cached_rules_live_only_briefly_while_the_listener_is_down(listener: Listener) -> None:
    book, clock = listener.book, listener.clock
    await book.find(PAPER)
    # Listening: an entry older than the short TTL is still served from the cache.
    await clock.advance(LISTENER_DOWN_TTL_S + 1)
    hits = book.hits
    await book.find(PAPER)
    assert book.hits == hits + 1

    await hold_down(listener)
    misses = book.misses
    await book.find(PAPER)  # the same entry, now older than the short TTL: read again
    assert book.misses == misses + 1
    await book.find(PAPER)  # fresh, so served from the cache for a little while
    assert book.misses == misses + 1
    # Advancing wakes the failing reconnect loop too; logins are refused, so it stays down.
    await clock.advance(LISTENER_DOWN_TTL_S)
    assert not book.listening
    await book.find(PAPER)
    assert book.misses == misses + 2


async def test_a_change_missed_while_down_is_seen_once_the_listener_is_back(listener: Listener) -> None:
    book, clock = listener.book, listener.clock
    await hold_down(listener)
    cached_at = clock.now()
    await book.find(PAPER)
    marker = f"while-down-{secrets.token_hex(4)}"
    original = await set_paper_title(listener.admin, marker)  # its NOTIFY reaches nobody
    try:
        await let_it_back(listener)
        # The entry is younger than the short TTL, so only the reconnect's
        # invalidation can explain seeing the change.
        assert clock.now() - cached_at < LISTENER_DOWN_TTL_S
        assert await paper_title(book) == marker
    finally:
        await restore_paper(listener.admin, original)


async def test_close_stops_the_reconnect_loop(listener: Listener) -> None:
    book = listener.book
    await hold_down(listener)
    await asyncio.wait_for(book.close(), timeout=10)
    assert listener.clock.sleepers == 0, "the backoff sleep was cancelled"
    # Logins allowed and time moving: nothing reconnects after close().
    await listener.allow_logins()
    await listener.clock.advance(LISTENER_MAX_BACKOFF_S * 3)
    await asyncio.sleep(0.2)
    assert not book.listening
    assert await listener.backend_pids() == []


async def test_close_while_listening_closes_the_connection(listener: Listener) -> None:
    await asyncio.wait_for(listener.book.close(), timeout=10)
    assert not listener.book.listening

    async def gone() -> bool:
        return await listener.backend_pids() == []

    assert await soon(gone)
