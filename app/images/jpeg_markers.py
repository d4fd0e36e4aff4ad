"""A JPEG read marker by marker, never decoded: whether it is a bare JFIF image, how many
scans it has and where its first scan's data lies, whether it spreads its components over
several scans, and the head of it that a check decodes."""

from __future__ import annotations

import re
from typing import NamedTuple

# More scans than this and a JPEG is refused: a progressive decoder passes over every
# coefficient once per scan, and a few bytes make a scan, so the decode's time grows with
# the scan count, not with the file's size. Encoders write ~10 (libjpeg's progressive
# script), a few dozen at most.
MAX_JPEG_SCANS = 100
_SOS_MARKER = b"\xff\xda"  # in entropy-coded data a 0xFF is always followed by 0x00 or a RST

# A JPEG sent as it came is checked by decoding its headers and this much of its scan.
CHECK_SCAN_BYTES = 256
_EOI_MARKER = b"\xff\xd9"

# What a bare JFIF image holds besides SOI, its APP0 and EOI: tables (DQT, DHT, DRI), one
# Huffman-coded frame header (SOF0-2: baseline, extended, progressive) and scans (SOS).
_SOS, _EOI = 0xDA, 0xD9
_TABLES = frozenset({0xDB, 0xC4, 0xDD})
_HUFFMAN_FRAMES = frozenset({0xC0, 0xC1, 0xC2})
_PROGRESSIVE_FRAME = 0xC2
_JFIF_HEADER = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00"  # SOI, then a 16-byte APP0


def too_many_scans(data: bytes) -> bool:
    """Whether a JPEG has more than `MAX_JPEG_SCANS` SOS markers, counted without a walk."""
    return data.count(_SOS_MARKER) > MAX_JPEG_SCANS


class Jfif(NamedTuple):
    """What one walk of a JPEG's markers tells (`jfif_walk`)."""

    scans: int  # SOS segments; 0: not a bare JFIF image
    sequential: bool  # its frame is SOF0/SOF1, not SOF2 (progressive)
    scan_data: int  # where its first scan's entropy-coded data starts
    scan_end: int  # and where it ends


_NOT_BARE = Jfif(0, False, 0, 0)


def jfif_walk(data: bytes) -> Jfif:
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
            return Jfif(scans, frame != _PROGRESSIVE_FRAME, first_scan, first_scan_end)
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
                return _NOT_BARE  # refused by `check_type` in the lane
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


def scan_head(data: bytes, jfif: Jfif) -> bytes | None:
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


def jpeg_is_multiscan(data: bytes) -> bool:
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
