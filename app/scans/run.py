"""One running scan as the rest of the service sees it: its task, its event log, who is
following it, and how it ends when nobody is.

A dropped connection does not end a scan at once: when its last follower leaves, the
scan keeps running for `grace_s` (`DISCONNECT_GRACE_S`), so a phone that reconnects
(`GET /api/v1/scan/{id}/events` with `Last-Event-ID`) finds it still going and pays for
no second scan. If nobody comes back in time, it is cancelled as a disconnect: the
upstream call is closed and the row says `cancelled / CLIENT_DISCONNECTED`. With
REDIS_URL set, a client that came back through another replica follows the scan there
(app/scans/mirror.py); while it does, `followed_elsewhere` says so and the grace starts
over instead of ending the scan.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from app.errors import EcoscanError
from app.scans.events import EventLog
from app.scans.store import StoredScan
from app.stages.context import AcceptedScan


class ScanRun:
    def __init__(
        self,
        scan: AcceptedScan,
        *,
        grace_s: float = 0.0,
        token_sha256: str | None = None,
        followed_elsewhere: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.scan = scan
        self.token_sha256 = token_sha256  # an anonymous scan's capability token, hashed
        self.created_at = datetime.now(UTC)
        self.finished_at: datetime | None = None
        self.status = "running"  # then the row's terminal status
        self.stored_log: str | None = None  # the event log as its terminal row holds it
        self.log = EventLog()
        self.task: asyncio.Task[None] | None = None
        self.started = False
        self.cancel_requested = False
        self.cancel_reason: EcoscanError | None = None  # None: the client went away
        self.followers = 0
        self._grace_s = grace_s
        self._abandon: asyncio.TimerHandle | None = None
        self._followed_elsewhere = followed_elsewhere
        self._asking: asyncio.Task[None] | None = None  # is it followed elsewhere?

    def ended(self, status: str, stored_log: str) -> None:
        """The terminal row (`status`, the whole log as `stored_log`) is written or deferred."""
        self.status = status
        self.stored_log = stored_log
        self.finished_at = datetime.now(UTC)

    def as_stored(self) -> StoredScan | None:
        """The ended scan as its terminal row; None if it has not ended."""
        if self.stored_log is None:
            return None
        return StoredScan(
            id=self.scan.id,
            user_id=self.scan.user_id,
            status=self.status,
            created_at=self.created_at,
            finished_at=self.finished_at,
            event_log=self.stored_log,
            token_sha256=self.token_sha256,
            retry_of=self.scan.retry_of,
        )

    @property
    def done(self) -> bool:
        return self.task is not None and self.task.done()

    def attach(self) -> None:
        """A client follows the scan (again): a pending abandonment is called off."""
        self.followers += 1
        if self._abandon is not None:
            self._abandon.cancel()
            self._abandon = None

    def detach(self) -> None:
        """A client stopped following; the last one leaving starts the grace period."""
        self.followers -= 1
        if self.followers > 0 or self.done or self.log.closed:
            return
        if self._grace_s <= 0:
            self.cancel()
        else:
            self._abandon = asyncio.get_running_loop().call_later(self._grace_s, self._abandoned)

    def _abandoned(self) -> None:
        self._abandon = None
        if self.followers > 0:
            return
        if self._followed_elsewhere is None:
            self.cancel()
        else:
            self._asking = asyncio.create_task(self._cancel_unless_followed_elsewhere())

    async def _cancel_unless_followed_elsewhere(self) -> None:
        """Bounded by REDIS_TIMEOUT_S; an unanswered question counts as no."""
        assert self._followed_elsewhere is not None
        followed = await self._followed_elsewhere()
        if self.followers > 0 or self.done or self.log.closed:
            return
        if followed:
            self._abandon = asyncio.get_running_loop().call_later(self._grace_s, self._abandoned)
        else:
            self.cancel()

    def cancel(self, reason: EcoscanError | None = None) -> None:
        """Cancel the scan. A task cancelled before its first step would never run its
        cleanup (no terminal row or event, the admission slot kept), so until it has
        started the request is only noted, and the scan cancels itself at its start."""
        if self.task is None or self.task.done():
            return
        if reason is not None and self.cancel_reason is None:
            self.cancel_reason = reason
        if self.started:
            self.task.cancel()
        else:
            self.cancel_requested = True
