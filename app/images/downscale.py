"""A decoded image made into the JPEG the model gets: downscaled to the long side, turned
upright, flattened to RGB, re-encoded.

After decoding nothing full-size is made again: the image is flattened to RGB and
box-reduced tile by tile (512 px squares), and EXIF orientation is applied to the small
result. Pillow's straightforward path (an `exif_transpose` copy, an RGBA copy, a white
canvas, an alpha mask) would hold three to four full-size copies at once besides the
decoded image. `working_bytes` is what these steps hold, for the decode budget.
"""

from __future__ import annotations

import io
import math

from PIL import Image

from app.images.limits import ImageLimits

_TILE = 512  # source pixels per side of a flatten-and-reduce tile (before rounding to the factor)

_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def reencoded(
    img: Image.Image, size: tuple[int, int], orientation: int, limits: ImageLimits
) -> tuple[bytes, tuple[int, int]]:
    """Downscaled to the long side, turned upright, flattened to RGB, as a fresh JPEG."""
    small, content = _shrink(img, limits.long_side)
    # Free the decoded pixels (and, for WebP, the decoder's canvases) before giving the
    # budget back.
    img.close()
    target = _fit(size, limits.long_side)
    if small.size != target:
        # After the integer reduce the remaining factor is < 2, where bilinear looks as
        # good as bicubic for a downscale and its kernel is half as wide (half the source
        # pixels per output pixel, each way). `content` leaves out the part of the last row
        # and column that reduce() padded.
        small = small.resize(target, Image.Resampling.BILINEAR, box=content)
    method = _TRANSPOSE.get(orientation)
    if method is not None:
        small = small.transpose(method)
    out = io.BytesIO()
    # Pillow carries a JPEG's comment over unless told otherwise (EXIF and ICC only when asked).
    small.save(out, "JPEG", quality=limits.jpeg_quality, optimize=False, comment=b"")
    return out.getvalue(), small.size


def working_bytes(w: int, h: int, long_side: int) -> int:
    """What `reencoded` holds besides the decoded image, which is `w` x `h`."""
    factor = max(1, max(w, h) // long_side)
    step = max(1, _TILE // factor) * factor
    reduced = math.ceil(w / factor) * math.ceil(h / factor) * 4
    # A tile: the crop, its RGBA copy, the white canvas, the alpha mask, the reduced tile.
    tile = min(step, w) * min(step, h) * 14
    # The resized image and its transposed copy, and ~1 MiB for the JPEG and its base64.
    return reduced + tile + 2 * long_side * long_side * 4 + 2**20


def _fit(size: tuple[int, int], long_side: int) -> tuple[int, int]:
    """`size` scaled to fit a `long_side` square, aspect kept (never enlarged)."""
    w, h = size
    if max(w, h) <= long_side:
        return size
    if w >= h:
        return long_side, max(1, round(h * long_side / w))
    return max(1, round(w * long_side / h)), long_side


def _shrink(img: Image.Image, long_side: int) -> tuple[Image.Image, tuple[float, float, float, float]]:
    """The decoded image as RGB, box-reduced by the largest integer factor that keeps the
    long side at least `long_side`, without any full-size intermediate copy; and the box
    of the reduced image that the source covers exactly."""
    w, h = img.size
    factor = max(1, max(w, h) // long_side)
    content = (0.0, 0.0, w / factor, h / factor)
    if img.mode in ("RGB", "L") and "transparency" not in img.info:
        small = img.reduce(factor)  # reads the decoded image in place (factor 1: a copy)
        return (small if small.mode == "RGB" else small.convert("RGB")), content
    # Alpha, palettes, 16-bit, CMYK...: convert tile by tile. Compositing onto white and
    # then averaging equals averaging premultiplied colours and then compositing.
    step = max(1, _TILE // factor) * factor
    out = Image.new("RGB", (math.ceil(w / factor), math.ceil(h / factor)))
    for y in range(0, h, step):
        for x in range(0, w, step):
            tile = _flatten(img.crop((x, y, min(x + step, w), min(y + step, h))))
            out.paste(tile.reduce(factor) if factor > 1 else tile, (x // factor, y // factor))
    return out, content


def _flatten(img: Image.Image) -> Image.Image:
    """JPEG has no alpha or palette: composite transparency onto white."""
    if img.mode == "RGB" and "transparency" not in img.info:
        return img
    if img.mode in ("RGBA", "LA", "P", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return img.convert("RGB")
