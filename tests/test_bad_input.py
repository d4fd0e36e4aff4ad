"""Every client mistake gets a JSON error with a stable code before any stream, and
never a 500. Nothing is recorded for a rejected request."""

from __future__ import annotations

import asyncio
import base64
import collections
import gzip
import io
import json
import tracemalloc
import uuid
from typing import Any, ClassVar

import asyncpg
import pytest
from PIL import Image
from python_multipart.multipart import MultipartParser
from starlette.datastructures import Headers

from app.errors import ContentEncodingUnsupported, EcoscanError
from app.images.limits import ImageLimits
from app.intake import parsing as scan_input
from app.intake.parsing import (
    MAX_JSON_DEPTH,
    MAX_MULTIPART_PARTS,
    InputLimits,
    check_content_encoding,
    parse_scan_body,
)
from app.sim.server import RunningSimulator

from .conftest import SCAN_URL, Service, data_url, make_jpeg, run_scan, running_service, settings_for


async def scans_count(db: asyncpg.Connection) -> int:
    count: int = await db.fetchval("SELECT count(*) FROM scans")
    return count


MULTIPART = "multipart/form-data; boundary=x"
LIMITS = InputLimits(
    image=ImageLimits(max_bytes=10 * 1024 * 1024, max_pixels=40_000_000, long_side=1024, jpeg_quality=85),
    user_input_max_chars=500,
)
UNSUPPORTED = "IMAGE_TYPE_UNSUPPORTED"
TOO_MANY_PIXELS = "IMAGE_TOO_MANY_PIXELS"


def png_bomb(width: int, height: int) -> bytes:
    """A tiny PNG file declaring a huge canvas (compresses to almost nothing)."""
    img = Image.new("1", (width, height))
    out = io.BytesIO()
    img.save(out, "PNG", optimize=True)
    return out.getvalue()


