"""DB_POOL_MAX=auto against the real server: half of what it has free, within bounds."""

from __future__ import annotations

import asyncpg

from app.db.pool import AUTO_POOL_MAX, pool_size


async def test_auto_takes_half_the_free_connections_within_its_bounds(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        limit = await conn.fetchval(
            "SELECT current_setting('max_connections')::int"
            " - current_setting('superuser_reserved_connections')::int"
        )
    finally:
        await conn.close()
    # Other test workers open and close connections meanwhile: bounds, not one number.
    size = await pool_size(database_url, min_size=2, cap=None, timeout_s=5.0)
    assert 2 <= size <= min(AUTO_POOL_MAX, max(2, limit // 2))
    assert await pool_size(database_url, min_size=2, cap=3, timeout_s=5.0) <= 3  # auto:3
    assert await pool_size(database_url, min_size=9, cap=3, timeout_s=5.0) == 9  # the floor wins
    assert await pool_size(database_url, min_size=1, cap=None, timeout_s=5.0) >= 1
