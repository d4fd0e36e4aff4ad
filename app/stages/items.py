"""Several items in one photo: the vision reply's shape, and the reply checked and bound to
the taxonomy.

People photograph a PET bottle with its label and cap, a takeaway meal, a pile by the door;
Korean sorting rules are about exactly those parts. So the vision call names up to
`MAX_ITEMS` items, each as one category path, a name and its situation tags (what the
single-item reply held), with a box where the model can place it, and says which item is
the main one: the one today's single-item fields (and the reward) are about.

The schema is in what every provider accepts: OpenAI's strict subset (every property
required, `additionalProperties: false`; Gemini's provider leaves that keyword out) and
Gemini's Schema object. "No box" is `anyOf: [box, {"type": "null"}]`, not the type list
`["object", "null"]` strict mode also takes: Gemini's Schema object has no type lists (a
400 naming `type`), and a `compatible` deployment in front of Gemini would learn from that
400 to drop `type` itself. No `maxItems`/`minimum`: strict mode does not promise them, so
the reply is checked here:

- more items than `MAX_ITEMS`: the main one and the first others are kept, the rest
  dropped (counted in `dropped`);
- a category outside the taxonomy: that item is dropped (counted); none left is
  `UPSTREAM_BAD_RESPONSE`, as for a single item today;
- a box past the image's edges is clamped to them; one with no area left (or not numbers)
  is no box;
- a `main_item` that names no kept item: the first kept item is the main one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.db.taxonomy import Classification, Taxonomy
from app.errors import UpstreamBadResponse

MAX_TAGS = 8
MAX_ITEM_CHARS = 30
# A box narrower or lower than this share of the image (after clamping) marks nothing.
MIN_BOX_SIDE = 0.005
BOX_SIDES = ("x", "y", "width", "height")


class Box(BaseModel):
    """Where the item is, as shares of the image's width and height (0-1), from its
    top-left corner: the photo as sent, EXIF orientation applied."""

    model_config = ConfigDict(frozen=True)

    x: float = Field(description="Left edge, share of the image's width.")
    y: float = Field(description="Top edge, share of the image's height.")
    width: float
    height: float


class FoundItem(BaseModel):
    """One item the photo shows, bound to the taxonomy."""

    model_config = ConfigDict(frozen=True)

    index: int = Field(description="Its place in `items` (0-based); other events name it by this.")
    main: bool = Field(description="The photo's main item: the one the single-item fields describe.")
    classification: Classification
    item_name: str = Field(description="The model's own words for the item.")
    situation_tags: list[str]
    box: Box | None = Field(description="Where it is in the photo; null when the model gave none.")


@dataclass(frozen=True)
class FoundItems:
    items: list[FoundItem]  # in the reply's order, renumbered; exactly one is `main`
    dropped: int  # items the reply named that were left out (over MAX_ITEMS, unknown category)

    @property
    def main(self) -> FoundItem:
        return next(item for item in self.items if item.main)


def items_schema(taxonomy: Taxonomy) -> dict[str, Any]:
    """The json_schema the vision stage sends: the single-item object, with a box, as a list."""
    item = taxonomy.vision_schema()
    box = {
        "anyOf": [
            {
                "type": "object",
                "properties": {side: {"type": "number"} for side in BOX_SIDES},
                "required": list(BOX_SIDES),
                "additionalProperties": False,
            },
            {"type": "null"},
        ]
    }
    item = {**item, "properties": {**item["properties"], "box": box}, "required": [*item["required"], "box"]}
    return {
        "type": "object",
        "properties": {"items": {"type": "array", "items": item}, "main_item": {"type": "integer"}},
        "required": ["items", "main_item"],
        "additionalProperties": False,
    }


def parse_items(reply: object, taxonomy: Taxonomy, max_items: int) -> FoundItems:
    """The reply's items, checked (see the module docstring); `UpstreamBadResponse` if it
    is not the expected shape or names no item of ours."""
    if not isinstance(reply, dict) or not isinstance(reply.get("items"), list):
        raise UpstreamBadResponse("The classification reply was not the expected JSON.")
    raw_items: list[Any] = reply["items"]
    main_at = reply.get("main_item")
    known_tags = frozenset(taxonomy.tag_names)
    bound: list[tuple[int, Classification, str, list[str], Box | None]] = []
    for at, raw in enumerate(raw_items):
        one = _bind(raw, taxonomy, known_tags)
        if one is not None:
            bound.append((at, *one))
    if not bound:
        raise UpstreamBadResponse("The classification named no category inside the taxonomy.")
    main_pos = next((i for i, one in enumerate(bound) if one[0] == main_at), 0)
    kept = [bound[main_pos], *(one for i, one in enumerate(bound) if i != main_pos)][:max_items]
    kept.sort(key=lambda one: one[0])  # back in the reply's order
    main_reply_at = bound[main_pos][0]
    items = [
        FoundItem(
            index=i,
            main=at == main_reply_at,
            classification=c,
            item_name=name,
            situation_tags=tags,
            box=box,
        )
        for i, (at, c, name, tags, box) in enumerate(kept)
    ]
    return FoundItems(items, dropped=len(raw_items) - len(items))


def _bind(
    raw: object, taxonomy: Taxonomy, known_tags: frozenset[str]
) -> tuple[Classification, str, list[str], Box | None] | None:
    """One reply item bound to the taxonomy; None when its category is not ours."""
    if not isinstance(raw, dict) or not isinstance(raw.get("category"), str):
        return None
    item = raw.get("item")
    name = " ".join(item.split())[:MAX_ITEM_CHARS] if isinstance(item, str) else ""
    classification = taxonomy.classify(raw["category"], name)
    if classification is None:
        return None
    raw_tags = raw.get("situation_tags")
    tags: list[str] = []
    for tag in raw_tags if isinstance(raw_tags, list) else []:
        if isinstance(tag, str) and tag in known_tags and tag not in tags:
            tags.append(tag)
    return classification, name, tags[:MAX_TAGS], clamped_box(raw.get("box"))


def clamped_box(raw: object) -> Box | None:
    """A box inside the image: its edges clamped to 0-1; None without area or numbers."""
    if not isinstance(raw, dict):
        return None
    sides = [raw.get(side) for side in BOX_SIDES]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in sides):
        return None
    x, y, width, height = (float(v) for v in sides)  # type: ignore[arg-type]
    left, top = _unit(x), _unit(y)
    right, bottom = _unit(x + width), _unit(y + height)
    if right - left < MIN_BOX_SIDE or bottom - top < MIN_BOX_SIDE:
        return None
    return Box(x=round(left, 4), y=round(top, 4), width=round(right - left, 4), height=round(bottom - top, 4))


def _unit(value: float) -> float:
    return min(1.0, max(0.0, value))