@pytest.mark.parametrize(
    ("request_kwargs", "status", "code"),
    [
        ({"json": {}}, 400, "IMAGE_MISSING"),
        ({"json": {"image_url": ""}}, 400, "IMAGE_MISSING"),
        ({"json": {"user_input": "hi"}}, 400, "IMAGE_MISSING"),
        ({"files": {"other": ("a.txt", b"hello", "text/plain")}}, 400, "IMAGE_MISSING"),
        ({"json": {"image_url": data_url(b"this is not an image at all")}}, 400, "IMAGE_INVALID"),
        ({"json": {"image_url": data_url(make_jpeg(1)[:1500])}}, 400, "IMAGE_INVALID"),
        ({"json": {"image_url": "data:image/jpeg;base64,@@@notbase64@@@"}}, 400, "IMAGE_INVALID"),
        ({"files": {"image": ("x.jpg", b"GIF89a but not really a gif", "image/jpeg")}}, 400, "IMAGE_INVALID"),
        ({"files": {"image": ("x.jpg", make_jpeg(2)[:2000], "image/jpeg")}}, 400, "IMAGE_INVALID"),
        (
            {"json": {"image_url": "data:image/svg+xml;base64,PHN2Zz48L3N2Zz4="}},
            415,
            UNSUPPORTED,
        ),
        ({"json": {"image_url": "data:application/pdf;base64,JVBERi0="}}, 415, "IMAGE_TYPE_UNSUPPORTED"),
        (
            {"files": {"image": ("x.heic", b"\x00\x00\x00\x18ftypheic" + b"\x00" * 64, "image/heic")}},
            415,
            UNSUPPORTED,
        ),
        ({"json": {"image_url": "http://example.com/a.jpg"}}, 422, "INVALID_REQUEST"),
        ({"json": {"image_url": "ftp://example.com/a.jpg"}}, 422, "INVALID_REQUEST"),
        ({"json": {"image_url": 42}}, 422, "INVALID_REQUEST"),
        *(
            ({"json": {"image_url": url}}, 422, "IMAGE_URL_REJECTED")
            for url in (
                "https://localhost/a.jpg",
                "https://127.0.0.1/a.jpg",
                "https://[::1]/a.jpg",
                "https://10.1.2.3/a.jpg",
                "https://169.254.169.254/latest/meta-data",
                "https://127.1/a.jpg",
                "https://user:secret@example.com/a.jpg",
                "https://intranet/a.jpg",
                "https://a..b/a.jpg",
                "https://example.com/" + "a" * 2048,
                # issue 34's bypasses: the host is checked as httpx and yarl read it
                "https://127。0。0。1/a.jpg",
                "https://localhost。/a.jpg",
                "https://127.0.0.%31/a.jpg",
                "https://[::ffff:127.0.0.1]/a.jpg",
            )
        ),
        (  # a lone surrogate, as JSON escapes it (the SDK could not encode it to UTF-8)
            {
                "content": b'{"image_url": "https://a.b/c\\udfff"}',
                "headers": {"content-type": "application/json"},
            },
            422,
            "IMAGE_URL_REJECTED",
        ),
        ({"json": ["not", "an", "object"]}, 422, "INVALID_REQUEST"),
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 422, "INVALID_REQUEST"),
        (
            {"json": {"image_url": data_url(make_jpeg(1)), "user_input": "가" * 501}},
            422,
            "USER_INPUT_TOO_LONG",
        ),
        ({"json": {"image_url": data_url(make_jpeg(1)), "user_input": 7}}, 422, "INVALID_REQUEST"),
        # The schema says string: null is refused, not read as "no question".
        ({"json": {"image_url": data_url(make_jpeg(1)), "user_input": None}}, 422, "INVALID_REQUEST"),
        (
            {"content": b"image bytes", "headers": {"content-type": "image/jpeg"}},
            415,
            "CONTENT_TYPE_UNSUPPORTED",
        ),
        # Truncated multipart: no complete image part survives, so there is no image.
        ({"content": b"--x\r\nbroken", "headers": {"content-type": MULTIPART}}, 400, "IMAGE_MISSING"),
        (
            {"json": {"image_url": data_url(png_bomb(12000, 12000), "image/png")}},
            413,
            "IMAGE_TOO_MANY_PIXELS",
        ),
        (
            {
                "json": {"image_url": data_url(make_jpeg(1)), "user_input": "ok"},
                "headers": {"X-User-ID": "x" * 200},
            },
            422,
            "INVALID_REQUEST",
        ),
    ],
)
async def test_bad_input_is_rejected_before_streaming(
    service: Service, db: asyncpg.Connection, request_kwargs: dict[str, object], status: int, code: str
) -> None:
    before = await scans_count(db)
    outcome = await run_scan(service.client, **request_kwargs)
    assert outcome.status == status, outcome.body
    assert outcome.body["code"] == code
    assert isinstance(outcome.body["detail"], str) and "Traceback" not in outcome.body["detail"]
    assert outcome.headers["content-type"].startswith("application/json")
    assert await scans_count(db) == before


async def test_oversized_body_and_image_get_413(database_url: str, sim: RunningSimulator) -> None:
    settings = settings_for(database_url, sim, image_max_bytes=80_000)
    async with running_service(settings) as svc:
        big = make_jpeg(9, (2400, 1800), quality=97)
        assert len(big) > 80_000
        as_json = await run_scan(svc.client, json={"image_url": data_url(big)})
        assert (as_json.status, as_json.body["code"]) == (413, "IMAGE_TOO_LARGE")
        upload = await run_scan(svc.client, files={"image": ("big.jpg", big, "image/jpeg")})
        assert (upload.status, upload.body["code"]) == (413, "IMAGE_TOO_LARGE")
        huge_body = json.dumps({"image_url": "data:image/jpeg;base64," + "A" * 200_000}).encode()
        body = await run_scan(svc.client, content=huge_body, headers={"content-type": "application/json"})
        assert (body.status, body.body["code"]) == (413, "PAYLOAD_TOO_LARGE")


async def test_unknown_route_and_method_get_json_errors(service: Service) -> None:
    missing = await service.client.get("/api/v1/nope")
    assert missing.status_code == 404 and missing.json()["code"] == "NOT_FOUND"
    wrong = await service.client.get(SCAN_URL)
    assert wrong.status_code == 405 and wrong.json()["code"] == "METHOD_NOT_ALLOWED"
    assert wrong.headers["allow"] == "POST"


