"""Stage 4, reward: a collectible character for a well-prepared recyclable.

A reward is given only when the item is recyclable, has a middle category, a rule
was found and the answer lists nothing the user still has to do. The character is
the one for the middle category, or the default one. Ownership is recorded by an
INSERT ... ON CONFLICT DO NOTHING on UNIQUE (user_id, character_code), so two
concurrent scans of the same category cannot both "receive" it: exactly one row is
inserted (with many scans' rewards in one statement, app/db/batch.py, the first of
them).

`received` means this scan added the character to the user's collection;
`already_owned` means the user had it before. Anonymous scans get the match but no
ownership row (both false).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import asyncpg
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from app.db.batch import GroupCommit
from app.db.pool import database_error, row_error
from app.db.restarts import write
from app.db.taxonomy import Classification
from app.stages.answer import Answer, AnswerResult
from app.stages.base import StageEnv, StageResult
from app.stages.context import ScanContext
from app.stages.rule import RuleResult
from app.stages.vision import VisionResult

# Many at once (app/db/batch.py); what it returns are the ownerships it recorded. Two
# rows of one batch for the same user and character: the first is recorded.
_RECORD_MANY = """
    INSERT INTO character_ownership (user_id, character_code, scan_id)
    SELECT * FROM unnest($1::text[], $2::text[], $3::uuid[])
    ON CONFLICT (user_id, character_code) DO NOTHING
    RETURNING user_id, character_code"""

if TYPE_CHECKING:
    from app.db.pool import DbConn


class Character(BaseModel):
    model_config = ConfigDict(frozen=True)

    code: str
    name: str
    dialog: str
    # The middle category it is the character of (None: the default one); not sent.
    middle: SkipJsonSchema[str | None] = Field(default=None, exclude=True)


class Reward(BaseModel):
    model_config = ConfigDict(frozen=True)

    character: Character
    received: bool = Field(description="This scan added the character to the user's collection.")
    already_owned: bool = Field(description="The user had it before (anonymous scans: both false).")


class RewardResult(StageResult):
    """The reward was matched (null unless the item earns one)."""

    reward: Reward | None


class RewardStage:
    name = "reward"
    label = "캐릭터 확인"
    progress_share = 6
    upstream_calls = 0
    streams_text = False
    result_type = RewardResult

    @classmethod
    async def start(cls, env: StageEnv) -> RewardStage:
        """The characters are read once, at start-up."""
        async with env.pool.acquire() as conn:
            characters = await cls.load_characters(conn)
        return cls(env.pool, characters, env.taxonomy.recyclable, timeout_s=env.settings.db_timeout_s)

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
        self._records = GroupCommit(self._record_many, error=database_error, split=row_error)
        self._recyclable = recyclable
        self._by_middle = {c.middle: c for c in characters if c.middle is not None}
        defaults = [c for c in characters if c.middle is None]
        self._default = defaults[0] if defaults else None

    @staticmethod
    async def load_characters(conn: DbConn) -> list[Character]:
        rows = await conn.fetch("SELECT code, name, dialog, middle FROM characters ORDER BY code")
        return [
            Character(code=r["code"], name=r["name"], dialog=r["dialog"], middle=r["middle"]) for r in rows
        ]

    def eligible(self, c: Classification, rule: RuleResult, answer: Answer) -> bool:
        return (
            c.major in self._recyclable
            and c.middle is not None
            and rule.disposal_rules is not None
            and not answer.insufficiencies
        )

    def match(self, c: Classification) -> Character | None:
        character = self._by_middle.get(c.middle) if c.middle is not None else None
        return character or self._default

    async def run(self, ctx: ScanContext) -> RewardResult:
        return RewardResult(reward=await self._reward(ctx))

    async def _reward(self, ctx: ScanContext) -> Reward | None:
        c = ctx.result(VisionResult).classification
        if not self.eligible(c, ctx.result(RuleResult), ctx.result(AnswerResult).answer):
            return None
        character = self.match(c)
        if character is None:
            return None
        user_id = ctx.scan.user_id
        if user_id is None:
            return Reward(character=character, received=False, already_owned=False)
        received = await self._records.submit((user_id, character.code, ctx.scan.id))
        return Reward(character=character, received=received, already_owned=not received)

    async def _record_many(self, rows: Sequence[tuple[str, str, uuid.UUID]]) -> list[bool]:
        """Whether each (user, character, scan) was the one to give the user the character."""
        columns = [list(c) for c in zip(*rows, strict=True)]
        # Sent again only if it never was (app/db/restarts.py): a lost reply may have committed.
        recorded = await write(
            self._pool,
            lambda conn: conn.fetch(_RECORD_MANY, *columns, timeout=self.timeout_s),
            timeout_s=self.timeout_s,
        )
        new = {(r["user_id"], r["character_code"]) for r in recorded}
        received = []
        for user_id, code, _ in rows:
            received.append((user_id, code) in new)
            new.discard((user_id, code))
        return received
