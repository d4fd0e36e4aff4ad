"""From an upload's bytes to an opened (not yet decoded) Pillow image, or the client's
error: its type sniffed and accepted, its size, scan count and GIF canvas checked before
Pillow reads a header, Pillow's own errors mapped to ours."""

from __future__ import annotations

import contextlib
import io
import struct
import warnings
from collections.abc import Iterator

from PIL import Image, PngImagePlugin

from app.errors import ImageInvalid, ImageTooLarge, ImageTooManyPixels, ImageTypeUnsupported
from app.images.jpeg_markers import MAX_JPEG_SCANS, too_many_scans
from app.images.limits import ImageLimits
from app.images.sniff import PILLOW_FORMAT, sniff_mime

# PNG text chunks (zTXt/iTXt) are inflated while the header is read, before any budget
# can be taken; Pillow allows 64 MB of them. We never read them.
PngImagePlugin.MAX_TEXT_MEMORY = 4 * 2**20


def check_type(data: bytes, limits: ImageLimits) -> str:
    """The Pillow format to open `data` with, or the client error."""
    if not data:
        raise ImageInvalid("The image is empty.")
    if len(data) > limits.max_bytes:
        raise ImageTooLarge()
    mime = sniff_mime(data)
    if mime is None:
        raise ImageInvalid("The file is not an image.")
    fmt = PILLOW_FORMAT.get(mime)
    if fmt is None:
        raise ImageTypeUnsupported(f"Unsupported image type {mime}: use JPEG, PNG, WebP or GIF.")
    if fmt == "JPEG" and too_many_scans(data):
        raise ImageInvalid(f"The JPEG has more than {MAX_JPEG_SCANS} scans.")
    if fmt == "GIF":
        # Pillow allocates the first frame's disposal buffer while opening: check first.
        canvas = _gif_canvas(data)
        if canvas is not None:
            check_pixels(canvas, limits)
    return fmt


def check_pixels(size: tuple[int, int], limits: ImageLimits) -> None:
    pixels = size[0] * size[1]
    if pixels > limits.max_pixels:
        raise ImageTooManyPixels(f"The image has {pixels} pixels; the limit is {limits.max_pixels}.")


@contextlib.contextmanager
def pillow_errors() -> Iterator[None]:
    """Pillow's errors as the client's: a decompression bomb has too many pixels; a file it
    cannot read (truncated, corrupt or lying about being an image) is invalid."""
    try:
        yield
    except (ImageTooManyPixels, ImageTypeUnsupported):
        raise
    except Image.DecompressionBombError:
        raise ImageTooManyPixels() from None
    except (OSError, SyntaxError, ValueError, EOFError):  # UnidentifiedImageError is an OSError
        raise ImageInvalid() from None


def open_image(data: bytes, fmt: str) -> Image.Image:
    with warnings.catch_warnings():
        # Pillow warns (and past 2x raises) on huge images; we check the limit ourselves.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return Image.open(io.BytesIO(data), formats=[fmt])


def _gif_canvas(data: bytes) -> tuple[int, int] | None:
    """The canvas Pillow allocates for the first frame: the logical screen, grown to the
    frame's extent. None when there is no first frame (Pillow will refuse the file)."""
    if len(data) < 13:
        return None
    screen: tuple[int, int] = struct.unpack_from("<2H", data, 6)
    pos = 13 + (3 << ((data[10] & 7) + 1) if data[10] & 0x80 else 0)
    n = len(data)
    while pos < n and data[pos] != 0x3B:  # trailer
        if data[pos] == 0x21:  # extension: label, then sub-blocks up to a zero length
            pos += 2
            while pos < n and data[pos]:
                pos += data[pos] + 1
            pos += 1
        elif data[pos] == 0x2C:  # image descriptor
            if pos + 9 > n:
                return None
            x, y, w, h = struct.unpack_from("<4H", data, pos + 1)
            return max(screen[0], x + w), max(screen[1], y + h)
        else:
            pos += 1  # Pillow skips stray bytes too
    return None