async def test_a_wrong_method_names_every_method_the_path_allows(service: Service) -> None:
    # "categories" is not a scan id: DELETE is a method the categories do not allow.
    categories = await service.client.delete("/api/v1/scan/categories")
    assert (categories.status_code, categories.json()["code"]) == (405, "METHOD_NOT_ALLOWED")
    assert categories.headers["allow"] == "GET"
    scan = f"/api/v1/scan/{uuid.uuid4()}"
    for method in ("OPTIONS", "PUT", "PATCH", "POST"):
        response = await service.client.request(method, scan)
        assert (response.status_code, response.json()["code"]) == (405, "METHOD_NOT_ALLOWED"), method
        assert response.headers["allow"] == "DELETE, GET", method
    events = await service.client.delete(f"{scan}/events")
    assert (events.status_code, events.headers["allow"]) == (405, "GET")
    # Any other segment is still read as a scan id, unknown like any other.
    unknown = await service.client.delete("/api/v1/scan/categoriesX")
    assert (unknown.status_code, unknown.json()["code"]) == (404, "SCAN_NOT_FOUND")


async def test_png_with_transparency_and_gif_are_accepted(service: Service) -> None:
    rgba = Image.new("RGBA", (300, 200), (10, 200, 30, 0))
    png = io.BytesIO()
    rgba.save(png, "PNG")
    gif = io.BytesIO()
    Image.new("P", (120, 90), 3).save(gif, "GIF")
    for raw, mime in ((png.getvalue(), "image/png"), (gif.getvalue(), "image/gif")):
        outcome = await run_scan(service.client, json={"image_url": data_url(raw, mime)})
        assert outcome.status == 200 and outcome.terminal.event == "done"


def test_data_url_helper_round_trips() -> None:
    raw = make_jpeg(1)
    assert base64.b64decode(data_url(raw).split(",", 1)[1]) == raw


# --- text that is not text, hostile JSON and multipart, encoded bodies -------------------

LEGIT_JSON = {"image_url": data_url(make_jpeg(1)), "user_input": "페트병 라벨은 어떻게 하나요?"}
URL = "https://example.com/a.jpg"


async def assert_still_serves(service: Service) -> None:
    outcome = await run_scan(service.client, json=LEGIT_JSON)
    assert outcome.status == 200 and outcome.terminal.event == "done", outcome.body


def user_input_part(raw: bytes) -> bytes:
    return (
        b'--x\r\nContent-Disposition: form-data; name="image"; filename="a.jpg"\r\n'
        b"Content-Type: image/jpeg\r\n\r\n" + make_jpeg(1) + b"\r\n"
        b'--x\r\nContent-Disposition: form-data; name="user_input"\r\n\r\n' + raw + b"\r\n--x--\r\n"
    )


@pytest.mark.parametrize(
    ("content", "content_type", "code"),
    [
        # JSON escapes: NUL, a lone high and low surrogate, noncharacters U+FFFE, U+10FFFF, U+FDD0
        *(
            (
                b'{"image_url": "%s", "user_input": "a%sb"}' % (URL.encode(), esc),
                "application/json",
                "INVALID_TEXT",
            )
            for esc in (b"\\u0000", b"\\ud800", b"\\udfff", b"\\ufffe", b"\\udbff\\udfff", b"\\ufdd0")
        ),
        # Raw bytes: a UTF-8-encoded surrogate (json.loads lets it through), U+FFFF
        *(
            (
                b'{"image_url": "%s", "user_input": "a%sb"}' % (URL.encode(), raw),
                "application/json",
                "INVALID_TEXT",
            )
            for raw in (b"\xed\xa0\x80", b"\xef\xbf\xbf")
        ),
        # A raw NUL (a control character) inside a JSON string is not JSON at all
        (
            b'{"image_url": "%s", "user_input": "a\x00b"}' % URL.encode(),
            "application/json",
            "INVALID_REQUEST",
        ),
        # The same in a multipart field, and bytes that are not UTF-8 at all
        *(
            (user_input_part(raw), MULTIPART, "INVALID_TEXT")
            for raw in (b"a\x00b", b"\xef\xbf\xbe", b"\xed\xa0\x80", b"\xff\xfe")
        ),
        # URLs: refused before the stream (the SDK cannot encode a lone surrogate)
        *(
            (b'{"image_url": "https://a.b/c%s"}' % esc, "application/json", "IMAGE_URL_REJECTED")
            for esc in (b"\\u0000", b"\\udfff", b"\\ud800", b"\\uffff", b"\\ufdef")
        ),
    ],
)
async def test_text_that_is_not_text_gets_422_not_a_database_outage(
    service: Service, db: asyncpg.Connection, content: bytes, content_type: str, code: str
) -> None:
    """PostgreSQL refuses NUL and asyncpg cannot encode a lone surrogate: those used to be
    a 503 DATABASE_UNAVAILABLE with Retry-After, retried forever; the URL ones a 200 and
    then INTERNAL_ERROR mid-stream. The database is never the validator."""
    before = await scans_count(db)
    outcome = await run_scan(service.client, content=content, headers={"content-type": content_type})
    assert (outcome.status, outcome.body["code"]) == (422, code), outcome.body
    assert "retry-after" not in outcome.headers
    assert await scans_count(db) == before
    await assert_still_serves(service)


