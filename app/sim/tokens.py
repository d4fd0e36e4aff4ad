"""Rough OpenAI-like token accounting: prompt text, images, and the streamed token unit."""

from __future__ import annotations

import base64
import binascii
import io
import math
import re

from PIL import Image, UnidentifiedImageError

from app.sim.errors import InvalidRequest

LOW_DETAIL_TOKENS = 85
TILE_TOKENS = 170
# What a 1024px-ish photo costs at high detail; used when we cannot read the size (http URLs).
UNKNOWN_SIZE_TOKENS = 765
MESSAGE_OVERHEAD = 4
REPLY_PRIMING = 3

# One streamed token: an optional leading space plus up to 4 Latin letters, 3 digits,
# 2 Hangul syllables or 1 other symbol; whitespace runs stand alone. Every character
# matches some branch, so the pieces always re-join to the original text.
_TOKEN_RE = re.compile(
    r" ?[A-Za-z]{1,4}| ?[0-9]{1,3}| ?[\uac00-\ud7a3]{1,2}| ?[^\sA-Za-z0-9\uac00-\ud7a3]|\s+"
)


def split_tokens(text: str) -> list[str]:
    """Split generated text into the unit the simulator streams and bills as one token."""
    return _TOKEN_RE.findall(text)


def count_tokens(text: str) -> int:
    """Number of streamed tokens in ``text`` (see ``split_tokens``)."""
    return len(_TOKEN_RE.findall(text))


def prompt_text_tokens(text: str) -> int:
    """Approximate prompt tokens: ~4 ASCII chars per token, one per non-ASCII char."""
    ascii_chars = len(text.encode("ascii", "ignore"))
    return math.ceil(ascii_chars / 4) + (len(text) - ascii_chars)


def image_tokens(url: str, detail: str) -> int:
    """OpenAI's vision pricing: 85 at low detail, else 85 + 170 per 512px tile."""
    if detail == "low":
        return LOW_DETAIL_TOKENS
    if not url.startswith("data:"):
        return UNKNOWN_SIZE_TOKENS
    width, height = data_url_image_size(url)
    return LOW_DETAIL_TOKENS + TILE_TOKENS * tile_count(width, height)


def tile_count(width: float, height: float) -> int:
    """512px tiles after fitting into 2048x2048, then shrinking the short side to 768."""
    if width <= 0 or height <= 0:
        return 1
    longest = max(width, height)
    if longest > 2048:
        width, height = width * 2048 / longest, height * 2048 / longest
    shortest = min(width, height)
    if shortest > 768:
        width, height = width * 768 / shortest, height * 768 / shortest
    return math.ceil(width / 512) * math.ceil(height / 512)


def data_url_image_size(url: str) -> tuple[int, int]:
    """Pixel size of a base64 data-URL image; reads the header only (no pixel decode)."""
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidRequest(
            "Invalid image URL: expected a base64 data URL.", "messages", "invalid_image_url"
        )
    try:
        raw = base64.b64decode(payload)
        with Image.open(io.BytesIO(raw)) as image:
            return image.size
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError):
        raise InvalidRequest(
            "You uploaded an unsupported image. Please make sure your image has of one the "
            "following formats: ['png', 'jpeg', 'gif', 'webp'].",
            "messages",
            "invalid_image_format",
        ) from None
