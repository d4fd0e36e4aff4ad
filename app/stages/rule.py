"""Stage 2, rule: the disposal rules for a classification, from PostgreSQL.

Lookup order: the exact key (`major` + `middle` for recyclables, `major` alone
otherwise); then the rule of the category that owns the minor item's name (the
model may name a known item under a category with no rule of its own); then the
major's general rule. No match is an answer too: `document` is None with a reason.

Rules change rarely, so `RuleBook` caches lookups (misses included) in memory.
Invalidation: a trigger on `disposal_rules` sends NOTIFY on every change and a
dedicated LISTEN connection drops the cache; the TTL bounds staleness should that
connection ever be down. A generation counter keeps a lookup that raced an
invalidation from storing what it read before the change.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import asyncpg

from app.errors import DatabaseError
from app.scan_context import ScanContext
from app.scan_store import DB_ERRORS
from app.stages.results import RuleMatch
from app.taxonomy import Classification

log = logging.getLogger(__name__)

CHANNEL = "disposal_rules_changed"


_EXACT = (
    "SELECT major, middle, document FROM disposal_rules WHERE major = $1 AND middle IS NOT DISTINCT FROM $2"
)
_BY_MINOR = """
    SELECT r.major, r.middle, r.document
    FROM taxonomy_minor m
    JOIN disposal_rules r ON r.major = m.major AND r.middle IS NOT DISTINCT FROM m.middle
    WHERE m.name = $1
    ORDER BY (m.major = $2) DESC, m.major
    LIMIT 1"""


class RuleBook:
    """The rule stage: cached rule lookups, invalidated by NOTIFY."""

    name = "rule"
    progress_share = 8
    upstream_calls = 0

    def __init__(
        self,
        pool: asyncpg.Pool[asyncpg.Record],
        *,
        recyclable: frozenset[str],
        ttl_s: float,
        timeout_s: float,
    ) -> None:
        self.timeout_s = timeout_s
        self._pool = pool
        self._recyclable = recyclable
        self._ttl_s = ttl_s
        self._cache: dict[tuple[str, str | None, str | None], tuple[float, RuleMatch]] = {}
        self._generation = 0
        self._listener: asyncpg.Connection | None = None
        self.hits = 0
        self.misses = 0

    async def start_listening(self, dsn: str) -> None:
        self._listener = await asyncpg.connect(dsn)
        await self._listener.add_listener(CHANNEL, self._on_notify)

    async def close(self) -> None:
        if self._listener is not None:
            listener, self._listener = self._listener, None
            await listener.close()

    def invalidate(self) -> None:
        self._generation += 1
        self._cache.clear()

    def _on_notify(self, *_args: object) -> None:
        log.info("disposal rules changed: rule cache cleared")
        self.invalidate()

    async def run(self, ctx: ScanContext) -> RuleMatch:
        try:
            return await self.find(ctx.vision.classification)
        except DB_ERRORS as exc:
            raise DatabaseError() from exc

    def event_fields(self, result: RuleMatch) -> dict[str, Any]:
        return {"disposal_rules": result.to_json(), "reason": result.reason}

    def result_fields(self, result: RuleMatch) -> dict[str, Any]:
        return {"disposal_rules": result.to_json(), "disposal_rules_reason": result.reason}

    def queue_seconds(self, result: RuleMatch) -> float:
        return 0.0

    async def find(self, c: Classification) -> RuleMatch:
        key = (c.major, c.middle, c.minor)
        cached = self._cache.get(key)
        now = time.monotonic()
        if cached is not None and cached[0] > now:
            self.hits += 1
            return cached[1]
        self.misses += 1
        generation = self._generation
        match = await self._lookup(c)
        if generation == self._generation and self._ttl_s > 0:
            self._cache[key] = (now + self._ttl_s, match)
        return match

    async def _lookup(self, c: Classification) -> RuleMatch:
        middle = c.middle if c.major in self._recyclable else None
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(_EXACT, c.major, middle)
            if row is not None:
                return _match(row, "exact")
            if c.minor:
                row = await conn.fetchrow(_BY_MINOR, c.minor, c.major)
                if row is not None:
                    return _match(row, "minor")
            if middle is not None:
                row = await conn.fetchrow(_EXACT, c.major, None)
                if row is not None:
                    return _match(row, "major")
        where = f"{c.major} > {c.middle}" if c.middle else c.major
        return RuleMatch(None, None, None, reason=f"'{where}'에 대한 배출 규칙이 등록되어 있지 않습니다.")


def _match(row: asyncpg.Record, matched_by: str) -> RuleMatch:
    return RuleMatch(row["document"], matched_by, {"major": row["major"], "middle": row["middle"]})
