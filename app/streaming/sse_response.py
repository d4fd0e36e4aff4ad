"""How a scan's SSE bytes go out: sse-starlette's `EventSourceResponse` (its headers,
framing and HEAD handling) run at a fraction of its per-response cost.

sse-starlette runs every response as an anyio task group of four tasks (the body, a
pinger, a shutdown-signal listener and a disconnect listener) and wraps every send in
an anyio cancel scope. Under load that was a tenth of the service's CPU
(k6/cpu_per_scan.py --profile; README, cost per scan). Here the body is sent from the
request's own task; one timer, the watchdog, bounds every send by `send_timeout` (a timer
per send would cost more than the send); one small task waits for the client's
disconnect; the ping is a timer that starts a task only when a ping is due
(scans are usually over before the first); the shutdown listener is not needed, since
the drain ends every scan with a terminal event (app/scans/drain.py) and the stream closes
after it.

Ending early, the body iterator is closed, so its `finally` runs (the scan's follower
detaches): when the client disconnects, or stops reading for `send_timeout` seconds (a
warning here, and uvicorn's own line about the unfinished response; no traceback).
sse-starlette's shutdown event, data-sender and close-handler options are not used here.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.event import ensure_bytes
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

# Closing the body runs its `finally` (ours only detach, without awaiting): bounded all the same.
BODY_CLOSE_TIMEOUT_S = 5.0


class LeanEventSourceResponse(EventSourceResponse):
    _stopped: str | None = None  # why the body stopped early: "disconnect" or "send timeout"
    _ended = False  # the last body message went out
    _stream_task: asyncio.Task[object] | None = None
    _ping_timer: asyncio.TimerHandle | None = None
    _ping_task: asyncio.Task[None] | None = None
    _sending_since: float | None = None  # the loop's time when the send in progress began
    _watchdog: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"].upper() == "HEAD":
            await super().__call__(scope, receive, send)
            return
        self._stream_task = task = asyncio.current_task()
        assert task is not None
        self._lock = asyncio.Lock()
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
        if self.background is not None:
            await self.background()

    async def _send_body(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            if not self.active:  # stopped, should a body swallow the one cancellation
                return
            await self._send(send, ensure_bytes(chunk, self.sep))
        await self._send(send, b"", more_body=False)
        # Before anything else runs: uvicorn reports the finished response to `receive` as a
        # disconnect, which must not stop anything now.
        self._ended = True

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
        if self.ping_interval > 0 and self.active:
            loop = asyncio.get_running_loop()
            self._ping_timer = loop.call_later(self.ping_interval, self._ping_due, send)

    def _disarm_ping(self) -> None:
        if self._ping_timer is not None:
            self._ping_timer.cancel()
        if self._ping_task is not None:
            self._ping_task.cancel()

    def _ping_due(self, send: Send) -> None:
        self._ping_task = asyncio.get_running_loop().create_task(self._ping_once(send))

    async def _ping_once(self, send: Send) -> None:
        comment = f"ping - {datetime.now(UTC)}"
        ping = ServerSentEvent(comment=comment, sep=self.sep).encode()
        async with self._lock:
            if not self.active or self._ended:
                return
            if self._sending_since is None:  # else the body is sending: no ping is needed now
                await self._send_now(send, ping, True)
        self._arm_ping(send)
