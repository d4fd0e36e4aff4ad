"""Image bytes out of a `data:` URL, checked for type and size before they are decoded."""

from __future__ import annotations

import binascii

from app.errors import ImageInvalid, ImageTooLarge, ImageTypeUnsupported
from app.images.sniff import SUPPORTED_MIME


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
