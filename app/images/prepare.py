"""Image preparation for the vision stage. Pure, synchronous, CPU-bound: called through
the CPU lane, except `inline` on the event loop for a small sequential JPEG that goes on
as it came (checked from its bytes before anything else is done, `NotInline` otherwise).

The expensive part of a phone photo is decoding 12 Mpx we are about to throw away.
JPEG can decode at 1/2, 1/4 or 1/8 scale inside the DCT (`Image.draft`), so we ask
for the smallest scale that still covers the target size and only then resize: a
4032x3024 photo decodes at 1008x756 instead of full size.

Memory. PNG, GIF and WebP cannot decode at reduced scale, so what they cost is set by
the pixel count, not the file size: a 168 KB RGBA PNG of 6300x6300 decodes to 159 MB.
Three rules keep that bounded:

- Before decoding, `_plan` estimates from the header what the decode will hold: width x
  height x bytes per pixel of the decoded mode (PNG; GIF twice, for the first frame's
  disposal buffer), 16 bytes per pixel for WebP (libwebp's canvas and its copy, the frame
  as bytes, the Pillow image), the draft-size output for JPEG plus, for progressive or
  multi-scan JPEGs, libjpeg's whole-image coefficient buffer (2 bytes per sample at full
  size), plus the small working images of the steps below.
- The decode holds that many bytes of a process-wide `DecodeBudget` (default 8 bytes x
  `max_pixels`: two of the largest accepted RGBA images, 320 MB at 40 Mpx), waiting first
  come, first served while other threads hold it; an image whose estimate alone exceeds
  the budget is refused with 413 before a pixel is decoded. However many threads the CPU
  lane has, the decodes in flight stay under the budget.
- After decoding nothing full-size is made again: the image is flattened to RGB and
  box-reduced tile by tile (512 px squares), and EXIF orientation is applied to the small
  result. The old path (exif_transpose copy, RGBA copy, white canvas, alpha mask) held
  three to four full-size copies at once besides the decoded image.

And glibc is told to give big freed blocks back to the OS (see `pin_mmap_threshold`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ctypes
import hashlib
import io
import math
import os
import re
import struct
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from PIL import ExifTags, Image, PngImagePlugin

from app.errors import CpuLaneSaturated, ImageInvalid, ImageTooLarge, ImageTooManyPixels, ImageTypeUnsupported

# Magic numbers -> (Pillow format, MIME type). Sniffed from the bytes: a client's
# Content-Type or data-URL label is a claim, the bytes are the fact.
_SIGNATURES: tuple[tuple[bytes, str, str], ...] = (
    (b"\xff\xd8\xff", "JPEG", "image/jpeg"),
    (b"\x89PNG\r\n\x1a\n", "PNG", "image/png"),
    (b"GIF87a", "GIF", "image/gif"),
    (b"GIF89a", "GIF", "image/gif"),
)
SUPPORTED_MIME = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
_PILLOW_FORMAT = {"image/jpeg": "JPEG", "image/png": "PNG", "image/gif": "GIF", "image/webp": "WEBP"}

# Recognised but not accepted: answered with 415 rather than "not an image" (400).
_UNSUPPORTED_PREFIXES: tuple[tuple[bytes, str], ...] = (
    (b"II*\x00", "image/tiff"),  # also DNG and most camera raw formats
    (b"MM\x00*", "image/tiff"),
    (b"II+\x00", "image/tiff"),  # BigTIFF
    (b"MM\x00+", "image/tiff"),
    (b"8BPS", "image/vnd.adobe.photoshop"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "image/jp2"),
    (b"\xff\x4f\xff\x51", "image/jp2"),  # JPEG 2000 codestream
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "image/jxl"),
    (b"\xff\x0a", "image/jxl"),  # JPEG XL codestream
    (b"II\xbc", "image/jxr"),
    (b"qoif", "image/qoi"),
    (b"v/1\x01", "image/x-exr"),
    (b"DDS ", "image/vnd-ms.dds"),
    (b"icns", "image/icns"),
    (b"gimp xcf", "image/x-xcf"),
    (b"BPG\xfb", "image/bpg"),
)
# ISO-BMFF `ftyp` major brands of still-image formats (HEIF family, AVIF, Canon CR3).
_FTYP_BRANDS = {
    **dict.fromkeys((b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"hevm", b"hevs"), "image/heic"),
    **dict.fromkeys((b"mif1", b"msf1"), "image/heif"),
    **dict.fromkeys((b"avif", b"avis"), "image/avif"),
    b"crx ": "image/x-canon-cr3",
}
_BMP_DIB_HEADERS = frozenset({12, 16, 40, 52, 56, 64, 108, 124})
_PCX_HEADER = re.compile(rb"\x0a[\x00\x02-\x05]\x01[\x01\x02\x04\x08]")  # version, RLE, bits/pixel
_PNM_HEADER = re.compile(rb"P[1-7]\s+(?:#[^\n]*\n\s*)*\d+\s+\d+\s")

# Decoded size of one pixel in Pillow's storage, by mode (everything else is 4 bytes).
_BYTES_PER_PIXEL = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2}
_WEBP_BYTES_PER_PIXEL = 16
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

# A JPEG sent on as it came may take this many bytes per pixel (quality ~95 photos take
# well under 1): beyond it, re-encoding at JPEG_QUALITY saves the upload to OpenAI more
# than it costs here.
AS_IS_MAX_BYTES_PER_PIXEL = 1.0

# PNG text chunks (zTXt/iTXt) are inflated while the header is read, before any budget
# can be taken; Pillow allows 64 MB of them. We never read them.
PngImagePlugin.MAX_TEXT_MEMORY = 4 * 2**20


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int
    long_side: int
    jpeg_quality: int
    # Decode memory in flight across all threads; None: 8 bytes x max_pixels.
    decode_budget_bytes: int | None = None

    @property
    def decode_budget(self) -> int:
        if self.decode_budget_bytes is not None:
            return self.decode_budget_bytes
        return 8 * self.max_pixels


@dataclass(frozen=True)
class PreparedImage:
    data_url: str
    sha256: str  # of the upload as received (kept with the scan's row)
    prepared_sha256: str  # of the JPEG as sent: the vision reply cache's photo identity
    width: int  # after preparation
    height: int
    original_width: int
    original_height: int
    original_bytes: int


def sniff_mime(data: bytes) -> str | None:
    """The image type the bytes are (accepted or not), or None if they are no image we know."""
    head = data[:32]
    for magic, _fmt, mime in _SIGNATURES:
        if head.startswith(magic):
            return mime
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return _sniff_unsupported(data)


def _sniff_unsupported(data: bytes) -> str | None:
    head = data[:32]
    for magic, mime in _UNSUPPORTED_PREFIXES:
        if head.startswith(magic):
            return mime
    if head[4:8] == b"ftyp" and head[8:12] in _FTYP_BRANDS:
        return _FTYP_BRANDS[head[8:12]]
    # Short and text signatures: check a little structure, so that text starting with
    # "BM" or "P6" stays "not an image".
    if head[:2] == b"BM" and len(head) >= 18 and struct.unpack_from("<I", head, 14)[0] in _BMP_DIB_HEADERS:
        return "image/bmp"
    if head[:4] in (b"\x00\x00\x01\x00", b"\x00\x00\x02\x00") and len(head) >= 22:
        count, reserved = struct.unpack_from("<H", head, 4)[0], head[9]
        if count and reserved == 0:
            return "image/x-icon"
    if _PNM_HEADER.match(data, 0, 256):
        return "image/x-portable-anymap"
    if head[:2] == b"\x01\xda" and len(head) >= 3 and head[2] in (0, 1):
        return "image/x-sgi"
    if _PCX_HEADER.match(head):
        return "image/x-pcx"
    if data.endswith(b"TRUEVISION-XFILE.\x00"):
        return "image/x-tga"
    if _looks_like_svg(data):
        return "image/svg+xml"
    return None


def _looks_like_svg(data: bytes) -> bool:
    text = data[:4096].removeprefix(b"\xef\xbb\xbf").lstrip().lower()
    if text.startswith(b"<svg"):
        return True
    return text.startswith((b"<?xml", b"<!doctype svg", b"<!--")) and b"<svg" in text


def decode_data_url(url: str, max_bytes: int) -> tuple[bytes, str]:
    """`data:image/png;base64,....` -> its bytes and their base64 text, checking the
    declared type and size."""
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:"):
        raise ImageInvalid("Malformed data URL.")
    params = header[5:].split(";")
    mime = params[0].strip().lower()
    if mime not in SUPPORTED_MIME:
        raise ImageTypeUnsupported(f"Unsupported data URL type {mime or '(none)'!r}.")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise ImageInvalid("Data URLs must be base64-encoded.")
    # Check the size before decoding: base64 is 4 characters per 3 bytes.
    if len(payload) // 4 * 3 > max_bytes + 3:
        raise ImageTooLarge()
    try:
        # What b64decode(validate=True) does, without its copy of the text as bytes first.
        data = binascii.a2b_base64(payload, strict_mode=True)
    except (binascii.Error, ValueError):  # ValueError: not ASCII
        raise ImageInvalid("The data URL is not valid base64.") from None
    if len(data) > max_bytes:
        raise ImageTooLarge()
    return data, payload


# --- the decode budget ----------------------------------------------------------------


# How long a decode may wait for budget (others' big decodes) before its request is
# refused with 503 CPU_SATURATED; a 40 Mpx decode takes about a second.
DECODE_WAIT_TIMEOUT_S = 10.0


class DecodeBudget:
    """Bytes of decode memory in flight across the CPU lane's threads.

    `hold(n)` blocks the calling (worker) thread until `n` bytes are free and every
    earlier caller has been served: first come, first served, so a big image is not
    starved by a stream of small ones.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.in_use = 0
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(f"cannot hold {nbytes} of {self.capacity} bytes")
        ticket = object()
        deadline = time.monotonic() + DECODE_WAIT_TIMEOUT_S
        with self._cond:
            self._queue.append(ticket)
            while self._queue[0] is not ticket or self.in_use + nbytes > self.capacity:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cond.wait(remaining):
                    self._queue.remove(ticket)
                    self._cond.notify_all()
                    raise CpuLaneSaturated("Large images are being decoded; retry shortly.")
            self._queue.popleft()
            self.in_use += nbytes
            self._cond.notify_all()  # the next in line may fit too
        try:
            yield
        finally:
            with self._cond:
                self.in_use -= nbytes
                self._cond.notify_all()


