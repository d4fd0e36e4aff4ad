"""The SSE response of one scan: a race between the pipeline task, sse-starlette's
ping and its client-disconnect listener. The only module that knows the wire format:
each domain event becomes one SSE event whose `data` is JSON with `job_id`, `step`,
`seq` (also the SSE `id:`), `progress` and the event's own fields.

The response only *reads* the scan's event log, until its terminal event. A
shutdown does not cut it: the drain ends every scan with a terminal event first (see
`take_over_shutdown`). When the client goes away, sse-starlette cancels this
generator; its `finally` cancels the pipeline task, which then cleans up on its own
(closes the upstream stream, writes the `cancelled` row, releases its admission
ticket). The generator never awaits that cleanup: it runs inside sse-starlette's
cancel scope, where every await would be cancelled again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import AppStatus, SendTimeoutError
from starlette.types import Receive, Scope, Send

from app.metrics import Metrics
from app.pipeline import ScanRun
from app.scan_events import LogEntry

log = logging.getLogger(__name__)


# A client that stops reading (its TCP window full) blocks a send; after this long the
# stream ends as if it had disconnected, instead of holding the response forever.
SEND_TIMEOUT_S = 30.0


class _ScanStream(EventSourceResponse):
    """A client that stopped reading is an ordinary event: one log line, no traceback
    (the generator's `finally` has already cancelled the scan)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            log.warning(
                "%s: the client stopped reading for %.0f s; stream closed",
                self.headers.get("x-scan-id"),
                SEND_TIMEOUT_S,
            )


def take_over_shutdown() -> None:
    """Left alone, sse-starlette ends every stream the moment uvicorn sees SIGTERM, before
    the scans have sent their terminal events. The drain (app/drain.py) ends the scans
    instead, and each stream closes after its terminal event."""
    AppStatus.disable_automatic_graceful_drain()  # type: ignore[no-untyped-call]


def scan_response(run: ScanRun, metrics: Metrics, *, ping_s: float) -> EventSourceResponse:
    return _ScanStream(
        _events(run, metrics),
        ping=ping_s,
        send_timeout=SEND_TIMEOUT_S,
        headers={
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",
            "X-Scan-Id": str(run.scan.id),
        },
    )


async def _events(run: ScanRun, metrics: Metrics) -> AsyncIterator[ServerSentEvent]:
    metrics.streams_open.inc()
    job_id = str(run.scan.id)
    first = True
    try:
        async for entry in run.log.follow():
            if first:
                metrics.first_event.observe(time.perf_counter() - run.scan.received_at)
                first = False
            yield to_sse(job_id, entry)
    finally:
        metrics.streams_open.dec()
        run.cancel()


def to_sse(job_id: str, entry: LogEntry) -> ServerSentEvent:
    event = entry.event
    data = {"job_id": job_id, "step": event.step, "seq": entry.seq, "progress": entry.progress}
    data.update(event.fields())
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return ServerSentEvent(data=text, event=event.kind, id=str(entry.seq))
