"""Our waste taxonomy, loaded from PostgreSQL once at start-up.

The vision stage asks the model to pick one *category path* from an enum
("재활용폐기물 > 종이", "음식물류폐기물", ...) instead of independent major and
middle enums: a path enum makes inconsistent pairs (음식물류폐기물 + 종이)
impossible. Recyclables always carry a middle category (rules and rewards are
keyed by it); other majors have none.

The minor item is *not* an enum. Every enum value is prompt tokens on every call
(and OpenAI's TPM budget counts them): the full major/middle/minor path list is
~2,400 tokens, which alone would make Tier 1's 500k TPM, not its 500 RPM, the
limit. The model names the item in a few words instead, and `minor` is set only
when that name is one of the category's known minor items.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field

PATH_SEPARATOR = " > "

if TYPE_CHECKING:
    from app.db.pool import DbConn


@dataclass(frozen=True)
class Classification:
    """The item's category in the taxonomy."""

    major: Annotated[str, Field(description="Major category (대분류).")]
    middle: Annotated[
        str | None, Field(description="Middle category; set for recyclables (재활용폐기물) only.")
    ]
    minor: Annotated[str | None, Field(description="One of the category's known items, or null.")]

    def to_json(self) -> dict[str, str | None]:
        return {"major": self.major, "middle": self.middle, "minor": self.minor}


@dataclass(frozen=True)
class Taxonomy:
    majors: list[dict[str, Any]]
    middles: dict[str, list[dict[str, Any]]]  # major -> middles
    minors: dict[tuple[str, str | None], list[str]]  # (major, middle) -> minor names
    tags: list[dict[str, Any]]
    recyclable: frozenset[str]
    paths: dict[str, Classification] = field(default_factory=dict)

    @property
    def tag_names(self) -> list[str]:
        return [t["name"] for t in self.tags]

    def classify(self, path: str, item: str | None) -> Classification | None:
        """The classification for a category path and the model's item name, or None
        if the path is not ours. `minor` is kept only when it is a known item."""
        category = self.paths.get(path)
        if category is None:
            return None
        name = " ".join(item.split()) if item else ""
        known = self.minors.get((category.major, category.middle), [])
        return Classification(category.major, category.middle, name if name in known else None)

    def is_recyclable(self, major: str) -> bool:
        return major in self.recyclable

    def vision_schema(self) -> dict[str, Any]:
        """The json_schema the vision stage sends as `response_format`."""
        return {
            "type": "object",
            "properties": {
                "category": {"type": "string", "enum": list(self.paths)},
                # No maxLength: the stage truncates (MAX_ITEM_CHARS), and strict mode treats
                # string-length keywords as hints at best.
                "item": {"type": "string"},
                "situation_tags": {"type": "array", "items": {"type": "string", "enum": self.tag_names}},
            },
            "required": ["category", "item", "situation_tags"],
            "additionalProperties": False,
        }

    def to_json(self) -> dict[str, Any]:
        """The public shape of GET /api/v1/scan/categories."""
        majors = []
        for major in self.majors:
            name = major["name"]
            majors.append(
                {
                    "name": name,
                    "description": major["description"],
                    "recyclable": major["recyclable"],
                    "middles": [
                        {
                            "name": m["name"],
                            "description": m["description"],
                            "minors": self.minors.get((name, m["name"]), []),
                        }
                        for m in self.middles.get(name, [])
                    ],
                    "minors": self.minors.get((name, None), []),
                }
            )
        return {
            "majors": majors,
            "situation_tags": self.tags,
            "paths": list(self.paths),
            "path_separator": PATH_SEPARATOR,
        }


async def load_taxonomy(conn: DbConn) -> Taxonomy:
    majors = [
        dict(r)
        for r in await conn.fetch(
            "SELECT name, description, recyclable FROM taxonomy_major ORDER BY sort_order"
        )
    ]
    middles: dict[str, list[dict[str, Any]]] = {}
    for r in await conn.fetch(
        "SELECT major, name, description FROM taxonomy_middle ORDER BY major, sort_order"
    ):
        middles.setdefault(r["major"], []).append({"name": r["name"], "description": r["description"]})
    minors: dict[tuple[str, str | None], list[str]] = {}
    for r in await conn.fetch(
        "SELECT major, middle, name FROM taxonomy_minor ORDER BY major, middle, sort_order"
    ):
        minors.setdefault((r["major"], r["middle"]), []).append(r["name"])
    tags = [
        dict(r)
        for r in await conn.fetch(
            "SELECT name, tag_group, description FROM situation_tags ORDER BY sort_order"
        )
    ]
    recyclable = frozenset(m["name"] for m in majors if m["recyclable"])
    taxonomy = Taxonomy(majors, middles, minors, tags, recyclable)
    taxonomy.paths.update(_paths(taxonomy))
    return taxonomy


def _paths(t: Taxonomy) -> dict[str, Classification]:
    paths: dict[str, Classification] = {}
    for major in t.majors:
        name = major["name"]
        if name in t.recyclable:
            for middle in t.middles.get(name, []):
                paths[PATH_SEPARATOR.join((name, middle["name"]))] = Classification(
                    name, middle["name"], None
                )
        else:
            paths[name] = Classification(name, None, None)
    return paths
