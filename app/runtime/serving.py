"""Serving an ASGI app with uvicorn inside an already running event loop, on a
socket we bind ourselves (so port 0 works and the real port is known before the
server starts). Used for the embedded simulator and by the tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Generator
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _EmbeddedConfig(uvicorn.Config):
    """Leaves the host process's logging alone. `uvicorn.Config` configures the process's
    `uvicorn.*` loggers (their levels, and without an access log it takes the access
    logger's handlers away): an embedded simulator's config turned the service's own
    access log off, so dev and prod logged differently."""

    def configure_logging(self) -> None:
        pass


class QuietHttpToolsProtocol(HttpToolsProtocol):
    """An embedded server's requests stay out of the host's access log (uvicorn logs
    every server's requests through the one `uvicorn.access` logger)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.access_log = False


class _EmbeddedServer(uvicorn.Server):
    """Leaves the host process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket, so port 0 resolves before the server starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # An explicit IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets
    # whose proto says TCP, and without it Nagle + delayed ACK add ~40 ms per response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def uvicorn_config(app: Any, **overrides: Any) -> uvicorn.Config:
    # No logging options: `_EmbeddedConfig` leaves logging to the host process.
    options: dict[str, Any] = {
        "lifespan": "off",
        "http": QuietHttpToolsProtocol,
        "proxy_headers": False,
        "server_header": False,
        "ws": "none",
        "timeout_graceful_shutdown": 2,
        # Outlive client pools' idle connections so reuse never races a server-side close.
        "timeout_keep_alive": 60,
        "backlog": 4096,
    }
    options.update(overrides)
    return _EmbeddedConfig(app, **options)


@contextlib.asynccontextmanager
async def serve_in_loop(
    app: Any, host: str = "127.0.0.1", port: int = 0, **config: Any
) -> AsyncIterator[str]:
    """Serve `app` for the duration of the block; yields its base URL."""
    sock = bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    server = _EmbeddedServer(uvicorn_config(app, **config))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("server exited during startup")
            await asyncio.sleep(0.005)
        shown = f"[{host}]" if ":" in host else host
        yield f"http://{shown}:{bound_port}"
    finally:
        server.should_exit = True
        try:
            await task
        finally:
            sock.close()
