"""An image's type, sniffed from its bytes: a client's Content-Type or data-URL label is a
claim, the bytes are the fact. Types we recognise but do not accept are told apart from
bytes that are no image at all (415 rather than 400)."""

from __future__ import annotations

import re
import struct

# Magic numbers -> (Pillow format, MIME type).
_SIGNATURES: tuple[tuple[bytes, str, str], ...] = (
    (b"\xff\xd8\xff", "JPEG", "image/jpeg"),
    (b"\x89PNG\r\n\x1a\n", "PNG", "image/png"),
    (b"GIF87a", "GIF", "image/gif"),
    (b"GIF89a", "GIF", "image/gif"),
)
SUPPORTED_MIME = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
PILLOW_FORMAT = {"image/jpeg": "JPEG", "image/png": "PNG", "image/gif": "GIF", "image/webp": "WEBP"}

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
