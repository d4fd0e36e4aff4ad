"""A keep-alive connection's idle close never drops a request that has already arrived.

uvicorn closes a connection idle for `--timeout-keep-alive`. Under uvloop (libuv) a loop
iteration runs its due timers before it reads the sockets, so a loop that fell behind
(a stall, a busy second) could close a connection whose next request was already in the
kernel's receive queue: the client, which sent it in time, gets a reset and no answer,
and the service never counts it. A real process, stopped with SIGSTOP past the timeout
while the request arrives, is that stall."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from app.sim.server import RunningSimulator

from .service_process import ServiceProcess, service_env, service_process

KEEP_ALIVE_S = 1
REQUEST = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
    return int(lines[0].split()[1]), await reader.readexactly(int(fields["content-length"]))


async def test_a_request_waiting_when_the_idle_timeout_fires_is_answered(
    database_url: str, sim: RunningSimulator, tmp_path: Path
) -> None:
    env = service_env(database_url, sim, UVICORN_TIMEOUT_KEEP_ALIVE=str(KEEP_ALIVE_S))
    async with service_process(env, tmp_path / "service.log") as svc:
        for _ in range(3):  # the stall can land anywhere in a loop iteration: a few tries
            await _request_sent_while_stalled(svc)


async def answered_once(svc: ServiceProcess) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to `svc` whose first request was answered: now idle, kept alive."""
    host, port = svc.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(REQUEST)
    async with asyncio.timeout(10):
        assert (await read_response(reader))[0] == 200
    return reader, writer


async def _request_sent_while_stalled(svc: ServiceProcess) -> None:
    reader, writer = await answered_once(svc)
    try:
        # The service stalls; the next request arrives before the idle timeout, and the
        # service wakes after it with both the timer due and the request waiting.
        svc.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(KEEP_ALIVE_S * 0.5)
            writer.write(REQUEST)
            await writer.drain()
            await asyncio.sleep(KEEP_ALIVE_S * 1.5)
        finally:
            svc.signal(signal.SIGCONT)
        async with asyncio.timeout(10):
            status, body = await read_response(reader)
        assert (status, body) == (200, b'{"status":"ok"}')
    finally:
        writer.close()


async def test_an_idle_connection_is_still_closed_after_the_timeout(
    database_url: str, sim: RunningSimulator, tmp_path: Path
) -> None:
    env = service_env(database_url, sim, UVICORN_TIMEOUT_KEEP_ALIVE=str(KEEP_ALIVE_S))
    async with service_process(env, tmp_path / "service.log") as svc:
        reader, writer = await answered_once(svc)
        try:
            async with asyncio.timeout(10):
                assert await reader.read() == b""  # closed by the server, within the timeout and a bit
        finally:
            writer.close()
