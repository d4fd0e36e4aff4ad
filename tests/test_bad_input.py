"""Every client mistake gets a JSON error with a stable code before any stream, and
never a 500. Nothing is recorded for a rejected request."""

from __future__ import annotations

import base64
import io
import json

import asyncpg
import pytest
from PIL import Image

from app.sim.server import RunningSimulator

from .conftest import SCAN_URL, Service, data_url, make_jpeg, run_scan, running_service, settings_for


async def scans_count(db: asyncpg.Connection) -> int:
    count: int = await db.fetchval("SELECT count(*) FROM scans")
    return count


MULTIPART = "multipart/form-data; boundary=x"
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
