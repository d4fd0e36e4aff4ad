"""What a decode will hold, estimated from the header before a pixel is decoded.

The expensive part of a phone photo is decoding 12 Mpx we are about to throw away.
JPEG can decode at 1/2, 1/4 or 1/8 scale inside the DCT (`Image.draft`), so we ask
for the smallest scale that still covers the target size and only then resize: a
4032x3024 photo decodes at 1008x756 instead of full size.

PNG, GIF and WebP cannot decode at reduced scale, so what they cost is set by the pixel
count, not the file size: a 168 KB RGBA PNG of 6300x6300 decodes to 159 MB. The estimate
is width x height x bytes per pixel of the decoded mode (PNG; GIF twice, for the first
frame's disposal buffer), 16 bytes per pixel for WebP (libwebp's canvas and its copy, the
frame as bytes, the Pillow image), the draft-size output for JPEG plus, for progressive
or multi-scan JPEGs, libjpeg's whole-image coefficient buffer (2 bytes per sample at full
size), plus the small working images of the downscale (app/images/downscale.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from PIL import Image

from app.images.downscale import working_bytes
from app.images.jpeg_markers import jpeg_is_multiscan
from app.images.limits import ImageLimits
from app.images.opening import check_pixels

# Decoded size of one pixel in Pillow's storage, by mode (everything else is 4 bytes).
_BYTES_PER_PIXEL = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2}
_WEBP_BYTES_PER_PIXEL = 16


@dataclass(frozen=True)
class DecodePlan:
    format: str
    size: tuple[int, int]  # as stored in the file
    decoded_size: tuple[int, int]  # what the decoder produces (JPEG: at draft scale)
    decoder_bytes: int  # estimated peak held by the decoder
    working_bytes: int  # tiles, the reduced image, the thumbnail, the output

    @property
    def cost(self) -> int:
        return self.decoder_bytes + self.working_bytes


def plan_decode(
    img: Image.Image, data: bytes, limits: ImageLimits, *, check_only: bool = False
) -> DecodePlan:
    """Check the pixel count, set JPEG draft mode, and estimate the decode's memory; with
    `check_only`, a JPEG decodes at the smallest scale (the pixels are not used)."""
    size = img.size
    check_pixels(size, limits)
    fmt = img.format or ""
    if fmt == "JPEG":
        if check_only:  # Pillow picks the scale from size // requested: 1/8 needs the floor
            img.draft(img.mode, (max(1, size[0] // 8), max(1, size[1] // 8)))
        else:
            scale = min(1.0, limits.long_side / max(size))
            img.draft("RGB", (max(1, math.ceil(size[0] * scale)), max(1, math.ceil(size[1] * scale))))
    w, h = img.size
    decoder = w * h * _BYTES_PER_PIXEL.get(img.mode, 4)
    if fmt == "GIF":
        decoder *= 2  # the first frame's disposal buffer
    elif fmt == "WEBP":
        decoder = size[0] * size[1] * _WEBP_BYTES_PER_PIXEL
    elif fmt == "JPEG" and (img.info.get("progressive") or jpeg_is_multiscan(data)):
        decoder += _jpeg_coefficient_bytes(img, size)
    return DecodePlan(fmt, size, (w, h), decoder, working_bytes(w, h, limits.long_side))


def _jpeg_coefficient_bytes(img: Image.Image, size: tuple[int, int]) -> int:
    """libjpeg's whole-image coefficient buffer: one 16-bit value per sample, per component,
    at full resolution (draft scaling does not shrink it), padded to whole MCUs."""
    layers: list[tuple[int, int, int, int]] = getattr(img, "layer", [])
    sampling = [(max(1, h), max(1, v)) for _id, h, v, _q in layers] or [(1, 1)] * 4
    h_max = max(h for h, _v in sampling)
    v_max = max(v for _h, v in sampling)
    mcus_x = math.ceil(size[0] / (8 * h_max))
    mcus_y = math.ceil(size[1] / (8 * v_max))
    return sum(mcus_x * h * 8 * mcus_y * v * 8 * 2 for h, v in sampling)
