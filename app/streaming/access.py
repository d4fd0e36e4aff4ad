"""Scans as resources: a scan's status, its events (resumable), and cancelling it —
each only for its owner.

Who owns a scan: the user who created it, or, for an anonymous scan, whoever holds the
capability token returned once in `X-Scan-Token` when it was created. Anyone else gets
404 `SCAN_NOT_FOUND`, exactly as for a scan that does not exist.

Where a scan is read from: this process's memory while it runs here (and, as the row it
wrote, a minute after: app/scans/finished.py), else the database, whose row holds the
event log as it was sent. A scan
running on another replica (its row `running`, no run here) is followed through the
Redis Stream its owner mirrors its events to (app/scans/mirror.py) when REDIS_URL is
set; without Redis, or while that stream cannot serve the position, it is 409
`SCAN_RUNNING_ELSEWHERE` until it has finished.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from starlette.responses import Response

from app.errors import (
    DatabaseError,
    DatabaseUnavailable,
    ProcessLost,
    ScanAlreadyFinished,
    ScanCancelled,
    ScanEventsGone,
    ScanNotFound,
    ScanRunningElsewhere,
)
from app.runtime.metrics import Metrics
from app.scans.events import EventLog, LogEntry, RecordedEvent
from app.scans.mirror import ScanStreams
from app.scans.pipeline import ScanPipeline
from app.scans.run import ScanRun
from app.scans.store import RETRYABLE_CODES, ScanStore, StoredScan
from app.streaming.responses import event_data, followed_response, replayed_response, resumed_response


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Reader:
    """Who asks: an authenticated user id, and the scan token they presented, if any."""

    user_id: str | None
    token: str | None = None
    # Whose share of the followers of other replicas' scans a follow takes (app/scans/followers.py).
    rate_key: str = ""


class ScanAccess:
    def __init__(
        self,
        pipeline: ScanPipeline,
        store: ScanStore,
        metrics: Metrics,
        *,
        ping_s: float,
        streams: ScanStreams | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._store = store
        self._metrics = metrics
        self._ping_s = ping_s
        self._streams = streams

    async def status(self, scan_id: uuid.UUID, reader: Reader) -> dict[str, Any]:
        """`{job_id, status, created_at, finished_at, result | error}`; `result` is the
        `done` event's data and `error` the `error` event's, exactly as streamed."""
        run, stored = await self._find(scan_id, reader)
        if run is not None:
            body = _status(scan_id, run.status, run.created_at, run.finished_at, run.log)
            retry_of = run.scan.retry_of
        else:
            assert stored is not None
            log = EventLog.from_json(stored.event_log) if stored.event_log else None
            body = _status(scan_id, stored.status, stored.created_at, stored.finished_at, log)
            retry_of = stored.retry_of
        if retry_of is not None:
            body["retry_of"] = str(retry_of)
        return body

    async def events(
        self,
        scan_id: uuid.UUID,
        reader: Reader | None,
        *,
        after: int,
        headers: dict[str, str] | None = None,
        follower: str | None = None,
    ) -> Response:
        """The scan's events with `seq > after`, identical to what was first sent, then
        live until the terminal one. `follower` keys the follower caps: the reader's rate
        key, or the caller's for a replay (which has no reader)."""
        run, stored = await self._find(scan_id, reader)
        if run is not None:
            if _past_the_end(run.log, after):
                return Response(status_code=204, headers=headers)
            return resumed_response(run, self._metrics, after=after, ping_s=self._ping_s, headers=headers)
        assert stored is not None
        if stored.event_log is None:
            if stored.status != "running":
                raise ScanEventsGone()
            key = follower if follower is not None else reader.rate_key if reader else None
            assert key, "a follow is always keyed by its caller"
            return await self._follow_elsewhere(scan_id, after, headers, follower=key)
        log = EventLog.from_json(stored.event_log)
        if _past_the_end(log, after):
            return Response(status_code=204, headers=headers)
        return replayed_response(
            str(scan_id), log, self._metrics, after=after, ping_s=self._ping_s, headers=headers
        )

    async def _follow_elsewhere(
        self, scan_id: uuid.UUID, after: int, headers: dict[str, str] | None, *, follower: str
    ) -> Response:
        """A scan another replica runs, from the Redis Stream it mirrors its events to."""
        if self._streams is None:
            raise ScanRunningElsewhere()
        ended_after = functools.partial(self._ended_after, scan_id)
        entries = await self._streams.follow(scan_id, after, ended_after=ended_after, follower=follower)
        if entries is None:
            return Response(status_code=204, headers=headers)
        return followed_response(str(scan_id), entries, self._metrics, ping_s=self._ping_s, headers=headers)

    async def _ended_after(self, scan_id: uuid.UUID, position: int, progress: int) -> list[LogEntry] | None:
        """None while the row says `running` (or the database does not answer); once it
        has ended, its entries after `position`, the terminal one last. A row swept as
        PROCESS_LOST holds no log: its end is the one entry a reader still lacks."""
        try:
            stored = await self._store.load(scan_id)
        except DatabaseError:
            return None
        if stored is not None and stored.status == "running":
            return None
        if stored is not None and stored.event_log is not None:
            return [e for e in EventLog.from_json(stored.event_log).entries if e.seq > position]
        code = (stored.error_code if stored else None) or ProcessLost.code
        message = (stored.error_message if stored else None) or ProcessLost.default_message
        step = (stored.error_step if stored else None) or "server"
        fields = {"code": code, "message": message, "retryable": code in RETRYABLE_CODES}
        return [LogEntry(position + 1, progress, RecordedEvent(kind="error", step=step, recorded=fields))]

    def replay(
        self, scan_id: uuid.UUID, *, follower: str, headers: dict[str, str] | None = None
    ) -> Awaitable[Response]:
        """A repeated POST's answer: the scan its idempotency key names, from the start.
        The key (same caller, same request) is the proof of ownership here; `follower` is
        the caller's rate key, so a replay that follows another replica counts against the
        caller's own follower cap."""
        return self.events(scan_id, None, after=0, headers=headers, follower=follower)

    async def cancel(self, scan_id: uuid.UUID, reader: Reader) -> dict[str, Any]:
        run, stored = await self._find(scan_id, reader)
        if run is None:
            assert stored is not None
            if stored.status == "running":
                raise ScanRunningElsewhere("The scan runs on another replica; cancels are not relayed.")
            raise ScanAlreadyFinished()
        if run.log.closed:
            raise ScanAlreadyFinished()
        run.cancel(ScanCancelled())
        return {"job_id": str(scan_id), "status": "cancelling"}

    async def _find(
        self, scan_id: uuid.UUID, reader: Reader | None
    ) -> tuple[ScanRun | None, StoredScan | None]:
        run = self._pipeline.runs.get(scan_id)
        if run is not None:
            _check_owner(run.scan.user_id, run.token_sha256, reader)
            return run, None
        stored = self._pipeline.finished.get(scan_id)
        if stored is None:
            try:
                stored = await self._store.load(scan_id)
            except DatabaseError:
                raise DatabaseUnavailable() from None
        if stored is None:
            raise ScanNotFound()
        _check_owner(stored.user_id, stored.token_sha256, reader)
        return None, stored


def _past_the_end(log: EventLog, after: int) -> bool:
    """A finished scan asked for what follows its last event: 204, nothing to send (an
    EventSource that reconnects after `done` with its id stops on a 204)."""
    return log.closed and after >= len(log.entries)


def _check_owner(owner: str | None, token_sha256: str | None, reader: Reader | None) -> None:
    if reader is None:  # vouched for by the caller (a repeated POST)
        return
    if owner is not None:
        if reader.user_id != owner:
            raise ScanNotFound()
        return
    if token_sha256 is None or reader.token is None:
        raise ScanNotFound()
    if not hmac.compare_digest(token_hash(reader.token), token_sha256):
        raise ScanNotFound()


def _status(
    scan_id: uuid.UUID, status: str, created: datetime, finished: datetime | None, log: EventLog | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "job_id": str(scan_id),
        "status": status,
        "created_at": created.isoformat(),
        "finished_at": finished.isoformat() if finished else None,
    }
    if log is not None and log.closed:
        terminal = log.entries[-1]
        body["result" if terminal.event.kind == "done" else "error"] = event_data(str(scan_id), terminal)
    return body
