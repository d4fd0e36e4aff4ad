"""Serving the simulator with uvicorn in a running loop, on sockets we bind ourselves, with
an API port that the ``refuse`` outage can close and open again.

Closing means what a dead upstream looks like from outside: the listening socket goes away
(new connections are refused by the kernel) and the open connections are reset. Opening
again binds the same address and hands it to uvicorn's protocol, as its startup does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Generator
from typing import Any

import uvicorn

from app.runtime.serving import bind_socket, uvicorn_config

log = logging.getLogger("app.sim")


class _Server(uvicorn.Server):
    """Leaves the host process's signal handlers alone (the caller owns them)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@contextlib.asynccontextmanager
async def serve(app: Any, host: str, port: int) -> AsyncIterator[tuple[uvicorn.Server, int]]:
    """Serve ``app`` for the duration of the block; yields the server and its bound port."""
    sock = bind_socket(host, port)
    bound_port: int = sock.getsockname()[1]
    server = _Server(uvicorn_config(app))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("server exited during startup")
            await asyncio.sleep(0.005)
        yield server, bound_port
    finally:
        server.should_exit = True
        try:
            await task
        finally:
            sock.close()


class Listener:
    """The API port of one simulator: it can stop accepting and resume on the same address."""

    def __init__(self, server: uvicorn.Server, host: str, port: int) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.accepting = True

    def stop(self) -> int:
        """Close the listening socket and reset every open connection; returns how many."""
        for listening in self.server.servers:
            listening.close()
        reset = 0
        for connection in list(self.server.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is None or transport.is_closing():
                continue
            if transport.get_write_buffer_size():
                transport.close()  # a reply still going out (the PATCH that switched): flush, then FIN
            else:
                transport.abort()  # RST, as from a host whose process died
            reset += 1
        self.accepting = False
        log.info("simulator on port %d stopped listening (%d connections reset)", self.port, reset)
        return reset

    async def resume(self) -> None:
        """Listen again on the same address (OSError if it is taken meanwhile)."""
        if self.accepting:
            return
        server = self.server
        config = server.config
        sock = bind_socket(self.host, self.port)

        def protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            created: asyncio.Protocol = config.http_protocol_class(  # type: ignore[call-arg]
                config=config,
                server_state=server.server_state,
                app_state=server.lifespan.state,
                _loop=_loop,
            )
            return created

        loop = asyncio.get_running_loop()
        try:
            listening = await loop.create_server(protocol, sock=sock, backlog=config.backlog)
        except BaseException:
            sock.close()
            raise
        server.servers = [listening]
        self.accepting = True
        log.info("simulator on port %d listening again", self.port)
