"""The SSE stream of one scan: what goes out. The only module that knows the wire
format: each domain event becomes one SSE event whose `data` is JSON with `job_id`,
`step`, `seq` (also the SSE `id:`), `progress` and the event's own fields. How the
bytes go out (sends, ping, disconnects) is app/streaming/sse_response.py.

The response only *reads* the scan's event log, from any position (`Last-Event-ID`),
until its terminal event. A shutdown does not cut it: the drain ends every scan with a
terminal event first (app/scans/drain.py). When the client goes away, the
response cancels this generator; its `finally` detaches from the run, and the last
follower leaving starts the scan's disconnect grace, after which the pipeline task is
cancelled and cleans up on its own (closes the upstream stream, writes the `cancelled`
row, releases its admission ticket). The generator never awaits that cleanup.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, Protocol

import orjson

from app.runtime.metrics import Metrics
from app.scans.events import EventLog, LogEntry
from app.scans.run import ScanRun
from app.streaming.sse_response import EventStreamResponse

# A client that stops reading (its TCP window full) blocks a send; after this long the
# stream ends as if it had disconnected, instead of holding the response forever.
SEND_TIMEOUT_S = 30.0


def scan_response(
    run: ScanRun, metrics: Metrics, *, ping_s: float, headers: dict[str, str] | None = None
) -> EventStreamResponse:
    """The stream of a scan just accepted: every event, live."""
    return _response(str(run.scan.id), _live(run, metrics, 0, first_event=True), ping_s, headers)


def resumed_response(
    run: ScanRun, metrics: Metrics, *, after: int, ping_s: float, headers: dict[str, str] | None = None
) -> EventStreamResponse:
    """A scan this process runs (or just ran), from `after` on, live to its end."""
    return _response(str(run.scan.id), _live(run, metrics, after, first_event=False), ping_s, headers)


def replayed_response(
    job_id: str,
    log: EventLog,
    metrics: Metrics,
    *,
    after: int,
    ping_s: float,
    headers: dict[str, str] | None = None,
) -> EventStreamResponse:
    """A finished scan's stored log from `after` on: the same bytes the original sent."""
    return _response(job_id, _stored(job_id, log, after, metrics), ping_s, headers)


class FollowedEntries(Protocol):
    """A follow's entries (app/scans/mirror.py's `Following`), closed when the response ends."""

    def __aiter__(self) -> AsyncIterator[LogEntry]: ...

    def __anext__(self) -> Awaitable[LogEntry]: ...

    def aclose(self) -> Awaitable[None]: ...


def followed_response(
    job_id: str,
    entries: FollowedEntries,
    metrics: Metrics,
    *,
    ping_s: float,
    headers: dict[str, str] | None = None,
) -> EventStreamResponse:
    """A scan another replica runs, from the Redis Stream it mirrors its log to
    (app/scans/mirror.py): the same bytes its owner sends."""
    return _response(job_id, _FollowedBody(_mirrored(job_id, entries, metrics), entries), ping_s, headers)


class _FollowedBody:
    """The frames of a follow; closing it closes the follow too (giving back its follower
    slot), even before the first frame, when the generator has no `finally` to run."""

    def __init__(self, frames: AsyncGenerator[bytes, None], following: FollowedEntries) -> None:
        self._frames = frames
        self._following = following

    def __aiter__(self) -> _FollowedBody:
        return self

    async def __anext__(self) -> bytes:
        return await self._frames.__anext__()

    async def aclose(self) -> None:
        try:
            await self._frames.aclose()
        finally:
            await self._following.aclose()


def _response(
    job_id: str,
    events: AsyncIterator[bytes],
    ping_s: float,
    headers: dict[str, str] | None,
) -> EventStreamResponse:
    return EventStreamResponse(
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
    scan's disconnect grace (see app/scans/run.py)."""
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


async def _stored(job_id: str, log: EventLog, after: int, metrics: Metrics) -> AsyncIterator[bytes]:
    metrics.streams_open.inc()
    try:
        async for batch in log.follow_batches(after):
            yield encode_batch(job_id, batch)
    finally:
        metrics.streams_open.dec()


def encode_batch(job_id: str, batch: list[LogEntry]) -> bytes:
    """Events that are ready together leave in one send (one ASGI message, one write):
    the same bytes as one send each, at a fraction of the per-send cost."""
    return b"".join([encode_event(job_id, entry) for entry in batch])


async def _mirrored(
    job_id: str, entries: AsyncIterator[LogEntry], metrics: Metrics
) -> AsyncGenerator[bytes, None]:
    metrics.streams_open.inc()
    try:
        async for entry in entries:
            yield encode_event(job_id, entry)
    finally:
        metrics.streams_open.dec()


def encode_event(job_id: str, entry: LogEntry) -> bytes:
    """One SSE event, as sse-starlette's `ServerSentEvent(data, event=, id=).encode()` frames
    it (`id`, `event`, `data` lines, CRLF): the JSON is one line, since orjson escapes
    every line break inside strings, so no data line needs splitting."""
    data = orjson.dumps(event_data(job_id, entry))
    return b"id: %d\r\nevent: %s\r\ndata: %s\r\n\r\n" % (entry.seq, entry.event.kind.encode(), data)


def event_data(job_id: str, entry: LogEntry) -> dict[str, Any]:
    """The JSON object an event's `data` carries."""
    event = entry.event
    data = {"job_id": job_id, "step": event.step, "seq": entry.seq, "progress": entry.progress}
    data.update(event.fields())
    return data
