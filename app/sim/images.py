"""Image input tokens per model family (see ``app.sim.models`` for the source of the rules)."""

from __future__ import annotations

import base64
import binascii
import io
import math
from fractions import Fraction

from PIL import Image, UnidentifiedImageError

from app.sim.errors import InvalidRequest
from app.sim.models import GeminiTiles, ImageBilling, Tiles

PATCH_PX = 32
MAX_PATCHES = 1536
# What we assume for an image we cannot measure (an http(s) URL the simulator does not
# fetch): a 1024x1024 photo, i.e. 4 tiles or 1024 patches.
UNKNOWN_SIZE_TILES = 4
UNKNOWN_SIZE_PATCHES = 1024


def image_tokens(url: str, detail: str, billing: ImageBilling) -> int:
    """Prompt tokens one image costs on a model billed by ``billing``."""
    if isinstance(billing, GeminiTiles):
        size = data_url_image_size(url) if url.startswith("data:") else (1024, 1024)
        return gemini_image_tokens(*size, billing)
    if isinstance(billing, Tiles):
        if detail == "low":
            return billing.base
        tiles = tile_count(*data_url_image_size(url)) if url.startswith("data:") else UNKNOWN_SIZE_TILES
        return billing.base + billing.per_tile * tiles
    # Patch models ignore detail: "low" costs the same as "high" on the real API.
    patches = patch_count(*data_url_image_size(url)) if url.startswith("data:") else UNKNOWN_SIZE_PATCHES
    return round(patches * billing.multiplier)


GEMINI_TILES = GeminiTiles()


def gemini_image_tokens(width: int, height: int, billing: GeminiTiles = GEMINI_TILES) -> int:
    """Gemini: one tile for an image within 384 px both ways, else 768-px tiles, 258 each."""
    if width <= billing.small and height <= billing.small:
        return billing.per_tile
    tiles = _ceil_div(max(1, width), billing.tile) * _ceil_div(max(1, height), billing.tile)
    return billing.per_tile * tiles


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


def patch_count(width: int, height: int) -> int:
    """32-px patches covering the image, shrunk (OpenAI's documented way) to fit 1536.

    Past the cap the image is scaled by ``sqrt(32*32*1536 / (w*h))``, then scaled again
    so whole patches fit along both sides; the final scale is kept exact (a Fraction) so
    that sizes landing on a patch boundary, like the guide's 1800x2400 -> 1056x1408, do
    not pick up an extra patch from float rounding.
    """
    if width <= 0 or height <= 0:
        return 1
    raw = _ceil_div(width, PATCH_PX) * _ceil_div(height, PATCH_PX)
    if raw <= MAX_PATCHES:
        return raw
    shrink = math.sqrt(PATCH_PX * PATCH_PX * MAX_PATCHES / (width * height))
    whole_w = math.floor(width * shrink / PATCH_PX)
    whole_h = math.floor(height * shrink / PATCH_PX)
    scale = min(Fraction(whole_w * PATCH_PX, width), Fraction(whole_h * PATCH_PX, height))
    patches = _ceil_frac(width * scale / PATCH_PX) * _ceil_frac(height * scale / PATCH_PX)
    return min(MAX_PATCHES, max(1, patches))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _ceil_frac(value: Fraction) -> int:
    return -(-value.numerator // value.denominator)


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
