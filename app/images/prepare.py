"""Image preparation for the vision stage. Pure, synchronous, CPU-bound: called through
the CPU lane, except `inline` on the event loop for a small sequential JPEG that goes on
as it came (checked from its bytes before anything else is done, `NotInline` otherwise).

The steps, each in its module of app/images/: the type sniffed from the bytes and the
upload opened without decoding (sniff.py, opening.py); what the decode will hold,
estimated from the header, with JPEG decoded at the smallest draft scale that covers the
target (plan.py); that many bytes held of the process-wide decode budget while decoding
(budget.py); the decoded image downscaled, turned upright and re-encoded without a
full-size copy (downscale.py). A bare JPEG that needs none of that goes on as it came,
checked from the markers walked once and the head of its scan (jpeg_markers.py). And
glibc is told to give big freed blocks back to the OS (mmap_threshold.py).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

from PIL import ExifTags, Image

from app.errors import ImageTooManyPixels
from app.images.budget import decode_budget
from app.images.downscale import reencoded
from app.images.jpeg_markers import Jfif, jfif_walk, scan_head
from app.images.limits import ImageLimits
from app.images.mmap_threshold import pin_mmap_threshold
from app.images.opening import check_type, open_image, pillow_errors
from app.images.plan import DecodePlan, plan_decode

pin_mmap_threshold()  # before the first image is decoded in this process

# A JPEG sent on as it came may take this many bytes per pixel (quality ~95 photos take
# well under 1): beyond it, re-encoding at JPEG_QUALITY saves the upload to OpenAI more
# than it costs here.
AS_IS_MAX_BYTES_PER_PIXEL = 1.0

# An image prepared inline has at most this many pixels, whatever IMAGE_LONG_SIDE is.
INLINE_MAX_PIXELS = 1_000_000


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
    fmt = check_type(data, limits)
    jfif = jfif_walk(data)
    with pillow_errors():
        img = open_image(data, fmt)
        as_is = _sendable_as_is(img, data, limits, jfif)
        plan = plan_decode(img, data, limits, check_only=as_is)
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
                prepared, size = reencoded(img, plan.size, orientation, limits)
            img.close()
    return _prepared(data, prepared, size, plan.size, encoded)


def decode_plan(data: bytes, limits: ImageLimits) -> DecodePlan:
    """What `prepare_image` would hold to decode `data`, from the header alone."""
    fmt = check_type(data, limits)
    with pillow_errors(), open_image(data, fmt) as img:
        return plan_decode(img, data, limits)


def _prepare_inline(data: bytes, limits: ImageLimits, encoded: str | None) -> PreparedImage:
    """Only a bare JFIF JPEG with a single scan (sequential: one pass over the coefficients)
    and EOI right after it, that goes on as it came, of at most `INLINE_MAX_PIXELS`, decided
    from one walk of its markers and its header, checked from its head (`scan_head`);
    anything else raises `NotInline` before any decoding, and the CPU lane does it all
    (errors included)."""
    head = scan_head(data, jfif_walk(data)) if len(data) <= limits.max_bytes else None
    if head is None:
        raise NotInline()
    with pillow_errors(), open_image(head, "JPEG") as img:
        size = img.size
        if not _as_is_shape(img, data, limits) or size[0] * size[1] > INLINE_MAX_PIXELS:
            raise NotInline()
        plan = plan_decode(img, data, limits, check_only=True)  # the pixel limit; draft at 1/8
        if plan.cost > decode_budget(limits.decode_budget).capacity:  # the lane refuses it
            raise NotInline()
        img.load()
    return _prepared(data, data, size, size, encoded)


def _check_as_sent(img: Image.Image, data: bytes, jfif: Jfif) -> None:
    """Decode a JPEG that goes on as it came (`img`, its draft at 1/8 set by `plan_decode`)
    only to check it: from its head where it has one (`scan_head`: the headers and
    `CHECK_SCAN_BYTES` of the scan, not every coefficient), else whole (every coefficient
    is still read; the inverse DCTs cost 1/64)."""
    head = scan_head(data, jfif)
    if head is None:
        img.load()
        return
    with open_image(head, "JPEG") as cut:
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


def _sendable_as_is(img: Image.Image, data: bytes, limits: ImageLimits, jfif: Jfif) -> bool:
    """A JPEG that re-encoding would only make worse (a second lossy pass) and cost CPU for:
    within the long side, RGB or grey, not bloated (`_as_is_shape`), and nothing but a
    bare JFIF image (`jfif`, `jfif_walk`: nothing of the camera, place or person travels on, no
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
