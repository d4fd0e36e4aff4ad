"""`EventStreamResponse` under a real uvicorn, over real sockets: the body goes out,
pings fill a quiet stream, a disconnect or a client that stops reading ends the body
(its generator's `finally` runs) without a traceback."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send

from app.http.protocol import HttpToolsProtocol
from app.runtime.serving import serve_in_loop
from app.streaming.sse_response import EventStreamResponse

from .conftest import eventually


class Body:
    """A body iterator that records how it ended."""

    def __init__(self, chunks: Callable[[], AsyncIterator[bytes]]) -> None:
        self.chunks = chunks
        self.closed = asyncio.Event()
        self.ended_by: str | None = None

    async def __call__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.chunks():
                yield chunk
            self.ended_by = "end"
        except asyncio.CancelledError:
            self.ended_by = "cancelled"
            raise
        except GeneratorExit:
            self.ended_by = "closed"
            raise
        finally:
            self.closed.set()


def app_for(body: Body, **options: Any) -> Callable[[Scope, Receive, Send], Any]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await EventStreamResponse(body(), **options)(scope, receive, send)

    return app


async def events(*chunks: bytes, pause_s: float = 0.0) -> AsyncIterator[bytes]:
    for chunk in chunks:
        await asyncio.sleep(pause_s)
        yield chunk


async def forever() -> AsyncIterator[bytes]:
    await asyncio.Event().wait()
    yield b""


async def test_the_body_goes_out_whole_and_the_stream_ends() -> None:
    body = Body(lambda: events(b"data: 1\r\n\r\n", b"data: 2\r\n\r\n"))
    async with serve_in_loop(app_for(body, ping=5), http=HttpToolsProtocol) as url, httpx.AsyncClient() as c:
        response = await c.get(url)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.content == b"data: 1\r\n\r\ndata: 2\r\n\r\n"
    assert body.ended_by == "end"


async def test_a_quiet_stream_gets_pings_between_events() -> None:
    body = Body(lambda: events(b"data: 1\r\n\r\n", b"data: 2\r\n\r\n", pause_s=0.35))
    app = app_for(body, ping=0.1)
    async with serve_in_loop(app, http=HttpToolsProtocol) as url, httpx.AsyncClient() as c:
        text = (await c.get(url)).text
    assert text.count(": ping - ") >= 3
    assert text.replace("\r\n", "\n").split("\n\n")[-2:] == ["data: 2", ""]


async def test_a_disconnect_ends_the_body_at_once() -> None:
    body = Body(forever)
    async with serve_in_loop(app_for(body, ping=5), http=HttpToolsProtocol) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        writer.close()
        await asyncio.wait_for(body.closed.wait(), 5)
    assert body.ended_by == "cancelled"


async def test_a_client_that_stops_reading_is_let_go_after_the_send_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def flood() -> AsyncIterator[bytes]:
        while True:
            yield b"data: " + b"x" * 65536 + b"\r\n\r\n"
            await asyncio.sleep(0)

    body = Body(flood)
    app = app_for(body, ping=5, send_timeout=0.5, headers={"X-Scan-Id": "stuck"})
    caplog.set_level(logging.WARNING, logger="app.streaming.sse_response")
    async with serve_in_loop(app, http=HttpToolsProtocol) as url:
        host, port = url.removeprefix("http://").split(":")
        client = socket.create_connection((host, int(port)))
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read
            await asyncio.wait_for(body.closed.wait(), 10)
        finally:
            client.close()
    assert body.ended_by == "closed"
    assert await eventually(lambda: "stuck: the client stopped reading" in caplog.text)
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize(
    "headers",
    [
        None,
        {"Cache-Control": "no-store", "X-Accel-Buffering": "no", "X-Scan-Id": "s", "X-Scan-Token": "t"},
        {"cache-control": "no-cache", "Connection": "close", "Idempotent-Replayed": "true"},
    ],
)
def test_the_headers_are_those_sse_starlette_sends(headers: dict[str, str] | None) -> None:
    """Clients and proxies see the header list sse-starlette's `EventSourceResponse` sent."""
    ours = EventStreamResponse(events(), ping=5, headers=headers)
    theirs = EventSourceResponse(events(), ping=5, headers=headers)
    assert ours.raw_headers == theirs.raw_headers


async def test_head_gets_the_headers_and_no_stream() -> None:
    body = Body(forever)
    async with serve_in_loop(app_for(body, ping=5), http=HttpToolsProtocol) as url, httpx.AsyncClient() as c:
        response = await asyncio.wait_for(c.head(url), 5)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.content == b""
    assert body.ended_by is None and not body.closed.is_set()  # never started
