"""Turning a request body into a validated `ScanInput`, before any stream starts.

`parse_scan_body` is synchronous and runs in the CPU lane (a small body on the loop, with
`inline`: app/intake/acceptance.py, `INLINE_MAX_BODY_BYTES`): a request may carry a
13 MB base64 data URL or a multi-megabyte upload, and JSON-decoding, base64-decoding,
multipart-splitting and image decoding all cost milliseconds of CPU that must not
stall the event loop. Multipart is parsed from memory (the body was already read
under the size cap), so no spooled temp files and no second thread pool.

Every cost is bounded before it is paid: JSON is pre-scanned (without recursion) for
its nesting depth and number of values before a parser builds anything; multipart
parsing stops at the first part over a limit (part count, header bytes, field size),
not after splitting the whole body. Text fields are checked here, never left for the
database or the SDK to refuse: NUL, lone surrogates and Unicode noncharacters are
`INVALID_TEXT`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, cast

import orjson
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.datastructures import Headers

from app.errors import (
    ContentEncodingUnsupported,
    ContentTypeUnsupported,
    ImageMissing,
    ImageTooLarge,
    InvalidRequest,
    InvalidText,
    RequestRejected,
    UserInputTooLong,
)
from app.images.data_url import decode_data_url
from app.images.limits import ImageLimits
from app.images.prepare import prepare_image
from app.intake.image_url import check_image_url, describe_char
from app.stages.context import ScanInput

# The valid JSON body is one flat object; these leave generous room for extra fields.
MAX_JSON_DEPTH = 32
MAX_JSON_TOKENS = 1024  # strings, brackets and commas: bounds the values the parser builds
# Multipart: an image, user_input and a few fields we ignore.
MAX_MULTIPART_PARTS = 8
MAX_PART_HEADER_BYTES = 8 * 1024  # one part's header names and values together

# NUL (PostgreSQL refuses it in text), lone surrogates (not encodable as UTF-8) and the
# 66 Unicode noncharacters (U+FDD0..U+FDEF and the last two code points of every plane).
_NOT_TEXT = re.compile(
    "[\\x00\\ud800-\\udfff\\ufdd0-\\ufdef"
    + "".join(f"\\U{plane << 16 | 0xFFFE:08x}\\U{plane << 16 | 0xFFFF:08x}" for plane in range(17))
    + "]"
)
_JSON_STRUCTURE = re.compile(r'["\[\]{},]')
_JSON_STRINGS = json.JSONDecoder()  # strict, like json.loads: used to skip escaped strings


@dataclass(frozen=True)
class InputLimits:
    image: ImageLimits
    user_input_max_chars: int

    @property
    def max_body_bytes(self) -> int:
        # A base64 data URL is 4/3 the image size; leave room for the JSON around it.
        return self.image.max_bytes * 4 // 3 + 64 * 1024

    @property
    def user_input_max_bytes(self) -> int:
        # UTF-8 takes at most 4 bytes a character; 1 KiB more for whitespace we strip.
        return self.user_input_max_chars * 4 + 1024


def request_kind(content_type: str) -> Literal["json", "multipart"]:
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime == "application/json" or mime.endswith("+json"):
        return "json"
    if mime == "multipart/form-data":
        return "multipart"
    raise ContentTypeUnsupported()


def check_content_encoding(headers: Headers) -> None:
    """415 `CONTENT_ENCODING_UNSUPPORTED` for a body sent with any `Content-Encoding` but
    `identity` (gzip, br, deflate...): we never decompress. Call before reading the body."""
    for value in headers.getlist("content-encoding"):
        for coding in value.split(","):
            coding = coding.strip().lower()
            if coding and coding != "identity":
                raise ContentEncodingUnsupported(
                    f"Content-Encoding {coding[:32]!r} is not supported: send the body uncompressed."
                )


def check_text(value: str, field: str) -> str:
    """`value` unless it holds NUL, a lone surrogate or a noncharacter (`INVALID_TEXT`)."""
    bad = _NOT_TEXT.search(value)
    if bad is not None:
        raise InvalidText(
            f"{field} contains {describe_char(bad.group())} at index {bad.start()}; "
            "send text without NUL, lone surrogates or Unicode noncharacters."
        )
    return value


def parse_scan_body(
    body: bytes | bytearray, content_type: str, limits: InputLimits, *, inline: bool = False
) -> ScanInput:
    """`inline`: on the event loop; an image that needs more than a check raises
    `NotInline` (app/images/prepare.py) for the CPU lane to do it all."""
    if request_kind(content_type) == "json":
        return _from_json(body, limits, inline)
    return _from_multipart(body, content_type, limits, inline)


def _from_json(body: bytes | bytearray, limits: InputLimits, inline: bool) -> ScanInput:
    try:
        # What json.loads does with bytes (UTF-8/16/32, BOM), done here so that the
        # pre-scan sees the very text json.loads parses.
        text = body.decode(json.detect_encoding(body), "surrogatepass")
        _check_json_shape(text)
        payload = _loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise InvalidRequest("The body is not valid JSON.") from None
    if not isinstance(payload, dict):
        raise InvalidRequest("The JSON body must be an object.")
    if "user_input" in payload and payload["user_input"] is None:
        # The document says string: null is a client's bug, not a way to say "none".
        raise InvalidRequest("user_input must be a string (leave it out to send none).")
    user_input = _user_input(payload.get("user_input"), limits)
    url = payload.get("image_url")
    if url is None or url == "":
        raise ImageMissing()
    if not isinstance(url, str):
        raise InvalidRequest("image_url must be a string.")
    if url.startswith("data:"):
        data, encoded = decode_data_url(url, limits.image.max_bytes)
        image = prepare_image(data, limits.image, encoded=encoded, inline=inline)
        return ScanInput("data_url", image.data_url, user_input, image)
    if url[:8].lower() == "https://":
        return ScanInput("url", check_image_url(url), user_input)
    raise InvalidRequest("image_url must be an https:// URL or a data:image/...;base64 URL.")


def _loads(text: str) -> Any:
    """orjson (several times json.loads on a data URL body); where it refuses, json.loads
    decides, so what is accepted and how it fails stay json.loads's (NaN, lone surrogate
    escapes, which the text checks then name)."""
    try:
        return orjson.loads(text)
    except ValueError:
        return json.loads(text)


def _check_json_shape(text: str) -> None:
    """Refuse JSON nested deeper than `MAX_JSON_DEPTH` or with more than
    `MAX_JSON_TOKENS` strings, brackets and commas, before `json.loads` recurses into it
    or builds its values. Iterative; strings are skipped with `str.find` (or the C
    string scanner when they hold escapes), so the cost is linear with a small constant,
    and the loop runs at most `MAX_JSON_TOKENS` times. On valid JSON it sees exactly
    the structure json.loads sees; on invalid JSON, json.loads stops no later."""
    depth = tokens = pos = 0
    search = _JSON_STRUCTURE.search
    while (match := search(text, pos)) is not None:
        tokens += 1
        if tokens > MAX_JSON_TOKENS:
            raise InvalidRequest(
                f"The JSON body has more than {MAX_JSON_TOKENS} values; send one flat object."
            )
        char, pos = match.group(), match.end()
        if char == '"':
            pos = _json_string_end(text, match.start())
        elif char in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise InvalidRequest(f"The JSON body is nested deeper than {MAX_JSON_DEPTH} levels.")
        elif char in "]}":
            depth -= 1
            if depth < 0:
                raise InvalidRequest("The body is not valid JSON.")


def _json_string_end(text: str, quote: int) -> int:
    """The index just past the JSON string that opens at `text[quote]`."""
    close = text.find('"', quote + 1)
    if close == -1:
        raise InvalidRequest("The body is not valid JSON.")
    if text.find("\\", quote + 1, close) == -1:
        return close + 1  # no escapes (the usual case, data URLs included): no copy
    _value, end = _JSON_STRINGS.raw_decode(text, quote)  # ValueError if malformed
    return end


def _user_input(value: Any, limits: InputLimits) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest("user_input must be a string.")
    value = check_text(value, "user_input").strip()
    if len(value) > limits.user_input_max_chars:
        raise UserInputTooLong(
            f"user_input has {len(value)} characters; the limit is {limits.user_input_max_chars}."
        )
    return value or None


def _from_multipart(
    body: bytes | bytearray, content_type: str, limits: InputLimits, inline: bool
) -> ScanInput:
    _mime, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise InvalidRequest("multipart/form-data without a boundary.")
    fields = _split_multipart(body, boundary, limits)
    text_input = fields.get("user_input")
    user_input = _user_input(_decode_text(text_input) if text_input is not None else None, limits)
    image_data = fields.get("image")
    if not image_data:
        raise ImageMissing()
    image = prepare_image(bytes(image_data), limits.image, inline=inline)
    return ScanInput("upload", image.data_url, user_input, image)


def _decode_text(data: bytearray) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidText(f"user_input is not valid UTF-8 (byte {exc.start}).") from None


@dataclass
class _Part:
    name: str = ""
    header_bytes: int = 0
    data: bytearray | None = None  # kept for the first image and user_input parts only


def _split_multipart(body: bytes | bytearray, boundary: bytes, limits: InputLimits) -> dict[str, bytearray]:
    """The data of the first complete `image` and `user_input` parts; every other part
    is skipped without a copy. The limits are enforced in the parser's callbacks, so
    parsing stops at the first part over one: the part count, a part's header bytes, the
    size of the field being kept."""
    max_bytes = {"image": limits.image.max_bytes, "user_input": limits.user_input_max_bytes}
    fields: dict[str, bytearray] = {}
    header_field = bytearray()
    header_value = bytearray()
    current = _Part()
    count = 0

    def on_part_begin() -> None:
        nonlocal current, count
        count += 1
        if count > MAX_MULTIPART_PARTS:
            raise InvalidRequest(f"Too many multipart parts: the limit is {MAX_MULTIPART_PARTS}.")
        current = _Part()

    def add_header_bytes(n: int) -> None:
        current.header_bytes += n
        if current.header_bytes > MAX_PART_HEADER_BYTES:
            raise InvalidRequest(f"A multipart part has more than {MAX_PART_HEADER_BYTES} bytes of headers.")

    def on_header_field(data: bytes, start: int, end: int) -> None:
        add_header_bytes(end - start)
        header_field.extend(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        add_header_bytes(end - start)
        header_value.extend(data[start:end])

    def on_header_end() -> None:
        if bytes(header_field).lower() == b"content-disposition":
            _disposition, options = parse_options_header(bytes(header_value))
            current.name = options.get(b"name", b"").decode("utf-8", "replace")
        header_field.clear()
        header_value.clear()

    def on_headers_finished() -> None:
        if current.name in max_bytes and current.name not in fields:
            current.data = bytearray()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if current.data is None:
            return
        if len(current.data) + (end - start) > max_bytes[current.name]:
            raise _field_too_large(current.name, limits)
        current.data += memoryview(data)[start:end]

    def on_part_end() -> None:
        # Only complete parts count: a truncated body's last part is not used.
        if current.data is not None:
            fields[current.name] = current.data

    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    try:
        # bytearray works at run time (only slicing and find are used); typed for bytes.
        parser.write(cast(bytes, body))
        parser.finalize()
    except RequestRejected:
        raise  # a limit, raised from a callback: parsing stopped there
    except Exception:  # python-multipart raises several error types for bad input
        raise InvalidRequest("Malformed multipart body.") from None
    return fields


def _field_too_large(name: str, limits: InputLimits) -> RequestRejected:
    if name == "image":
        return ImageTooLarge()
    return UserInputTooLong(
        f"user_input is larger than {limits.user_input_max_bytes} bytes; "
        f"the limit is {limits.user_input_max_chars} characters."
    )
