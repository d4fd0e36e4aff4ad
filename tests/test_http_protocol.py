"""The HTTP layer under the app (app/http/protocol.py): request heads are bounded and
protocol-level rejections get the JSON error shape, over raw sockets."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from app.http.protocol import MAX_REQUEST_HEAD_BYTES

from .conftest import Service


async def exchange(svc: Service, raw: bytes) -> tuple[int, dict[str, str], Any, bool]:
    """Send raw bytes; the status, headers, JSON body, and whether the server closed."""
    host, port = svc.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
            body = await reader.readexactly(int(headers["content-length"]))
            closed = await reader.read() == b""
    finally:
        writer.close()
    return int(lines[0].split()[1]), headers, json.loads(body), closed


async def test_an_oversized_request_head_gets_431_json_and_a_closed_connection(service: Service) -> None:
    # Twice the bound and still no end of head (as a 16 MB header looks after 32 KB).
    # Small enough to be read whole, so the server closes cleanly instead of resetting.
    partial = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Filler: " + b"a" * (2 * MAX_REQUEST_HEAD_BYTES)
    status, headers, body, closed = await exchange(service, partial)
    assert (status, body["code"]) == (431, "REQUEST_HEADERS_TOO_LARGE")
    assert headers["content-type"] == "application/json" and closed


async def test_ordinary_headers_are_accepted(service: Service) -> None:
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(60))  # ~7 KB
    raw = b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n" + headers + b"\r\n"
    status, _, body, _ = await exchange(service, raw)
    assert (status, body) == (200, {"status": "ok"})


async def test_a_malformed_content_length_gets_a_json_400(service: Service) -> None:
    raw = b"POST /api/v1/scan/classify/completion HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n{}"
    status, headers, body, closed = await exchange(service, raw)
    assert (status, body["code"]) == (400, "BAD_HTTP_REQUEST")
    assert headers["content-type"] == "application/json" and closed


async def test_control_characters_in_a_header_get_a_json_400(service: Service) -> None:
    raw = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Bad: a\x01b\r\n\r\n"
    status, _, body, _ = await exchange(service, raw)
    assert (status, body["code"]) == (400, "BAD_HTTP_REQUEST")
