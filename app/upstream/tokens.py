"""Conservative prompt-token estimates for rate-budget reservations (no tokenizer available).

The estimates only size a reservation: `Reservation.settle` corrects the budget with the real
usage afterwards, so erring high costs a little throughput for one call and erring low risks
a 429. Every rule here errs high.

- Text: ceil(ascii_chars / 4) + non_ascii_chars (Korean ≈ 1 token per character).
- Images: billed per model (an `ImageBilling`, chosen in `app/upstream/profiles.py`, or by
  the provider: app/upstream/providers/), here by one of OpenAI's two published rules: 512-px
  *tiles* (base + per-tile tokens; `low` detail is the base alone) or 32-px *patches*
  (capped at 1536, times a per-model multiplier; `detail` does not lower the cost); or by
  Gemini's: 258 tokens per 768-px tile, one tile for an image of at most 384 px a side.
- Chat: 4 tokens per message (role and framing) + 3 for priming the reply, plus the content.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "MESSAGE_OVERHEAD_TOKENS",
    "REPLY_PRIMING_TOKENS",
    "TILES_GPT_4O",
    "GeminiTiles",
    "ImageBilling",
    "Patches",
    "Tiles",
    "estimate_chat_tokens",
    "estimate_image_tokens",
    "estimate_text_tokens",
]

MESSAGE_OVERHEAD_TOKENS = 4
REPLY_PRIMING_TOKENS = 3

_MAX_SIDE = 2048
_SHORT_SIDE = 768
_TILE = 512
# Unknown size at "high"/"auto": the worst case of the tile rule, 768×2048 → 2×4 tiles.
_WORST_CASE_TILES = 8
_PATCH = 32
_MAX_PATCHES = 1536


class ImageBilling(Protocol):
    """How one model family bills an image input: any object with this method (a
    provider may bring its own: `Provider.image_billing`, app/upstream/providers/)."""

    def tokens(self, width: int | None, height: int | None, detail: str = "auto") -> int: ...


@dataclass(frozen=True)
class Tiles:
    """OpenAI's 512-px tiles: `base_tokens` + `tile_tokens` per tile at `high`/`auto`;
    a `low`-detail image is the base alone."""

    base_tokens: int
    tile_tokens: int

    def tokens(self, width: int | None, height: int | None, detail: str = "auto") -> int:
        if detail.strip().lower() == "low":
            return self.base_tokens
        return self.base_tokens + self.tile_tokens * _tiles(width, height)


@dataclass(frozen=True)
class Patches:
    """OpenAI's 32-px patches (capped), times a per-model multiplier; `detail` changes nothing."""

    multiplier: float

    def tokens(self, width: int | None, height: int | None, detail: str = "auto") -> int:
        return math.ceil(_patches(width, height) * self.multiplier)


@dataclass(frozen=True)
class GeminiTiles:
    """Gemini's 768-px tiles, 258 tokens each (see `_gemini_tiles`)."""

    def tokens(self, width: int | None, height: int | None, detail: str = "auto") -> int:
        return GEMINI_TILE_TOKENS * _gemini_tiles(width, height)


TILES_GPT_4O = Tiles(85, 170)