_budgets: dict[int, DecodeBudget] = {}
_budgets_lock = threading.Lock()


def decode_budget(capacity: int) -> DecodeBudget:
    """The process-wide budget of that size (one per configured size; one in production)."""
    with _budgets_lock:
        budget = _budgets.get(capacity)
        if budget is None:
            budget = _budgets[capacity] = DecodeBudget(capacity)
        return budget


# --- preparation ----------------------------------------------------------------------


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


# An image prepared inline has at most this many pixels, whatever IMAGE_LONG_SIDE is.
INLINE_MAX_PIXELS = 1_000_000
# More scans than this and a JPEG is refused: a progressive decoder passes over every
# coefficient once per scan, and a few bytes make a scan (10 MB: hours of a thread).
# Encoders write ~10 (libjpeg's progressive script), a few dozen at most.
MAX_JPEG_SCANS = 100
_SOS_MARKER = b"\xff\xda"  # in entropy-coded data a 0xFF is always followed by 0x00 or a RST


class NotInline(Exception):
    """Asked to prepare an image inline, one that needs more than a check: do it in the
    CPU lane."""


def prepare_image(
    data: bytes, limits: ImageLimits, *, encoded: str | None = None, inline: bool = False
) -> PreparedImage:
    """Validate, decode cheaply, orient, downscale and re-encode as a JPEG data URL; a bare
    JPEG that needs none of that (`_sendable_as_is`) goes on as it came, decoded only to
    check it, and as the base64 text it came in when that is `encoded`.

    `inline` (on the event loop, for a small body): see `_prepare_inline`."""
    if inline:
        return _prepare_inline(data, limits, encoded)
    fmt = _check_type(data, limits)
    jfif = _jfif_walk(data)
    with _pillow_errors():
        img = _open(data, fmt)
        as_is = _sendable_as_is(img, data, limits, jfif)
        plan = _plan(img, data, limits, check_only=as_is)
        budget = decode_budget(limits.decode_budget)
        if plan.cost > budget.capacity:
            raise ImageTooManyPixels(
                f"Decoding this {plan.size[0]}x{plan.size[1]} {fmt} image would take about "
                f"{plan.cost / 2**20:.0f} MiB; the limit is {budget.capacity / 2**20:.0f} MiB."
            )
        with budget.hold(plan.cost):
            # One cut short, or with bad tables or headers, fails here.
            if as_is:
                _check_as_sent(img, data, jfif)
                prepared, size = data, plan.size
            else:
                img.load()
                orientation = img.getexif().get(ExifTags.Base.Orientation, 1)
                prepared, size = _reencoded(img, plan.size, orientation, limits)
            img.close()
    return _prepared(data, prepared, size, plan.size, encoded)


