"""The HTTP protocol's early refusal (app/http/early_refusal.py) on a real uvicorn server
and raw sockets, with an `EarlyRefusal` that refuses every scan: what happens to the
connection of a refused scan whose body does not come."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from app.http.early_refusal import STATE_KEY, EarlyRefusal
from app.http.protocol import HttpToolsProtocol
from app.http.routes import SCAN_PATH
from app.limits.loop_pacer import WAVE, LoopBusy

from .service_process import free_port

KEEP_ALIVE_S = 1  # uvicorn's --timeout-keep-alive, for this server
# A connection left idle is closed by then (the keep-alive timer's resolution is the loop's).
CLOSED_WITHIN_S = KEEP_ALIVE_S + 3.0


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await receive()
        refuse = EarlyRefusal(lambda: LoopBusy(WAVE, retry_after_s=2.0), lambda _cpu_s: None)
        scope["state"][STATE_KEY] = refuse
        await send({"type": "lifespan.startup.complete"})
        await receive()
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(0.3)
    body = b"reached the app"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"15")]})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def refusing_server() -> AsyncIterator[int]:
    async with refusing_uvicorn() as (port, _server):
        yield port


@contextlib.asynccontextmanager
async def refusing_uvicorn() -> AsyncIterator[tuple[int, uvicorn.Server]]:
    port = free_port()
    config = uvicorn.Config(
        _app,
        host="127.0.0.1",
        port=port,
        http=HttpToolsProtocol,
        lifespan="on",
        timeout_keep_alive=KEEP_ALIVE_S,
        log_level="warning",
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:  # noqa: ASYNC110 (uvicorn sets a flag, no event)
            await asyncio.sleep(0.01)
        yield port, server
    finally:
        server.should_exit = True
        await task


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server closed the connection within `seconds` (the refusal read first)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), seconds)
    assert head.startswith(b"HTTP/1.1 503 "), head
    length = int(
        next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))[15:]
    )
    await reader.readexactly(length)
    try:
        return await asyncio.wait_for(reader.read(), seconds) == b""
    except TimeoutError:
        return False


async def test_a_refused_scan_whose_body_stalls_does_not_hold_its_connection() -> None:
    """Refused early, a scan's body is skipped as it comes; one that stops coming (before
    its first byte, or half way) is closed after the keep-alive timeout, as the app's own
    refusal would leave it, not held open for as long as the client likes."""
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    async with refusing_server() as port:
        for sent in (b"", b"x" * 5000):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(head % SCAN_PATH.encode() + sent)
                started = time.monotonic()
                assert await closed_within(reader, CLOSED_WITHIN_S), f"held open with {len(sent)} body bytes"
                assert time.monotonic() - started < CLOSED_WITHIN_S
            finally:
                writer.close()


async def test_a_refused_scan_whose_body_comes_keeps_its_connection() -> None:
    """The whole body, slowly (each gap under the keep-alive timeout): skipped, the
    connection kept for the next request."""
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: 3000\r\n\r\n" % SCAN_PATH.encode()
    async with refusing_server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(head)
            for _ in range(3):
                await asyncio.sleep(KEEP_ALIVE_S * 0.6)
                writer.write(b"y" * 1000)
            writer.write(b"GET /next HTTP/1.1\r\nHost: t\r\n\r\n")
            async with asyncio.timeout(CLOSED_WITHIN_S):
                first = await reader.readuntil(b"\r\n\r\n")
                assert first.startswith(b"HTTP/1.1 503 ")
                await reader.readuntil(b"}")  # the refusal's JSON body
                second = await reader.readuntil(b"\r\n\r\n")
                assert second.startswith(b"HTTP/1.1 200 "), second
                assert await reader.readexactly(15) == b"reached the app"
        finally:
            writer.close()


# What a connection's unsent answers may hold while its client reads none: about one read's
# worth of requests (asyncio reads up to 256 KiB at once), each answered in ~4 times its size.
ANSWERS_HELD_MAX_BYTES = 3 * 1024 * 1024


async def test_a_client_that_reads_no_answers_cannot_fill_the_servers_memory_with_them() -> None:
    """Pipelined scans refused early, sent without reading a single answer: each answer is
    bigger than its request, and uvicorn's own path stops reading a connection whose
    answers are not taken; refusals answered here must too, or a client that never reads
    makes the server buffer four bytes for each one it sends. All of them are answered once
    the client reads."""
    request = b"POST %s HTTP/1.1\r\nHost: t\r\n\r\n" % SCAN_PATH.encode()
    count = 4 * 1024 * 1024 // len(request)
    async with refusing_uvicorn() as (port, server):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1024 * 1024)
        try:
            writer.write(request * count)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(writer.drain(), 2.0)  # as far as the server reads them
            await asyncio.sleep(0.5)
            held = sum(c.transport.get_write_buffer_size() for c in server.server_state.connections)
            assert held < ANSWERS_HELD_MAX_BYTES, f"{held} bytes of answers held for a client that reads none"
            answered = 0
            async with asyncio.timeout(60):
                while answered < count:
                    head = await reader.readuntil(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 503 "), head
                    await reader.readuntil(b"}")
                    answered += 1
                    if answered % 1000 == 0:
                        await writer.drain()
        finally:
            writer.close()


async def test_chunked_bodies_http_1_0_and_expect_100_continue() -> None:
    """A chunked body is skipped to its last chunk and the connection serves the next
    request; HTTP/1.0 is answered `connection: close` and closed once its body is read; a
    scan that waits for `100 Continue` goes on to the app (which asks the pacer itself)."""
    path = SCAN_PATH.encode()
    chunked = b"POST %s HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" % path
    chunked += b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    async with refusing_server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(chunked + b"GET /next HTTP/1.1\r\nHost: t\r\n\r\n")
            async with asyncio.timeout(CLOSED_WITHIN_S):
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 503 ")
                await reader.readuntil(b"}")
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
        finally:
            writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST %s HTTP/1.0\r\nContent-Length: 4\r\n\r\nbody" % path)
            async with asyncio.timeout(CLOSED_WITHIN_S):
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 503 ") and b"connection: close" in head.lower()
                await reader.readuntil(b"}")
                assert await reader.read() == b""
        finally:
            writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                b"POST %s HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n" % path
            )
            async with asyncio.timeout(CLOSED_WITHIN_S):
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 "), head  # the app answered it, not the protocol
        finally:
            writer.close()


async def test_a_scan_pipelined_behind_a_response_still_going_out_is_answered_in_order() -> None:
    """Answers go in the order of the requests: a scan pipelined behind one the app is
    still answering is not refused ahead of it (it reaches the app, in its turn)."""
    scan = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}" % SCAN_PATH.encode()
    async with refusing_server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n" + scan + scan)
            async with asyncio.timeout(CLOSED_WITHIN_S):
                statuses = []
                for _ in range(3):
                    head = await reader.readuntil(b"\r\n\r\n")
                    statuses.append(int(head.split()[1]))
                    await (reader.readexactly(15) if statuses[-1] == 200 else reader.readuntil(b"}"))
        finally:
            writer.close()
    assert statuses[:2] == [200, 200], statuses  # the slow one, then the scan behind it, by the app
