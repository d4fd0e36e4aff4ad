"""How a scan's SSE bytes go out: `EventStreamResponse`, a `text/event-stream` response
of our own on Starlette's public `StreamingResponse` and the ASGI HTTP messages.

Why not sse-starlette's `EventSourceResponse`: it runs every response as an anyio task
group of four tasks (the body, a pinger, a shutdown listener, a disconnect listener) and
wraps every send in a cancel scope, a cost that k6/cpu_side_by_side.py shows plainly in
CPU per scan. Here the body is sent from the request's own task; one timer, the
watchdog, bounds every send by `send_timeout` (a timer per send would cost more than the
send); one small task waits for the client's disconnect; the ping is a timer that starts
a task only when a ping is due (scans are usually over before the first).

What it keeps of sse-starlette's response, so clients see no difference: its headers
(`Cache-Control: no-store` unless given, `Connection: keep-alive`, `X-Accel-Buffering:
no`, `text/event-stream; charset=utf-8`), its ping comment (`: ping - <UTC time>`), and
HEAD answered with the headers alone. What it leaves out: a shutdown listener. The drain
(app/scans/drain.py) takes SIGTERM first and ends every scan with a terminal event
before uvicorn hears of it; each stream closes after its terminal event.

Ending early, the body iterator is closed, so its `finally` runs (the scan's follower
detaches): when the client disconnects, or stops reading for `send_timeout` seconds (a
warning here, and uvicorn's own line about the unfinished response; no traceback).

Relies on, as of Starlette 1.10 and uvicorn 0.54: `StreamingResponse.__init__` setting
`body_iterator`, `status_code`, `raw_headers` and `background`; the ASGI HTTP messages
(`http.response.start`, `http.response.body`, `http.disconnect`); and a server that
reports a finished response to `receive` as `http.disconnect` (uvicorn does).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime

from starlette.datastructures import MutableHeaders
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger(__name__)

# Closing the body runs its `finally` (ours only detach, without awaiting): bounded all the same.
BODY_CLOSE_TIMEOUT_S = 5.0


class EventStreamResponse(StreamingResponse):
    """`content` yields SSE frames as bytes; `ping` seconds of quiet bring a ping comment
    (0: none); a send that waits `send_timeout` seconds ends the stream."""

    media_type = "text/event-stream"
    body_iterator: AsyncIterator[bytes]

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        ping: float,
        send_timeout: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        sse_headers = MutableHeaders(headers=dict(headers or {}))
        sse_headers.setdefault("Cache-Control", "no-store")
        sse_headers["Connection"] = "keep-alive"
        sse_headers["X-Accel-Buffering"] = "no"
        super().__init__(content, headers=sse_headers)
        self.ping_s = ping
        self.send_timeout = send_timeout
        self.active = True  # false once the body has stopped, for whatever reason
        self._stopped: str | None = None  # why it stopped early: "disconnect" or "send timeout"
        self._ended = False  # the last body message went out
        self._stream_task: asyncio.Task[object] | None = None
        self._lock = asyncio.Lock()  # a ping and a body send never go out at once
        self._ping_timer: asyncio.TimerHandle | None = None
        self._ping_task: asyncio.Task[None] | None = None
        self._sending_since: float | None = None  # the loop's time when the send in progress began
        self._watchdog: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"].upper() == "HEAD":  # an endless stream must not start for HEAD
            await send(self._start())
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await self._stream(receive, send)
        if self.background is not None:
            await self.background()

    async def _stream(self, receive: Receive, send: Send) -> None:
        self._stream_task = task = asyncio.current_task()
        assert task is not None
        listener = asyncio.create_task(self._listen_for_disconnect_and_stop(receive))
        self._arm_ping(send)
        self._arm_watchdog()
        try:
            await self._send_body(send)
        except asyncio.CancelledError:
            if self._stopped is None or task.uncancel() > 0:
                raise  # not (only) our own stop: someone else cancels this request
        finally:
            self.active = False
            listener.cancel()
            self._disarm_ping()
            if self._watchdog is not None:
                self._watchdog.cancel()
            async with asyncio.timeout(BODY_CLOSE_TIMEOUT_S):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if self._stopped == "send timeout":
            log.warning(
                "%s: the client stopped reading for %.0f s; stream closed",
                self.headers.get("x-scan-id"),
                self.send_timeout,
            )

    async def _send_body(self, send: Send) -> None:
        await send(self._start())
        async for chunk in self.body_iterator:
            if not self.active:  # stopped, should a body swallow the one cancellation
                return
            await self._send(send, chunk)
        await self._send(send, b"", more_body=False)
        # Before anything else runs: uvicorn reports the finished response to `receive` as a
        # disconnect, which must not stop anything now.
        self._ended = True

    def _start(self) -> Message:
        return {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}

    async def _send(self, send: Send, chunk: bytes, *, more_body: bool = True) -> None:
        """One body message (the watchdog's to bound, the last one too). Only a ping takes
        the lock, so a body send waits for it only while a ping is going out."""
        if self._lock.locked():
            async with self._lock:
                await self._send_now(send, chunk, more_body)
        else:
            await self._send_now(send, chunk, more_body)

    async def _send_now(self, send: Send, chunk: bytes, more_body: bool) -> None:
        """The body's and the pings' messages go out one at a time: `_sending_since` is
        set before the first await, so neither starts while the other is in progress."""
        self._sending_since = asyncio.get_running_loop().time()
        try:
            await send({"type": "http.response.body", "body": chunk, "more_body": more_body})
        finally:
            self._sending_since = None

    def _arm_watchdog(self, at: float | None = None) -> None:
        if self.send_timeout is not None:
            loop = asyncio.get_running_loop()
            self._watchdog = loop.call_at(
                loop.time() + self.send_timeout if at is None else at, self._check_send
            )

    def _check_send(self) -> None:
        """Stop the stream if a send (the body's or a ping's) has waited `send_timeout`;
        else look again when the send in progress, or the next, could have."""
        assert self.send_timeout is not None
        since, now = self._sending_since, asyncio.get_running_loop().time()
        if since is not None and now - since >= self.send_timeout:
            self._stop("send timeout")
        else:
            self._arm_watchdog((now if since is None else since) + self.send_timeout)

    async def _listen_for_disconnect_and_stop(self, receive: Receive) -> None:
        while self.active:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._stop("disconnect")
                return

    def _stop(self, reason: str) -> None:
        """End the body early, once; not after it has ended."""
        if self._stopped is None and not self._ended and self._stream_task is not None:
            self._stopped = reason
            self.active = False
            if self._stream_task is not asyncio.current_task():
                self._stream_task.cancel()

    def _arm_ping(self, send: Send) -> None:
        if self.ping_s > 0 and self.active:
            loop = asyncio.get_running_loop()
            self._ping_timer = loop.call_later(self.ping_s, self._ping_due, send)

    def _disarm_ping(self) -> None:
        if self._ping_timer is not None:
            self._ping_timer.cancel()
        if self._ping_task is not None:
            self._ping_task.cancel()

    def _ping_due(self, send: Send) -> None:
        self._ping_task = asyncio.get_running_loop().create_task(self._ping_once(send))

    async def _ping_once(self, send: Send) -> None:
        async with self._lock:
            if not self.active or self._ended:
                return
            if self._sending_since is None:  # else the body is sending: no ping is needed now
                await self._send_now(send, ping_comment(), True)
        self._arm_ping(send)


def ping_comment() -> bytes:
    """The keep-alive comment, as sse-starlette writes it: `: ping - <UTC time>`."""
    return b": ping - %s\r\n\r\n" % str(datetime.now(UTC)).encode()