# A JPEG sent as it came is checked by decoding its headers and this much of its scan.
CHECK_SCAN_BYTES = 256
_EOI_MARKER = b"\xff\xd9"


def _prepare_inline(data: bytes, limits: ImageLimits, encoded: str | None) -> PreparedImage:
    """Only a bare JFIF JPEG with a single scan (sequential: one pass over the coefficients)
    and EOI right after it, that goes on as it came, of at most `INLINE_MAX_PIXELS`, decided
    from one walk of its markers and its header, checked from its head (`_scan_head`);
    anything else raises `NotInline` before any decoding, and the CPU lane does it all
    (errors included)."""
    head = _scan_head(data, _jfif_walk(data)) if len(data) <= limits.max_bytes else None
    if head is None:
        raise NotInline()
    with _pillow_errors(), _open(head, "JPEG") as img:
        size = img.size
        if not _as_is_shape(img, data, limits) or size[0] * size[1] > INLINE_MAX_PIXELS:
            raise NotInline()
        plan = _plan(img, data, limits, check_only=True)  # the pixel limit; draft at 1/8
        if plan.cost > decode_budget(limits.decode_budget).capacity:  # the lane refuses it
            raise NotInline()
        img.load()
    return _prepared(data, data, size, size, encoded)


def _scan_head(data: bytes, jfif: _Jfif) -> bytes | None:
    """A bare JFIF JPEG cut `CHECK_SCAN_BYTES` into its scan, EOI appended: decoding it
    refuses what decoding the whole image would. libjpeg's sequential decoder only warns
    about bad entropy-coded data (a truncated or garbled scan decodes, grey where data is
    missing); its errors come from the tables, the frame and the scan header, all of which
    the head holds (tests/test_images.py compares the two on 1,500 corrupted files). None
    unless the JPEG is sequential, with one scan and EOI right after it: libjpeg reads a
    later scan's header, or a segment after the scan, at the end of a decode, and its
    progressive decoder refuses a DC value that overflows, anywhere in a scan."""
    if jfif.scans != 1 or not jfif.sequential or jfif.scan_end != len(data) - len(_EOI_MARKER):
        return None
    return data[: jfif.scan_data + CHECK_SCAN_BYTES] + _EOI_MARKER


