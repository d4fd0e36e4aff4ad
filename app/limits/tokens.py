"""Conservative prompt-token estimates for rate-budget reservations (no tokenizer available).

The estimates only size a reservation: `Reservation.settle` corrects the budget with the real
usage afterwards, so erring high costs a little throughput for one call and erring low risks
a 429. Every rule here errs high.

- Text: ceil(ascii_chars / 4) + non_ascii_chars (Korean ≈ 1 token per character).
- Images: OpenAI's tile rule (85 + 170 per 512-px tile; "low" detail is a flat 85).
  Models that bill images at other rates take `base_tokens` / `tile_tokens`
  (gpt-4o-mini: 2833 / 5667).
- Chat: 4 tokens per message (role and framing) + 3 for priming the reply, plus the content.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "IMAGE_BASE_TOKENS",
    "IMAGE_TILE_TOKENS",
    "MESSAGE_OVERHEAD_TOKENS",
    "REPLY_PRIMING_TOKENS",
    "estimate_chat_tokens",
    "estimate_image_tokens",
    "estimate_text_tokens",
]

IMAGE_BASE_TOKENS = 85
IMAGE_TILE_TOKENS = 170
MESSAGE_OVERHEAD_TOKENS = 4
REPLY_PRIMING_TOKENS = 3

_MAX_SIDE = 2048
_SHORT_SIDE = 768
_TILE = 512
# Unknown size at "high"/"auto": the worst case of the tile rule, 768×2048 → 2×4 tiles.
_WORST_CASE_TILES = 8


def estimate_text_tokens(text: str) -> int:
    """ceil(ascii_chars / 4) + non_ascii_chars: high for English, ~1 per Hangul syllable."""
    ascii_chars = sum(1 for ch in text if ord(ch) < 128)
    return -(-ascii_chars // 4) + (len(text) - ascii_chars)


def estimate_image_tokens(
    width: int | None,
    height: int | None,
    detail: str = "auto",
    *,
    base_tokens: int = IMAGE_BASE_TOKENS,
    tile_tokens: int = IMAGE_TILE_TOKENS,
) -> int:
    """Tokens for one image input under OpenAI's documented tile rule.

    "low" → `base_tokens`. "high", "auto" and anything else (treated as "high", the
    conservative reading of "auto"): fit within 2048×2048, then downscale (never upscale) so
    the shortest side is 768, count 512-px tiles: base + tile × tiles. Unknown or invalid
    size → the worst case of the rule, 8 tiles (1445 tokens at the default rates).
    """
    if detail.strip().lower() == "low":
        return base_tokens
    if width is None or height is None or width <= 0 or height <= 0:
        return base_tokens + tile_tokens * _WORST_CASE_TILES
    # Integer arithmetic (floor, like an image resize): no float error at tile boundaries.
    w, h = width, height
    if (long := max(w, h)) > _MAX_SIDE:
        w, h = max(1, w * _MAX_SIDE // long), max(1, h * _MAX_SIDE // long)
    if (short := min(w, h)) > _SHORT_SIDE:
        w, h = max(1, w * _SHORT_SIDE // short), max(1, h * _SHORT_SIDE // short)
    tiles = math.ceil(w / _TILE) * math.ceil(h / _TILE)
    return base_tokens + tile_tokens * tiles


def estimate_chat_tokens(
    messages: Sequence[Mapping[str, Any]],
    *,
    image_sizes: Mapping[str, tuple[int, int]] | None = None,
    max_completion_tokens: int = 0,
    base_tokens: int = IMAGE_BASE_TOKENS,
    tile_tokens: int = IMAGE_TILE_TOKENS,
) -> int:
    """Estimate the tokens to reserve for a Chat Completions request.

    Walks `messages` in the OpenAI format: `content` as a string or a list of parts of type
    "text" (`text`) and "image_url" (`image_url: {"url", "detail"}`); `name` and
    `tool_calls[].function.{name, arguments}` are counted as text; unknown parts are ignored.
    `image_sizes` maps an image URL (data URLs included) to its (width, height); images not in
    it are costed at the worst case. Add `max_completion_tokens` to reserve the completion too.
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
                    total += _part_tokens(part, sizes, base_tokens, tile_tokens)
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
    base_tokens: int,
    tile_tokens: int,
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
        return estimate_image_tokens(width, height, detail, base_tokens=base_tokens, tile_tokens=tile_tokens)
    return 0
