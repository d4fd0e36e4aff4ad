"""Stage 2, rule: the disposal rules for a classification, from PostgreSQL.

Lookup order: the exact key (`major` + `middle` for recyclables, `major` alone
otherwise); then the rule of the category that owns the minor item's name (the
model may name a known item under a category with no rule of its own); then the
major's general rule. No match is an answer too: `document` is None with a reason.

Several items in one photo (app/stages/items.py): one lookup per distinct classification
(the minor item may choose the rule), the main item's first, each item's rule streamed
(an `item_rule` event) as soon as it is found when the photo holds several; the stage's
own fields stay the main item's.

Rules change rarely, so `RuleBook` caches lookups (misses included) in memory.
Invalidation: a trigger on `disposal_rules` sends NOTIFY on every change and a
dedicated LISTEN connection drops the cache; the TTL bounds staleness should that
connection ever be down. A generation counter keeps a lookup that raced an
invalidation from storing what it read before the change.

The LISTEN connection dies with its backend (PostgreSQL restart, failover,
pg_terminate_backend). asyncpg's termination listener tells us, and a background
task reconnects with exponential backoff. While it is down no NOTIFY can reach us,
so cached rules live at most `LISTENER_DOWN_TTL_S`; once it is back the cache is
dropped, since changes made meanwhile were never announced to us.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import asyncpg
from pydantic import BaseModel, ConfigDict, Field

from app.db.restarts import read
from app.db.taxonomy import Classification
from app.limits.clock import Clock, MonotonicClock
from app.stages.base import StageEnv, StageResult
from app.stages.context import ScanContext
from app.stages.vision import VisionResult

if TYPE_CHECKING:
    from app.db.pool import DbConn

log = logging.getLogger(__name__)

CHANNEL = "disposal_rules_changed"

# Reconnect delays after a lost LISTEN connection: the first attempt is immediate (a
# killed backend comes back at once), then 0.5 s doubling up to 10 s, so a restarting
# server is not hammered and a long outage is still noticed within 10 s of its end.
LISTENER_INITIAL_BACKOFF_S = 0.5
LISTENER_MAX_BACKOFF_S = 10.0
# How long a cached rule may be served while no NOTIFY can reach us: bounds staleness
# during an outage without turning every scan into a rule query.
LISTENER_DOWN_TTL_S = 5.0


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


class NotAcceptedItem(BaseModel):
    item: str
    instead: str


class RuleKey(BaseModel):
    major: str
    middle: str | None


class DisposalRules(BaseModel):
    """The rule document for the item's category."""

    # A document may carry more than the fields below; what it carries is sent.
    model_config = ConfigDict(frozen=True, extra="allow")

    title: str
    summary: str
    preparation: list[str]
    disposal: list[str]
    not_accepted: list[NotAcceptedItem]
    tips: list[str]
    matched_by: Literal["exact", "minor", "major"]
    key: RuleKey


class ItemRule(BaseModel):
    """The disposal rules of one of the photo's items."""

    model_config = ConfigDict(frozen=True)

    index: int = Field(description="The item's `index` in `items`.")
    disposal_rules: DisposalRules | None
    reason: str | None = Field(description="Why `disposal_rules` is null.")


class RuleResult(StageResult):
    """The disposal rules were looked up (the main item's, and every item's)."""

    done_names: ClassVar[Mapping[str, str]] = {"reason": "disposal_rules_reason"}

    disposal_rules: DisposalRules | None
    reason: str | None = Field(description="Why `disposal_rules` is null.")
    item_rules: list[ItemRule] = Field(description="Each item's rules, in the order of `items`.")


@dataclass(frozen=True)
class RuleMatch:
    """What a lookup found: the document as stored, and how it was found."""

    document: dict[str, Any] | None
    matched_by: str | None  # exact | minor | major, None when nothing matched
    key: dict[str, str | None] | None
    reason: str | None = None

    @functools.cached_property
    def result(self) -> RuleResult:
        """The stage's result, built (and the document checked) once per cached match."""
        rules = None
        if self.document is not None:
            rules = DisposalRules.model_validate(
                {**self.document, "matched_by": self.matched_by, "key": self.key}
            )
        return RuleResult(disposal_rules=rules, reason=self.reason, item_rules=[])

    def for_item(self, index: int) -> ItemRule:
        result = self.result
        return ItemRule(index=index, disposal_rules=result.disposal_rules, reason=result.reason)


