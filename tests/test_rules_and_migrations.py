"""The rule book against a real PostgreSQL: lookup order, caching, invalidation by
NOTIFY; and migrations that are harmless to apply twice."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator

import asyncpg
import pytest

from app.db.migrations import apply_migrations, bundled_migrations
from app.db.pool import create_pool
from app.db.taxonomy import Classification, load_taxonomy
from app.stages.rule import RuleBook

from .conftest import eventually, with_database

PAPER = Classification("재활용폐기물", "종이", "신문지")


@pytest.fixture
async def rulebook(database_url: str) -> AsyncIterator[RuleBook]:
    pool = await create_pool(database_url, min_size=1, max_size=2, timeout_s=5)
    async with pool.acquire() as conn:
        await apply_migrations(conn, bundled_migrations())
        taxonomy = await load_taxonomy(conn)
    book = RuleBook(pool, recyclable=taxonomy.recyclable, ttl_s=300, timeout_s=5)
    await book.start_listening(database_url)
    try:
        yield book
    finally:
        await book.close()
        await pool.close()


async def test_exact_rule_for_recyclable_uses_middle(rulebook: RuleBook) -> None:
    match = await rulebook.find(PAPER)
    assert match.matched_by == "exact"
    assert match.key == {"major": "재활용폐기물", "middle": "종이"}
    assert match.document is not None and match.document["preparation"]


async def test_exact_rule_for_other_major_ignores_middle(rulebook: RuleBook) -> None:
    match = await rulebook.find(Classification("음식물류폐기물", None, None))
    assert match.matched_by == "exact" and match.key == {"major": "음식물류폐기물", "middle": None}


async def test_fallback_by_minor_name_when_the_exact_rule_is_missing(
    rulebook: RuleBook, db: asyncpg.Connection
) -> None:
    # With the 종이 rule gone, an item classified under 종이 has no exact rule. If the
    # item's name is a known minor of another category (우유팩 is a 종이팩 item), that
    # category's rule is used; otherwise there is no rule and a reason says why.
    saved = await db.fetchrow("SELECT document FROM disposal_rules WHERE middle = '종이'")
    assert saved is not None
    await db.execute("DELETE FROM disposal_rules WHERE middle = '종이'")
    try:
        rulebook.invalidate()
        by_minor = await rulebook.find(Classification("재활용폐기물", "종이", "우유팩"))
        assert by_minor.matched_by == "minor"
        assert by_minor.key == {"major": "재활용폐기물", "middle": "종이팩"}
        nothing = await rulebook.find(Classification("재활용폐기물", "종이", "신문지"))
        assert nothing.document is None and nothing.matched_by is None
        assert nothing.reason and "종이" in nothing.reason
    finally:
        await db.execute(
            "INSERT INTO disposal_rules (major, middle, document) VALUES ('재활용폐기물', '종이', $1)",
            saved["document"],
        )


async def test_rules_are_cached_until_a_change_is_notified(
    rulebook: RuleBook, db: asyncpg.Connection
) -> None:
    rulebook.invalidate()
    first = await rulebook.find(PAPER)
    again = await rulebook.find(PAPER)
    assert again is first
    assert (rulebook.hits, rulebook.misses) == (1, 1)

    marker = f"test-{secrets.token_hex(4)}"
    original = first.document
    assert original is not None
    changed = {**original, "title": marker}
    await db.execute("UPDATE disposal_rules SET document = $1 WHERE middle = '종이'", changed)
    try:

        async def sees_change() -> bool:
            match = await rulebook.find(PAPER)
            return match.document is not None and match.document["title"] == marker

        assert await eventually(sees_change)
    finally:
        await db.execute("UPDATE disposal_rules SET document = $1 WHERE middle = '종이'", original)


async def test_migrations_applied_twice_are_harmless(database_url: str) -> None:
    name = f"ecoscan_migrate_{secrets.token_hex(3)}"
    admin = await asyncpg.connect(database_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        conn = await asyncpg.connect(with_database(database_url, name))
        try:
            migrations = bundled_migrations()
            first = await apply_migrations(conn, migrations)
            assert first == [m.name for m in migrations]
            counts = await table_counts(conn)
            assert await apply_migrations(conn, migrations) == []
            # Force every file to run again, as after an edit: the data stays the same.
            await conn.execute("UPDATE schema_migrations SET checksum = 'stale'")
            assert await apply_migrations(conn, migrations) == first
            assert await table_counts(conn) == counts
            assert counts["taxonomy_major"] == 8
            assert counts["taxonomy_middle"] == 12
            assert counts["disposal_rules"] == 19
            assert counts["characters"] == 13
            assert 50 <= counts["situation_tags"] <= 80
        finally:
            await conn.close()
    finally:
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        await admin.close()


async def table_counts(conn: asyncpg.Connection) -> dict[str, int]:
    tables = (
        "taxonomy_major",
        "taxonomy_middle",
        "taxonomy_minor",
        "situation_tags",
        "disposal_rules",
        "characters",
    )
    return {t: await conn.fetchval(f"SELECT count(*) FROM {t}") for t in tables}


async def test_every_recyclable_middle_has_a_rule_and_a_character(db: asyncpg.Connection) -> None:
    # This worker's database is migrated by whichever test first starts the service; this
    # test may be the worker's first (migrations are harmless to apply twice).
    await apply_migrations(db, bundled_migrations())
    missing = await db.fetch(
        """SELECT m.name FROM taxonomy_middle m
           LEFT JOIN disposal_rules r ON r.major = m.major AND r.middle = m.name
           LEFT JOIN characters c ON c.middle = m.name
           WHERE r.id IS NULL OR c.code IS NULL"""
    )
    assert missing == []
    assert await db.fetchval("SELECT count(*) FROM characters WHERE middle IS NULL") == 1
    doc = await db.fetchval("SELECT document FROM disposal_rules WHERE middle = '무색페트병'")
    assert {"title", "summary", "preparation", "disposal", "not_accepted", "tips"} <= set(
        doc if isinstance(doc, dict) else json.loads(doc)
    )