async def test_x_user_id_that_is_not_printable_text_gets_a_4xx(service: Service) -> None:
    # NUL and control bytes never reach the app (the HTTP layer's 400); a C1 control byte
    # (obs-text, so legal HTTP) arrives as U+0085 and the X-User-ID check refuses it.
    host, port = service.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        body = json.dumps(LEGIT_JSON).encode()
        writer.write(
            b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-User-ID: a\x00b\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (SCAN_URL.encode(), len(body), body)
        )
        async with asyncio.timeout(10):
            status_line = await reader.readline()
    finally:
        writer.close()
    assert status_line.split()[1] == b"400"
    c1 = await run_scan(service.client, json=LEGIT_JSON, headers={"X-User-ID": b"a\x85b"})
    assert (c1.status, c1.body["code"]) == (422, "INVALID_REQUEST")
    await assert_still_serves(service)


@pytest.mark.parametrize(
    "content",
    [
        b"[" * 10_000 + b"]" * 10_000,
        b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
        b"[" * 100_000,  # never closed
        b'{"image_url": "%s", "x": %s}' % (URL.encode(), b"[" * 33 + b"]" * 33),
        # Flat but huge: millions of values for json.loads to build
        b"[" + b'"",' * 1_000_000 + b'""]',
        b'{"image_url": "%s", "x": [%s0]}' % (URL.encode(), b"0," * 2_000_000),
    ],
    ids=["array-10k", "object-10k", "unclosed-100k", "depth-33", "strings-1m", "numbers-2m"],
)
async def test_deep_or_huge_json_gets_422_not_a_500(service: Service, content: bytes) -> None:
    outcome = await run_scan(service.client, content=content, headers={"content-type": "application/json"})
    assert (outcome.status, outcome.body["code"]) == (422, "INVALID_REQUEST"), outcome.body
    await assert_still_serves(service)


def test_json_within_the_bounds_still_parses() -> None:
    nested = b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1)  # the object is one level
    # Brackets, quotes and escapes inside strings are not structure.
    text = '[{x}] " \\" \\\\ 가 😀 ' + "[" * 1000
    body = json.dumps({"image_url": URL, "user_input": text[:500], "extra": json.loads(nested)}).encode()
    parsed = parse_scan_body(body, "application/json", LIMITS)
    assert parsed.source == "url" and parsed.user_input == text[:500].strip()
    escaped = json.dumps({"image_url": URL, "user_input": "a/b"}).replace("/", "\\/").encode()
    assert parse_scan_body(escaped, "application/json", LIMITS).user_input == "a/b"


async def test_multipart_with_800k_parts_is_refused_at_the_ninth(service: Service) -> None:
    body = b"--x\r\n\r\nv\r\n" * 800_000 + b"--x--\r\n"
    assert len(body) < service.settings.image_max_bytes * 4 // 3  # under the body cap: parsed
    outcome = await run_scan(service.client, content=body, headers={"content-type": MULTIPART})
    assert (outcome.status, outcome.body["code"]) == (422, "INVALID_REQUEST"), outcome.body
    await assert_still_serves(service)


class CountingParser(MultipartParser):
    """python-multipart's parser, counting the callbacks it makes."""

    calls: ClassVar[collections.Counter[str]] = collections.Counter()

    def callback(
        self, name: Any, data: bytes | None = None, start: int | None = None, end: int | None = None
    ) -> None:
        CountingParser.calls[name] += 1
        super().callback(name, data, start, end)