def _check_as_sent(img: Image.Image, data: bytes, jfif: _Jfif) -> None:
    """Decode a JPEG that goes on as it came (`img`, its draft at 1/8 set by `_plan`) only
    to check it: from its head where it has one (`_scan_head`, ~0.1 ms where a 768 px
    JPEG of 240 KB took ~1.8 ms whole), else whole (every coefficient is still read; the
    inverse DCTs cost 1/64)."""
    head = _scan_head(data, jfif)
    if head is None:
        img.load()
        return
    with _open(head, "JPEG") as cut:
        cut.draft(cut.mode, (max(1, cut.size[0] // 8), max(1, cut.size[1] // 8)))
        cut.load()


def _prepared(
    data: bytes, prepared: bytes, size: tuple[int, int], original: tuple[int, int], encoded: str | None
) -> PreparedImage:
    if prepared is not data or encoded is None or not _canonical_base64(encoded, data):
        encoded = base64.b64encode(prepared).decode("ascii")
    sha256 = hashlib.sha256(data).hexdigest()
    return PreparedImage(
        data_url=f"data:image/jpeg;base64,{encoded}",
        sha256=sha256,
        prepared_sha256=sha256 if prepared is data else hashlib.sha256(prepared).hexdigest(),
        width=size[0],
        height=size[1],
        original_width=original[0],
        original_height=original[1],
        original_bytes=len(data),
    )


def _canonical_base64(encoded: str, data: bytes) -> bool:
    """Whether `encoded` (strictly valid base64 of `data`) is exactly what b64encode gives:
    strict decoding still takes a surplus `=` after a whole quad and unused low bits set
    in the last one, which the model's API need not accept. Only the length and the last
    quad can differ."""
    tail = len(data) % 3 or 3
    return len(encoded) == 4 * -(-len(data) // 3) and (
        not data or encoded[-4:] == base64.b64encode(data[-tail:]).decode("ascii")
    )


def _sendable_as_is(img: Image.Image, data: bytes, limits: ImageLimits, jfif: _Jfif) -> bool:
    """A JPEG that re-encoding would only make worse (a second lossy pass) and cost CPU for:
    within the long side, RGB or grey, not bloated (`_as_is_shape`), and nothing but a
    bare JFIF image (`jfif`, `_jfif_walk`: nothing of the camera, place or person travels on, no
    EXIF orientation either: it is upright). What our own page sends, having downscaled
    the photo in a canvas (app/static/app.js). Decided from the header and the bytes,
    before decoding."""
    return jfif.scans > 0 and _as_is_shape(img, data, limits)


def _as_is_shape(img: Image.Image, data: bytes, limits: ImageLimits) -> bool:
    size = img.size
    return (
        img.format == "JPEG"
        and max(size) <= limits.long_side
        and img.mode in ("RGB", "L")
        and len(data) <= size[0] * size[1] * AS_IS_MAX_BYTES_PER_PIXEL
    )


# What a bare JFIF image holds besides SOI, its APP0 and EOI: tables (DQT, DHT, DRI), one
# Huffman-coded frame header (SOF0-2: baseline, extended, progressive) and scans (SOS).
_SOS, _EOI = 0xDA, 0xD9
_TABLES = frozenset({0xDB, 0xC4, 0xDD})
_HUFFMAN_FRAMES = frozenset({0xC0, 0xC1, 0xC2})
_PROGRESSIVE_FRAME = 0xC2
_JFIF_HEADER = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00"  # SOI, then a 16-byte APP0


class _Jfif(NamedTuple):
    """What one walk of a JPEG's markers tells (`_jfif_walk`)."""

    scans: int  # SOS segments; 0: not a bare JFIF image
    sequential: bool  # its frame is SOF0/SOF1, not SOF2 (progressive)
    scan_data: int  # where its first scan's entropy-coded data starts
    scan_end: int  # and where it ends


_NOT_BARE = _Jfif(0, False, 0, 0)


def _jfif_walk(data: bytes) -> _Jfif:
    """A bare JFIF image's scans, frame and first scan; `_NOT_BARE` if `data` is not one.
    Bare: a JPEG's image and nothing else, read marker by marker: SOI, one 16-byte JFIF
    APP0 without a thumbnail, tables, one SOF0-2 frame, its scans, and EOI as the last two
    bytes. Any other segment (EXIF, XMP, ICC, comments, JFXX thumbnails, Adobe, unknown
    APPn/JPGn), fill or stray bytes between segments, or bytes after EOI means the photo
    is re-encoded instead."""
    if not data.startswith(_JFIF_HEADER) or data[18:20] != b"\x00\x00":  # thumbnail 0x0
        return _NOT_BARE
    pos, frame, scans, first_scan, first_scan_end, end = 20, 0, 0, 0, 0, len(data)
    while pos + 2 <= end:
        if data[pos] != 0xFF:
            return _NOT_BARE
        marker = data[pos + 1]
        if marker == _EOI:
            if pos + 2 != end or not frame:
                return _NOT_BARE
            return _Jfif(scans, frame != _PROGRESSIVE_FRAME, first_scan, first_scan_end)
        segment_end = pos + 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
        if segment_end > end or segment_end < pos + 4:
            return _NOT_BARE
        if marker in _HUFFMAN_FRAMES:
            if frame:
                return _NOT_BARE  # one frame only
            frame = marker
        elif marker == _SOS:
            scans += 1
            if scans > MAX_JPEG_SCANS:
                return _NOT_BARE  # refused by `_check_type` in the lane
            scan_start, segment_end = segment_end, _scan_end(data, segment_end)
            if scans == 1:
                first_scan, first_scan_end = scan_start, segment_end
        elif marker not in _TABLES:
            return _NOT_BARE
        pos = segment_end
    return _NOT_BARE


_MARKER_IN_SCAN = re.compile(rb"\xff[^\x00\xd0-\xd7]")


def _scan_end(data: bytes, pos: int) -> int:
    """Where the entropy-coded data from `pos` ends: at the first marker that is neither a
    stuffed zero (FF00) nor a restart (FFD0-FFD7); the length of `data` if none."""
    found = _MARKER_IN_SCAN.search(data, pos)
    return found.start() if found is not None else len(data)


def _reencoded(
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
        # good as bicubic for a downscale and costs ~35% less. `content` leaves out the part
        # of the last row and column that reduce() padded.
        small = small.resize(target, Image.Resampling.BILINEAR, box=content)
    method = _TRANSPOSE.get(orientation)
    if method is not None:
        small = small.transpose(method)
    out = io.BytesIO()
    # Pillow carries a JPEG's comment over unless told otherwise (EXIF and ICC only when asked).
    small.save(out, "JPEG", quality=limits.jpeg_quality, optimize=False, comment=b"")
    return out.getvalue(), small.size


def decode_plan(data: bytes, limits: ImageLimits) -> DecodePlan:
    """What `prepare_image` would hold to decode `data`, from the header alone."""
    fmt = _check_type(data, limits)
    with _pillow_errors(), _open(data, fmt) as img:
        return _plan(img, data, limits)


@contextlib.contextmanager
def _pillow_errors() -> Iterator[None]:
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


def _open(data: bytes, fmt: str) -> Image.Image:
    with warnings.catch_warnings():
        # Pillow warns (and past 2x raises) on huge images; we check the limit ourselves.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return Image.open(io.BytesIO(data), formats=[fmt])


def _check_type(data: bytes, limits: ImageLimits) -> str:
    """The Pillow format to open `data` with, or the client error."""
    if not data:
        raise ImageInvalid("The image is empty.")
    if len(data) > limits.max_bytes:
        raise ImageTooLarge()
    mime = sniff_mime(data)
    if mime is None:
        raise ImageInvalid("The file is not an image.")
    fmt = _PILLOW_FORMAT.get(mime)
    if fmt is None:
        raise ImageTypeUnsupported(f"Unsupported image type {mime}: use JPEG, PNG, WebP or GIF.")
    if fmt == "JPEG" and data.count(_SOS_MARKER) > MAX_JPEG_SCANS:
        raise ImageInvalid(f"The JPEG has more than {MAX_JPEG_SCANS} scans.")
    if fmt == "GIF":
        # Pillow allocates the first frame's disposal buffer while opening: check first.
        canvas = _gif_canvas(data)
        if canvas is not None:
            _check_pixels(canvas, limits)
    return fmt


def _check_pixels(size: tuple[int, int], limits: ImageLimits) -> None:
    pixels = size[0] * size[1]
    if pixels > limits.max_pixels:
        raise ImageTooManyPixels(f"The image has {pixels} pixels; the limit is {limits.max_pixels}.")


def _plan(img: Image.Image, data: bytes, limits: ImageLimits, *, check_only: bool = False) -> DecodePlan:
    """Check the pixel count, set JPEG draft mode, and estimate the decode's memory; with
    `check_only`, a JPEG decodes at the smallest scale (the pixels are not used)."""
    size = img.size
    _check_pixels(size, limits)
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
    elif fmt == "JPEG" and (img.info.get("progressive") or _jpeg_is_multiscan(data)):
        decoder += _jpeg_coefficient_bytes(img, size)
    return DecodePlan(fmt, size, (w, h), decoder, _working_bytes(w, h, limits.long_side))


def _working_bytes(w: int, h: int, long_side: int) -> int:
    factor = max(1, max(w, h) // long_side)
    step = max(1, _TILE // factor) * factor
    reduced = math.ceil(w / factor) * math.ceil(h / factor) * 4
    # A tile: the crop, its RGBA copy, the white canvas, the alpha mask, the reduced tile.
    tile = min(step, w) * min(step, h) * 14
    # The resized image and its transposed copy, and ~1 MiB for the JPEG and its base64.
    return reduced + tile + 2 * long_side * long_side * 4 + 2**20


def _jpeg_is_multiscan(data: bytes) -> bool:
    """Whether a sequential JPEG spreads its components over several scans (the first scan
    does not carry them all); libjpeg then buffers every coefficient, as for progressive.
    Read from the headers only: the entropy-coded data is never scanned."""
    pos, n, components = 2, len(data), 0
    while pos + 5 <= n:
        if data[pos] != 0xFF:
            return False  # malformed: the decoder will say so
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            pos += 2
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC) and pos + 10 <= n:  # SOFn
            components = data[pos + 9]
        elif marker == 0xDA:  # SOS: number of components in this scan
            return data[pos + 4] < components
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return False


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


# --- giving memory back ---------------------------------------------------------------
#
# glibc serves allocations from 128 KiB up with mmap and unmaps them on free, but once it
# sees such a chunk freed it raises that threshold to the chunk's size (up to 32 MiB) and
# the trim threshold to twice that. After the first big image, Pillow's 16 MiB blocks and
# multi-megabyte request bodies come from the heaps instead, and up to 64 MiB per arena
# (one per thread that allocated) stays with the process when they are freed: 2 workers
# sat at +540 MiB idle after a burst of big PNGs. Pinning the threshold turns that
# adaptation off: blocks of 1 MiB and more are unmapped on free, and the heaps are trimmed
# above 128 KiB again (+10 MiB idle after the same burst; `malloc_trim(0)` after each big
# decode on top of it changed nothing measurable, so there is none).

_M_MMAP_THRESHOLD = -3  # mallopt parameter, <malloc.h>
_MMAP_THRESHOLD_BYTES = 2**20


def pin_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold at 1 MiB, unless the operator set one (MALLOC_MMAP_THRESHOLD_
    or GLIBC_TUNABLES). Process-wide; done once at import. True if pinned here."""
    if not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "GLIBC_TUNABLES" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc; musl has none
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES))


pin_mmap_threshold()
