"""The HTTP layer under the app (app/http/protocol.py, app/http/head_limits.py): request
heads are bounded and protocol-level rejections get the JSON error shape, over raw
sockets; a bare `uvicorn app.main:app` process refuses big heads too."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from app.http.head_limits import MAX_REQUEST_HEADERS
from app.http.protocol import MAX_REQUEST_HEAD_BYTES
from app.sim.server import RunningSimulator

from .conftest import Service
from .service_process import ServiceProcess, service_env, service_process

# A refused head is answered as soon as it has been read: well within this.
REFUSAL_TIMEOUT_S = 5.0
# What refusing eight 1 MB heads at once may add to the process's resident memory: the
# heads themselves, once each, and no more.
HEAD_MEMORY_GROWTH_MAX_BYTES = 24 * 1024 * 1024


async def exchange(svc: Service | ServiceProcess, raw: bytes) -> tuple[int, dict[str, str], Any, bool]:
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


def resident_bytes(svc: ServiceProcess) -> int:
    """The process's resident memory, from /proc."""
    status = Path(f"/proc/{svc.process.pid}/status").read_text()
    (line,) = [line for line in status.splitlines() if line.startswith("VmRSS:")]
    return int(line.split()[1]) * 1024


def one_megabyte_header() -> bytes:
    return b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Filler: " + b"a" * (1024 * 1024) + b"\r\n\r\n"


def ten_thousand_headers() -> bytes:
    fields = b"".join(b"X-H%d: v\r\n" % i for i in range(10_000))
    return b"GET /healthz HTTP/1.1\r\nHost: t\r\n" + fields + b"\r\n"


@pytest.fixture
async def bare_uvicorn(database_url: str, sim: RunningSimulator, tmp_path: Path) -> Any:
    """`uvicorn app.main:app` with no `--http` (uvicorn picks its own httptools protocol)."""
    env = service_env(database_url, sim)
    env.pop("UVICORN_HTTP", None)
    async with service_process(env, tmp_path / "service.log", our_protocol=False) as svc:
        yield svc


@pytest.mark.parametrize(
    "head", [one_megabyte_header, ten_thousand_headers], ids=["1MB-header", "10k-headers"]
)
async def test_a_bare_uvicorn_refuses_big_heads_with_431_json(
    bare_uvicorn: ServiceProcess, head: Any
) -> None:
    raw = head()
    before = resident_bytes(bare_uvicorn)
    started = time.perf_counter()
    async with asyncio.timeout(REFUSAL_TIMEOUT_S):
        answers = await asyncio.gather(*(exchange(bare_uvicorn, raw) for _ in range(8)))
    assert time.perf_counter() - started < REFUSAL_TIMEOUT_S
    for status, headers, body, closed in answers:
        assert (status, body["code"]) == (431, "REQUEST_HEADERS_TOO_LARGE")
        assert headers["content-type"] == "application/json" and closed
    assert resident_bytes(bare_uvicorn) - before < HEAD_MEMORY_GROWTH_MAX_BYTES
    # The process serves on as before.
    status, _, body, _ = await exchange(
        bare_uvicorn, b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    assert (status, body) == (200, {"status": "ok"})


async def test_more_header_fields_than_the_bound_get_431_json(service: Service) -> None:
    # Small fields, well under the byte bound: the count alone refuses them.
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(MAX_REQUEST_HEADERS + 1))
    raw = b"GET /healthz HTTP/1.1\r\nHost: t\r\n" + fields + b"\r\n"
    assert len(raw) < MAX_REQUEST_HEAD_BYTES
    status, headers, body, closed = await exchange(service, raw)
    assert (status, body["code"]) == (431, "REQUEST_HEADERS_TOO_LARGE")
    assert "header fields" in body["detail"] and closed
    assert headers["content-type"] == "application/json"


async def test_a_big_head_arriving_in_one_read_is_refused_by_the_app(service: Service) -> None:
    # 40 KiB sent at once may complete in a single read, which the protocol does not
    # count as head bytes: the app's own check refuses it.
    raw = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Filler: " + b"a" * (40 * 1024) + b"\r\n\r\n"
    status, _, body, closed = await exchange(service, raw)
    assert (status, body["code"]) == (431, "REQUEST_HEADERS_TOO_LARGE") and closed


async def test_uvicorn_http_from_the_environment_gives_json_for_malformed_http(
    database_url: str, sim: RunningSimulator, tmp_path: Path
) -> None:
    """What the image does: UVICORN_HTTP names our protocol, the command has no flag."""
    env = service_env(database_url, sim, UVICORN_HTTP="app.http.protocol:HttpToolsProtocol")
    async with service_process(env, tmp_path / "service.log", our_protocol=False) as svc:
        raw = b"POST /api/v1/scan/classify/completion HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n{}"
        status, headers, body, closed = await exchange(svc, raw)
        assert (status, body["code"]) == (400, "BAD_HTTP_REQUEST")
        assert headers["content-type"] == "application/json" and closed