class RuleBook:
    """The rule stage: cached rule lookups, invalidated by NOTIFY."""

    name = "rule"
    label = "배출 규정 찾기"
    progress_share = 8
    upstream_calls = 0
    streams_text = False
    result_type = RuleResult

    @classmethod
    async def start(cls, env: StageEnv) -> RuleBook:
        """The rule book, listening for changes from the start (see `start_listening`)."""
        rules = cls(
            env.pool,
            recyclable=env.taxonomy.recyclable,
            ttl_s=env.settings.rules_cache_ttl_s,
            timeout_s=env.settings.db_timeout_s,
        )
        await rules.start_listening(env.dsn)
        env.stack.push_async_callback(rules.close)
        env.metrics.rules_listener_up.set_function(lambda: float(rules.listening))
        return rules

    def __init__(
        self,
        pool: asyncpg.Pool[asyncpg.Record],
        *,
        recyclable: frozenset[str],
        ttl_s: float,
        timeout_s: float,
        clock: Clock | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self._pool = pool
        self._recyclable = recyclable
        self._ttl_s = ttl_s
        self._clock = clock or MonotonicClock()
        # key -> (when it was read, what was read): freshness is judged when read back,
        # so entries cached before the listener went down get the short TTL too.
        self._cache: dict[tuple[str, str | None, str | None], tuple[float, RuleMatch]] = {}
        self._generation = 0
        self._dsn: str | None = None
        self._listener: asyncpg.Connection | None = None
        self._reconnecting: asyncio.Task[None] | None = None
        self._closed = False
        self.hits = 0
        self.misses = 0

    @property
    def listening(self) -> bool:
        """True while a NOTIFY can reach the cache (the `ecoscan_rules_listener_up` gauge).
        `is_closed()` catches a connection that died without telling us."""
        return self._listener is not None and not self._listener.is_closed()

    async def start_listening(self, dsn: str) -> None:
        """Open the LISTEN connection. A failure propagates, so start-up fails loudly
        instead of serving from a cache that nothing invalidates; later losses are
        repaired in the background."""
        self._dsn = dsn
        self._listener = await self._connect_listener(dsn)

    async def close(self) -> None:
        """Stop listening in bounded time: stop any reconnect in progress, then close
        the connection gracefully for at most `timeout_s`, else drop it."""
        self._closed = True
        task, self._reconnecting = self._reconnecting, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=self.timeout_s)
        if self._listener is not None:
            listener, self._listener = self._listener, None
            await _close_bounded(listener, self.timeout_s)

    def invalidate(self) -> None:
        self._generation += 1
        self._cache.clear()

    def _on_notify(self, *_args: object) -> None:
        log.info("disposal rules changed: rule cache cleared")
        self.invalidate()

    async def _connect_listener(self, dsn: str) -> asyncpg.Connection:
        """A connection that LISTENs on `CHANNEL` and reports its own death; every step
        bounded by `timeout_s` so a hung server cannot stall start-up or a reconnect."""
        # The DSN carries the process's instance tag as application_name (how other
        # processes see this one is alive); keep it.
        conn = await asyncpg.connect(dsn, timeout=self.timeout_s)
        try:
            async with asyncio.timeout(self.timeout_s):
                await conn.add_listener(CHANNEL, self._on_notify)
        except BaseException:
            conn.terminate()
            raise
        conn.add_termination_listener(self._on_listener_terminated)
        return conn

    def _on_listener_terminated(self, conn: object) -> None:
        # asyncpg calls this for our own close() too, and for connections already replaced.
        if conn is self._listener:
            self._listener_lost()

    def _notice_dead_listener(self) -> None:
        """Belt and braces for a connection closed without its termination callback."""
        if self._listener is not None and self._listener.is_closed():
            self._listener_lost()

    def _listener_lost(self) -> None:
        self._listener = None
        if self._closed or self._reconnecting is not None or self._dsn is None:
            return
        log.warning(
            "rule cache listener connection lost: reconnecting; cached rules live at most %g s meanwhile",
            self._fresh_for(),
        )
        self._reconnecting = asyncio.create_task(self._reconnect(self._dsn), name="rule-listener-reconnect")

    async def _reconnect(self, dsn: str) -> None:
        """Retry until the listener is back (or `close()` cancels us), then drop the cache:
        whatever changed while we were deaf was never announced."""
        lost_at = self._clock.now()
        backoff = LISTENER_INITIAL_BACKOFF_S
        attempts = 1
        try:
            while (conn := await self._try_connect_listener(dsn)) is None:
                await self._clock.sleep(backoff)
                backoff = min(backoff * 2, LISTENER_MAX_BACKOFF_S)
                attempts += 1
            self._listener = conn
            self.invalidate()
            log.info(
                "rule cache listener reconnected after %d attempt(s), %.1f s down: rule cache cleared",
                attempts,
                self._clock.now() - lost_at,
            )
        finally:
            self._reconnecting = None

    async def _try_connect_listener(self, dsn: str) -> asyncpg.Connection | None:
        try:
            return await self._connect_listener(dsn)
        except Exception as exc:  # any failure is a reason to retry: giving up would leave the cache deaf
            log.debug("rule cache listener: reconnect failed: %s: %s", type(exc).__name__, exc)
            return None

    def _fresh_for(self) -> float:
        """How long a cached rule may be served now: the full TTL while NOTIFY can
        invalidate it, a short one while it cannot."""
        return self._ttl_s if self.listening else min(self._ttl_s, LISTENER_DOWN_TTL_S)

    async def run(self, ctx: ScanContext) -> RuleResult:
        vision = ctx.result(VisionResult)
        several = len(vision.items) > 1
        # The main item's category first: its rule is the stage's own and `done`'s.
        order = sorted(vision.items, key=lambda item: not item.main)
        found: dict[Classification, RuleMatch] = {}
        rules: dict[int, ItemRule] = {}
        for item in order:
            c = item.classification
            if c not in found:
                found[c] = await self.find(c)  # DatabaseError if it fails
            rules[item.index] = found[c].for_item(item.index)
            if several:
                await ctx.emit_item("item_rule", rules[item.index].model_dump(mode="json"))
        # (A log written before items existed has none: the main classification alone.)
        main_match = found.get(vision.classification) or await self.find(vision.classification)
        main = main_match.result
        item_rules = [rules[item.index] for item in vision.items]
        return main.model_copy(update={"item_rules": item_rules})

    async def find(self, c: Classification) -> RuleMatch:
        self._notice_dead_listener()
        key = (c.major, c.middle, c.minor)
        cached = self._cache.get(key)
        now = self._clock.now()
        if cached is not None and now - cached[0] < self._fresh_for():
            self.hits += 1
            return cached[1]
        self.misses += 1
        generation = self._generation
        match = await self._lookup(c)
        if generation == self._generation and self._ttl_s > 0:
            self._cache[key] = (now, match)
        return match

    async def _lookup(self, c: Classification) -> RuleMatch:
        """Ridden across a database restart (app/db/restarts.py); `DatabaseError` if not."""
        return await read(self._pool, functools.partial(self._query, c), timeout_s=self.timeout_s)

    async def _query(self, c: Classification, conn: DbConn) -> RuleMatch:
        middle = c.middle if c.major in self._recyclable else None
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


async def _close_bounded(conn: asyncpg.Connection, timeout_s: float) -> None:
    """Close gracefully if the server answers within `timeout_s`; otherwise just drop
    the socket, so shutdown never waits on an unresponsive server."""
    try:
        await conn.close(timeout=timeout_s)
    except Exception as exc:  # timeout, dead socket, server error: terminate() is the fallback for all
        log.debug("rule cache listener: graceful close failed (%s): terminating", type(exc).__name__)
        conn.terminate()


def _match(row: asyncpg.Record, matched_by: str) -> RuleMatch:
    return RuleMatch(row["document"], matched_by, {"major": row["major"], "middle": row["middle"]})
