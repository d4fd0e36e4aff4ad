"""The SSE response of one scan: a race between the pipeline task, sse-starlette's
ping and its client-disconnect listener.

The response only *reads* the scan's event queue. When the client goes away,
sse-starlette cancels this generator; its `finally` cancels the pipeline task,
which then cleans up on its own (closes the upstream stream, writes the
`cancelled` row, releases its admission ticket). The generator never awaits that
cleanup: it runs inside sse-starlette's cancel scope, where every await would be
cancelled again.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse, ServerSentEvent

from app.events import TERMINAL
from app.metrics import Metrics
from app.pipeline import ScanRun


def scan_response(run: ScanRun, metrics: Metrics, *, ping_s: float) -> EventSourceResponse:
    return EventSourceResponse(
        _events(run, metrics),
        ping=ping_s,
        headers={
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",
            "X-Scan-Id": str(run.scan.id),
        },
    )


async def _events(run: ScanRun, metrics: Metrics) -> AsyncIterator[ServerSentEvent]:
    metrics.streams_open.inc()
    first = True
    try:
        while True:
            event = await run.queue.get()
            if first:
                metrics.first_event.observe(time.perf_counter() - run.scan.received_at)
                first = False
            yield event
            if event.event in TERMINAL:
                return
    finally:
        metrics.streams_open.dec()
        run.cancel()