def estimate_text_tokens(text: str) -> int:
    """ceil(ascii_chars / 4) + non_ascii_chars: high for English, ~1 per Hangul syllable."""
    ascii_chars = len(text.encode("ascii", "ignore"))  # counted in C: prompts run to KBs
    return -(-ascii_chars // 4) + (len(text) - ascii_chars)


def estimate_image_tokens(
    width: int | None, height: int | None, detail: str = "auto", billing: ImageBilling = TILES_GPT_4O
) -> int:
    """Tokens for one image input; an unknown or invalid size costs the rule's worst case."""
    return billing.tokens(width, height, detail)


def _tiles(width: int | None, height: int | None) -> int:
    """512-px tiles after fitting into 2048×2048, then shrinking (never growing) the short
    side to 768; unknown size → the worst case, 8 tiles."""
    if width is None or height is None or width <= 0 or height <= 0:
        return _WORST_CASE_TILES
    # Integer arithmetic (floor, like an image resize): no float error at tile boundaries.
    w, h = width, height
    if (long := max(w, h)) > _MAX_SIDE:
        w, h = max(1, w * _MAX_SIDE // long), max(1, h * _MAX_SIDE // long)
    if (short := min(w, h)) > _SHORT_SIDE:
        w, h = max(1, w * _SHORT_SIDE // short), max(1, h * _SHORT_SIDE // short)
    return math.ceil(w / _TILE) * math.ceil(h / _TILE)


# Gemini: an image with both sides at most 384 px is one tile; a larger one is cut into
# 768x768 tiles; each tile is 258 tokens. `detail` does not change it.
GEMINI_TILE_TOKENS = 258
_GEMINI_SMALL = 384
_GEMINI_TILE = 768
# Unknown size: a 3072-px square, larger than anything we send.
_GEMINI_WORST_CASE_TILES = 16


def _gemini_tiles(width: int | None, height: int | None) -> int:
    if width is None or height is None or width <= 0 or height <= 0:
        return _GEMINI_WORST_CASE_TILES
    if width <= _GEMINI_SMALL and height <= _GEMINI_SMALL:
        return 1
    return math.ceil(width / _GEMINI_TILE) * math.ceil(height / _GEMINI_TILE)


def _patches(width: int | None, height: int | None) -> int:
    """32-px patches covering the image, capped at 1536 (a larger image is scaled down to
    fit; the cap is also the worst case for an unknown size)."""
    if width is None or height is None or width <= 0 or height <= 0:
        return _MAX_PATCHES
    return min(_MAX_PATCHES, math.ceil(width / _PATCH) * math.ceil(height / _PATCH))


def estimate_chat_tokens(
    messages: Sequence[Mapping[str, Any]],
    *,
    image_sizes: Mapping[str, tuple[int, int]] | None = None,
    max_completion_tokens: int = 0,
    image_billing: ImageBilling = TILES_GPT_4O,
) -> int:
    """Estimate the tokens to reserve for a Chat Completions request.

    Walks `messages` in the OpenAI format: `content` as a string or a list of parts of type
    "text" (`text`) and "image_url" (`image_url: {"url", "detail"}`); `name` and
    `tool_calls[].function.{name, arguments}` are counted as text; unknown parts are ignored.
    `image_sizes` maps an image URL (data URLs included) to its (width, height); images not in
    it are costed at the worst case of `image_billing`. Add `max_completion_tokens` to reserve
    the completion too.
    """
    sizes = image_sizes or {}
    total = REPLY_PRIMING_TOKENS + max(0, max_completion_tokens)
    for message in messages:
        total += MESSAGE_OVERHEAD_TOKENS
        if isinstance(name := message.get("name"), str):
            total += estimate_text_tokens(name)
        content = message.get("content")
        if isinstance(content, str):
            total += estimate_text_tokens(content)
        elif isinstance(content, Sequence):
            for part in content:
                if isinstance(part, Mapping):
                    total += _part_tokens(part, sizes, image_billing)
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping):
                for key in ("name", "arguments"):
                    if isinstance(value := function.get(key), str):
                        total += estimate_text_tokens(value)
    return total


def _part_tokens(
    part: Mapping[str, Any],
    sizes: Mapping[str, tuple[int, int]],
    billing: ImageBilling,
) -> int:
    kind = part.get("type")
    if kind == "text" and isinstance(text := part.get("text"), str):
        return estimate_text_tokens(text)
    if kind == "image_url":
        image = part.get("image_url")
        url: object = image
        detail: object = "auto"
        if isinstance(image, Mapping):
            url, detail = image.get("url"), image.get("detail") or "auto"
        width, height = sizes.get(url, (None, None)) if isinstance(url, str) else (None, None)
        detail = detail if isinstance(detail, str) else "auto"
        return billing.tokens(width, height, detail)
    return 0