@pytest.fixture
def counting_parser(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    CountingParser.calls = collections.Counter()
    monkeypatch.setattr(scan_input, "MultipartParser", CountingParser)
    return CountingParser.calls


def parse_peak(body: bytes) -> tuple[EcoscanError, int]:
    """The error parsing `body` raises, and the peak of memory allocated meanwhile."""
    tracemalloc.start()
    try:
        with pytest.raises(EcoscanError) as raised:
            parse_scan_body(body, MULTIPART, LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return raised.value, peak


def test_multipart_parsing_stops_at_the_first_part_over_the_count(
    counting_parser: collections.Counter[str],
) -> None:
    error, peak = parse_peak(b"--x\r\n\r\nv\r\n" * 800_000 + b"--x--\r\n")
    assert (error.code, error.message) == ("INVALID_REQUEST", "Too many multipart parts: the limit is 8.")
    # The parser saw the first 9 parts of 800,000 and was stopped at the 9th.
    assert counting_parser["part_begin"] == MAX_MULTIPART_PARTS + 1
    assert counting_parser["part_end"] == MAX_MULTIPART_PARTS
    assert peak < 1_000_000  # allocated, while the 8.8 MB body was parsed (it was +150 MB)


def test_multipart_parsing_stops_at_oversized_headers_and_fields(
    counting_parser: collections.Counter[str],
) -> None:
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 3000) for i in range(4))  # 12 KB in one part
    error, _ = parse_peak(b"--x\r\n" + headers + b"\r\nv\r\n" + b"--x\r\n\r\nv\r\n" * 1000 + b"--x--\r\n")
    assert error.code == "INVALID_REQUEST" and "headers" in error.message
    assert counting_parser["part_begin"] == 1 and counting_parser["part_end"] == 0

    counting_parser.clear()
    big_text = b'--x\r\nContent-Disposition: form-data; name="user_input"\r\n\r\n' + b"a" * 5_000_000
    error, peak = parse_peak(big_text + b"\r\n" + b"--x\r\n\r\nv\r\n" * 1000 + b"--x--\r\n")
    assert error.code == "USER_INPUT_TOO_LONG"
    assert counting_parser["part_begin"] == 1 and counting_parser["part_end"] == 0
    assert peak < 1_000_000  # the 5 MB field was never copied

    counting_parser.clear()
    big_image = b'--x\r\nContent-Disposition: form-data; name="image"; filename="a.jpg"\r\n\r\n'
    error, peak = parse_peak(big_image + b"\xff" * (LIMITS.image.max_bytes + 1) + b"\r\n--x--\r\n")
    assert error.code == "IMAGE_TOO_LARGE" and counting_parser["part_end"] == 0
    assert peak < 1_000_000


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate", "identity, gzip", "GZIP"])
async def test_an_encoded_body_gets_415(service: Service, db: asyncpg.Connection, encoding: str) -> None:
    before = await scans_count(db)
    raw = json.dumps(LEGIT_JSON).encode()
    outcome = await run_scan(
        service.client,
        content=gzip.compress(raw) if "gzip" in encoding.lower() else raw,
        headers={"content-type": "application/json", "content-encoding": encoding},
    )
    assert (outcome.status, outcome.body["code"]) == (415, "CONTENT_ENCODING_UNSUPPORTED"), outcome.body
    assert await scans_count(db) == before
    identity = await run_scan(service.client, json=LEGIT_JSON, headers={"content-encoding": "identity"})
    assert identity.status == 200 and identity.terminal.event == "done"
    await assert_still_serves(service)


def test_check_content_encoding() -> None:
    for ok in (
        {},
        {"content-encoding": "identity"},
        {"content-encoding": " Identity "},
        {"content-encoding": ""},
    ):
        check_content_encoding(Headers(ok))
    for bad in ({"content-encoding": "gzip"}, {"content-encoding": "identity,br"}):
        with pytest.raises(ContentEncodingUnsupported):
            check_content_encoding(Headers(bad))
    two_lines = Headers(raw=[(b"content-encoding", b"identity"), (b"content-encoding", b"gzip")])
    with pytest.raises(ContentEncodingUnsupported):
        check_content_encoding(two_lines)
