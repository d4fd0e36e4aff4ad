"""Turning a request body into a validated `ScanInput`, before any stream starts.

`parse_scan_body` is synchronous and runs in the CPU lane: a request may carry a
13 MB base64 data URL or a multi-megabyte upload, and JSON-decoding, base64-decoding,
multipart-splitting and image decoding all cost milliseconds of CPU that must not
stall the event loop. Multipart is parsed from memory (the body was already read
under the size cap), so no spooled temp files and no second thread pool.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal, cast

from python_multipart.multipart import MultipartParser, parse_options_header

from app.errors import (
    ContentTypeUnsupported,
    ImageMissing,
    InvalidRequest,
    UserInputTooLong,
)
from app.image_url import check_image_url
from app.images import ImageLimits, PreparedImage, decode_data_url, prepare_image

ImageSource = Literal["upload", "data_url", "url"]


@dataclass(frozen=True)
class InputLimits:
    image: ImageLimits
    user_input_max_chars: int

    @property
    def max_body_bytes(self) -> int:
        # A base64 data URL is 4/3 the image size; leave room for the JSON around it.
        return self.image.max_bytes * 4 // 3 + 64 * 1024


@dataclass(frozen=True)
class ScanInput:
    source: ImageSource
    image_url: str  # what the vision call sends: our prepared data URL, or the https URL
    user_input: str | None
    image: PreparedImage | None = None  # None for https URLs, passed through as is

    def without_image(self) -> ScanInput:
        return dataclasses.replace(self, image_url="", image=None)


def request_kind(content_type: str) -> Literal["json", "multipart"]:
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime == "application/json" or mime.endswith("+json"):
        return "json"
    if mime == "multipart/form-data":
        return "multipart"
    raise ContentTypeUnsupported()


def parse_scan_body(body: bytes | bytearray, content_type: str, limits: InputLimits) -> ScanInput:
    if request_kind(content_type) == "json":
        return _from_json(body, limits)
    return _from_multipart(body, content_type, limits)


def _from_json(body: bytes | bytearray, limits: InputLimits) -> ScanInput:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("The body is not valid JSON.") from None
    if not isinstance(payload, dict):
        raise InvalidRequest("The JSON body must be an object.")
    user_input = _user_input(payload.get("user_input"), limits)
    url = payload.get("image_url")
    if url is None or url == "":
        raise ImageMissing()
    if not isinstance(url, str):
        raise InvalidRequest("image_url must be a string.")
    if url.startswith("data:"):
        data = decode_data_url(url, limits.image.max_bytes)
        image = prepare_image(data, limits.image)
        return ScanInput("data_url", image.data_url, user_input, image)
    if url[:8].lower() == "https://":
        return ScanInput("url", check_image_url(url), user_input)
    raise InvalidRequest("image_url must be an https:// URL or a data:image/...;base64 URL.")


def _user_input(value: Any, limits: InputLimits) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest("user_input must be a string.")
    value = value.strip()
    if len(value) > limits.user_input_max_chars:
        raise UserInputTooLong(
            f"user_input has {len(value)} characters; the limit is {limits.user_input_max_chars}."
        )
    return value or None


@dataclass
class _Part:
    name: str = ""
    filename: str | None = None
    data: bytearray | None = None


def _from_multipart(body: bytes | bytearray, content_type: str, limits: InputLimits) -> ScanInput:
    _mime, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise InvalidRequest("multipart/form-data without a boundary.")
    parts = _split_multipart(body, boundary)
    text_input = next((p for p in parts if p.name == "user_input"), None)
    user_input = _user_input(
        _decode_text(text_input.data) if text_input and text_input.data is not None else None,
        limits,
    )
    image_part = next((p for p in parts if p.name == "image"), None)
    if image_part is None or not image_part.data:
        raise ImageMissing()
    image = prepare_image(bytes(image_part.data), limits.image)
    return ScanInput("upload", image.data_url, user_input, image)


def _decode_text(data: bytearray) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("user_input must be UTF-8 text.") from None


def _split_multipart(body: bytes | bytearray, boundary: bytes) -> list[_Part]:
    parts: list[_Part] = []
    header_field = bytearray()
    header_value = bytearray()
    current = _Part()

    def on_part_begin() -> None:
        nonlocal current
        current = _Part(data=bytearray())

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header_field.extend(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header_value.extend(data[start:end])

    def on_header_end() -> None:
        if bytes(header_field).lower() == b"content-disposition":
            _disposition, options = parse_options_header(bytes(header_value))
            current.name = options.get(b"name", b"").decode("utf-8", "replace")
            filename = options.get(b"filename")
            current.filename = filename.decode("utf-8", "replace") if filename else None
        header_field.clear()
        header_value.clear()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        assert current.data is not None
        current.data.extend(data[start:end])

    def on_part_end() -> None:
        parts.append(current)

    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    try:
        # bytearray works at run time (only slicing and find are used); typed for bytes.
        parser.write(cast(bytes, body))
        parser.finalize()
    except Exception:  # python-multipart raises several error types for bad input
        raise InvalidRequest("Malformed multipart body.") from None
    if len(parts) > 8:
        raise InvalidRequest("Too many multipart fields.")
    return parts
