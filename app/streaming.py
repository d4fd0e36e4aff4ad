"""The SSE response of one scan: a race between the pipeline task, sse-starlette's
ping and its client-disconnect listener. The only module that knows the wire format:
each domain event becomes one SSE event whose `data` is JSON with `job_id`, `step`,
`seq` (also the SSE `id:`), `progress` and the event's own fields.

The response only *reads* the scan's event log, from any position (`Last-Event-ID`),
until its terminal event. A shutdown does not cut it: the drain ends every scan with a
terminal event first (see `take_over_shutdown`). When the client goes away,
sse-starlette cancels this generator; its `finally` detaches from the run, and the
last follower leaving starts the scan's disconnect grace, after which the pipeline
task is cancelled and cleans up on its own (closes the upstream stream, writes the
`cancelled` row, releases its admission ticket). The generator never awaits that
cleanup: it runs inside sse-starlette's cancel scope, where every await would be
cancelled again.
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
from app.scan_events import EventLog, LogEntry
from app.scan_run import ScanRun

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


def scan_response(
    run: ScanRun, metrics: Metrics, *, ping_s: float, headers: dict[str, str] | None = None
) -> EventSourceResponse:
    """The stream of a scan just accepted: every event, live."""
    return _response(str(run.scan.id), _live(run, metrics, 0, first_event=True), ping_s, headers)


def resumed_response(
    run: ScanRun, metrics: Metrics, *, after: int, ping_s: float, headers: dict[str, str] | None = None
) -> EventSourceResponse:
    """A scan this process runs (or just ran), from `after` on, live to its end."""
    return _response(str(run.scan.id), _live(run, metrics, after, first_event=False), ping_s, headers)


def replayed_response(
    job_id: str, log: EventLog, *, after: int, ping_s: float, headers: dict[str, str] | None = None
) -> EventSourceResponse:
    """A finished scan's stored log from `after` on: the same bytes the original sent."""
    return _response(job_id, _stored(job_id, log, after), ping_s, headers)


def followed_response(
    job_id: str, entries: AsyncIterator[LogEntry], *, ping_s: float, headers: dict[str, str] | None = None
) -> EventSourceResponse:
    """A scan another replica runs, from the Redis Stream it mirrors its log to
    (app/scan_streams.py): the same bytes its owner sends."""
    return _response(job_id, _mirrored(job_id, entries), ping_s, headers)


def _response(
    job_id: str,
    events: AsyncIterator[ServerSentEvent] | AsyncIterator[bytes],
    ping_s: float,
    headers: dict[str, str] | None,
) -> EventSourceResponse:
    return _ScanStream(
        events,
        ping=ping_s,
        send_timeout=SEND_TIMEOUT_S,
        headers={
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",
            "X-Scan-Id": job_id,
            **(headers or {}),
        },
    )


async def _live(run: ScanRun, metrics: Metrics, after: int, *, first_event: bool) -> AsyncIterator[bytes]:
    """Follows the run; leaving (the client gone) detaches, which may start the
    scan's disconnect grace (see app/scan_run.py)."""
    metrics.streams_open.inc()
    run.attach()
    job_id = str(run.scan.id)
    try:
        async for batch in run.log.follow_batches(after):
            if first_event:
                metrics.first_event.observe(time.perf_counter() - run.scan.received_at)
                first_event = False
            yield encode_batch(job_id, batch)
    finally:
        metrics.streams_open.dec()
        run.detach()


async def _stored(job_id: str, log: EventLog, after: int) -> AsyncIterator[bytes]:
    async for batch in log.follow_batches(after):
        yield encode_batch(job_id, batch)


def encode_batch(job_id: str, batch: list[LogEntry]) -> bytes:
    """Events that are ready together leave in one send (one ASGI message, one write):
    the same bytes as one send each, at a fraction of the per-send cost."""
    return b"".join(to_sse(job_id, entry).encode() for entry in batch)


async def _mirrored(job_id: str, entries: AsyncIterator[LogEntry]) -> AsyncIterator[ServerSentEvent]:
    async for entry in entries:
        yield to_sse(job_id, entry)


def to_sse(job_id: str, entry: LogEntry) -> ServerSentEvent:
    event = entry.event
    data = {"job_id": job_id, "step": event.step, "seq": entry.seq, "progress": entry.progress}
    data.update(event.fields())
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return ServerSentEvent(data=text, event=event.kind, id=str(entry.seq))
