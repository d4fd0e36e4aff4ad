"""What each stage produces. Stages read earlier stages' results from the `ScanContext`
(app/stages/context.py), never from each other's modules, so these types live here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.db.taxonomy import Classification
from app.upstream.call import ChatResult


@dataclass(frozen=True)
class VisionResult:
    classification: Classification
    item_name: str  # the model's own words for the item; `minor` only if it is a known one
    situation_tags: list[str]
    call: ChatResult

    def to_json(self) -> dict[str, Any]:
        return {
            "classification": self.classification.to_json(),
            "item_name": self.item_name,
            "situation_tags": self.situation_tags,
        }


@dataclass(frozen=True)
class RuleMatch:
    document: dict[str, Any] | None
    matched_by: str | None  # exact | minor | major, None when nothing matched
    key: dict[str, str | None] | None
    reason: str | None = None

    def to_json(self) -> dict[str, Any] | None:
        if self.document is None:
            return None
        return {**self.document, "matched_by": self.matched_by, "key": self.key}


@dataclass(frozen=True)
class Answer:
    user_answer: str
    steps: list[str]
    insufficiencies: list[str]
    call: ChatResult | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "insufficiencies": self.insufficiencies,
            "user_answer": self.user_answer,
        }


@dataclass(frozen=True)
class Character:
    code: str
    name: str
    dialog: str
    middle: str | None

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "name": self.name, "dialog": self.dialog}


@dataclass(frozen=True)
class Reward:
    character: Character
    received: bool
    already_owned: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "character": self.character.to_json(),
            "received": self.received,
            "already_owned": self.already_owned,
        }
