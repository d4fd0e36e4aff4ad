"""Stage 4, reward: a collectible character for a well-prepared recyclable.

A reward is given only when the item is recyclable, has a middle category, a rule
was found and the answer lists nothing the user still has to do. The character is
the one for the middle category, or the default one. Ownership is recorded by a
single INSERT ... ON CONFLICT DO NOTHING on UNIQUE (user_id, character_code), so
two concurrent scans of the same category cannot both "receive" it: exactly one
insert returns a row.

`received` means this scan added the character to the user's collection;
`already_owned` means the user had it before. Anonymous scans get the match but no
ownership row (both false).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import asyncpg

from app.db.pool import DB_ERRORS
from app.db.taxonomy import Classification
from app.errors import DatabaseError
from app.stages.context import ScanContext
from app.stages.results import Answer, Character, Reward, RuleMatch

_RECORD = """
    INSERT INTO character_ownership (user_id, character_code, scan_id)
    VALUES ($1, $2, $3)
    ON CONFLICT (user_id, character_code) DO NOTHING
    RETURNING 1"""

if TYPE_CHECKING:
    from app.db.pool import DbConn


class RewardStage:
    name = "reward"
    progress_share = 6
    upstream_calls = 0

    def __init__(
        self,
        pool: asyncpg.Pool[asyncpg.Record],
        characters: list[Character],
        recyclable: frozenset[str],
        *,
        timeout_s: float,
    ) -> None:
        self.timeout_s = timeout_s
        self._pool = pool
        self._recyclable = recyclable
        self._by_middle = {c.middle: c for c in characters if c.middle is not None}
        defaults = [c for c in characters if c.middle is None]
        self._default = defaults[0] if defaults else None

    @staticmethod
    async def load_characters(conn: DbConn) -> list[Character]:
        rows = await conn.fetch("SELECT code, name, dialog, middle FROM characters ORDER BY code")
        return [Character(r["code"], r["name"], r["dialog"], r["middle"]) for r in rows]

    def eligible(self, c: Classification, rule: RuleMatch, answer: Answer) -> bool:
        return (
            c.major in self._recyclable
            and c.middle is not None
            and rule.document is not None
            and not answer.insufficiencies
        )

    def match(self, c: Classification) -> Character | None:
        character = self._by_middle.get(c.middle) if c.middle is not None else None
        return character or self._default

    async def run(self, ctx: ScanContext) -> Reward | None:
        c, rule, answer = ctx.vision.classification, ctx.rule, ctx.answer
        if not self.eligible(c, rule, answer):
            return None
        character = self.match(c)
        if character is None:
            return None
        user_id = ctx.scan.user_id
        if user_id is None:
            return Reward(character, received=False, already_owned=False)
        try:
            async with self._pool.acquire() as conn:
                inserted = await conn.fetchval(_RECORD, user_id, character.code, ctx.scan.id)
        except DB_ERRORS as exc:
            raise DatabaseError() from exc
        return Reward(character, received=inserted is not None, already_owned=inserted is None)

    def event_fields(self, result: Reward | None) -> dict[str, Any]:
        return {"reward": result.to_json() if result is not None else None}

    result_fields = event_fields

    def queue_seconds(self, result: Reward | None) -> float:
        return 0.0
