"""Graceful shutdown: the drain.

uvicorn, told to stop (SIGTERM from Kubernetes, systemd, a load balancer's deploy,
or Ctrl-C), closes its listening sockets at once, waits for open connections, and
only then runs the lifespan's shutdown. New requests would find the port closed
instead of an answer that sends them elsewhere, and nothing would bound how long the
scans in flight go on or tell their clients why they end. So the service takes the
signal first:

1. `/readyz` turns 503 and new scans get 503 `SERVER_SHUTTING_DOWN` + `Retry-After`
   (the load balancer stops sending; the sockets stay open meanwhile);
2. scans in flight run to completion for up to `SHUTDOWN_DRAIN_S`;
3. the rest end with an `error` event `SERVER_SHUTDOWN` and `cancelled` rows;
4. only then is the signal handed to uvicorn, whose streams have all ended by now,
   and the lifespan closes everything, each close bounded.

A second signal skips what is left of the drain (step 3 at once); a third is handed
to uvicorn straight away (for Ctrl-C, its force quit).

When uvicorn is not the one handling signals (the tests' in-loop servers, another
ASGI server), nothing is installed and the lifespan's shutdown cancels what is left.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from app.scans.pipeline import ScanPipeline

log = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)

SignalHandler = Callable[[int, FrameType | None], Any]


class Drain:
    def __init__(self, pipeline: ScanPipeline, *, drain_s: float) -> None:
        self._pipeline = pipeline
        self._drain_s = drain_s
        self._hurry = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        return not self._pipeline.accepting

    def begin(self) -> asyncio.Task[None]:
        """Stop accepting and start draining (idempotent); the task ends when every scan has."""
        if self.task is None:
            self._pipeline.accepting = False
            self.task = asyncio.create_task(self._drain(), name="shutdown-drain")
        return self.task

    def hurry(self) -> None:
        """End the drain now: the scans still running get `SERVER_SHUTDOWN`."""
        self._hurry.set()

    async def _drain(self) -> None:
        in_flight = len(self._pipeline.running)
        log.info("shutdown: draining %d scans in flight (up to %.0f s)", in_flight, self._drain_s)
        idle = asyncio.create_task(self._pipeline.wait_idle(self._drain_s))
        hurried = asyncio.create_task(self._hurry.wait())
        try:
            await asyncio.wait((idle, hurried), return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            hurried.cancel()
        left = len(self._pipeline.running)
        if left:
            log.warning("shutdown: drain over, ending %d scans with SERVER_SHUTDOWN", left)
        await self._pipeline.cancel_all()
        log.info("shutdown: drained")


class SignalRouter:
    """Puts the drain in front of uvicorn's own signal handlers."""

    def __init__(self, drain: Drain, loop: asyncio.AbstractEventLoop) -> None:
        self._drain = drain
        self._loop = loop
        self._uvicorn_handlers: dict[int, SignalHandler] = {}
        self._received = 0

    def install(self) -> bool:
        """Take over SIGTERM/SIGINT if uvicorn holds them; False if it does not."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in HANDLED_SIGNALS:
            handler = signal.getsignal(sig)
            if isinstance(getattr(handler, "__self__", None), uvicorn.Server) and callable(handler):
                self._uvicorn_handlers[sig] = handler
                signal.signal(sig, self._on_signal)
        return bool(self._uvicorn_handlers)

    def restore(self) -> None:
        for sig, handler in self._uvicorn_handlers.items():
            signal.signal(sig, handler)
        self._uvicorn_handlers.clear()

    def _on_signal(self, sig: int, _frame: FrameType | None) -> None:
        # A signal handler runs between two bytecodes of whatever the loop was doing:
        # hand over to the loop and do nothing else here.
        self._loop.call_soon_threadsafe(self._handle, sig)

    def _handle(self, sig: int) -> None:
        self._received += 1
        if self._received == 1:
            log.info("shutdown: received %s", signal.Signals(sig).name)
            task = self._drain.begin()
            task.add_done_callback(lambda _task: self._forward(sig))
        elif self._received == 2:
            log.warning("shutdown: second signal, ending the drain now")
            self._drain.hurry()
        else:
            self._forward(sig)

    def _forward(self, sig: int) -> None:
        handler = self._uvicorn_handlers.get(sig)
        if handler is not None:
            handler(sig, None)
