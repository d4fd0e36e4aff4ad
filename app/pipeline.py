"""The scan pipeline: the stages (vision -> rule -> answer -> reward), inline as coroutines.

Each accepted scan runs as one asyncio task that appends domain events to its
`EventLog`; the HTTP response only follows that log (see `app/streaming.py`). Keeping
the work in its own plain-asyncio task, rather than inside the response generator,
means a client disconnect is one `task.cancel()`: the in-flight upstream stream is
closed by the stage's own cleanup, the `cancelled` row is written, every slot is
released, and nothing runs inside the SSE library's cancel scopes.

Invariants: every scan emits exactly one terminal event (`done` or `error`) and
writes exactly one terminal row (`completed`, `failed` or `cancelled`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from app.errors import DatabaseError, EcoscanError, InternalError, ScanDeadlineExceeded
from app.limits.clock import Clock
from app.metrics import Metrics
from app.scan_context import AcceptedScan, ScanContext
from app.scan_events import AnswerDelta, EventLog, ScanDone, ScanErrored
from app.scan_store import ScanStore
from app.stage_runner import PROGRESS_END, ScanProgress, StageRunner
from app.upstream import safety_identifier

log = logging.getLogger(__name__)

_SHUTDOWN = ("server", "SERVER_SHUTDOWN", "The server shut down.")
_CLIENT_GONE = ("client", "CLIENT_DISCONNECTED", "The client went away.")


class ScanRun:
    """One running scan: its task and the log of events it publishes."""

    def __init__(self, scan: AcceptedScan) -> None:
        self.scan = scan
        self.log = EventLog()
        self.task: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()


class ScanPipeline:
    def __init__(
        self,
        runner: StageRunner,
        *,
        store: ScanStore,
        metrics: Metrics,
        scan_deadline_s: float,
        clock: Clock,
        on_finished: Callable[[float], None] | None = None,
    ) -> None:
        self._runner = runner
        self._store = store
        self._metrics = metrics
        self._scan_deadline_s = scan_deadline_s
        self._clock = clock
        self._on_finished = on_finished
        self.running: set[asyncio.Task[None]] = set()
        self._shutting_down = False

    def start(self, scan: AcceptedScan) -> ScanRun:
        run = ScanRun(scan)
        run.task = asyncio.create_task(self._run(scan, run.log), name=f"scan-{scan.id}")
        self.running.add(run.task)
        run.task.add_done_callback(self.running.discard)
        return run

    async def cancel_all(self) -> None:
        """Shutdown: cancel every scan and wait for their terminal rows."""
        self._shutting_down = True
        tasks = list(self.running)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, scan: AcceptedScan, events: EventLog) -> None:
        progress = ScanProgress(self._runner.stages[0].name, dict(scan.timings), {})
        started = time.perf_counter()
        self._metrics.scans_in_flight.inc()
        outcome = "failed"
        try:
            await self._stages(scan, events, progress)
            progress.timings["total_ms"] = _ms(time.perf_counter() - scan.received_at)
            await self._store.finish(scan.id, "completed", result=progress.result, timings=progress.timings)
            events.append(ScanDone("done", progress.result, progress.timings), 100)
            outcome = "completed"
            self._metrics.scans.labels("completed", "").inc()
        except asyncio.CancelledError:
            outcome = "cancelled"
            self._metrics.scans.labels("cancelled", "").inc()
            reason = _SHUTDOWN if self._shutting_down else _CLIENT_GONE
            await self._record_end(scan, "cancelled", progress, reason)
            raise
        except Exception as exc:
            await self._fail(scan, events, progress, exc)
        finally:
            scan.ticket.release()
            elapsed = time.perf_counter() - started
            self._metrics.scans_in_flight.dec()
            self._metrics.scan_duration.labels(outcome).observe(elapsed)
            if self._on_finished is not None and outcome == "completed":
                self._on_finished(elapsed)

    async def _stages(self, scan: AcceptedScan, events: EventLog, progress: ScanProgress) -> None:
        deadline = self._clock.now() + self._scan_deadline_s
        answer_span = self._runner.spans.get("answer")
        delta_ceiling = (answer_span.completed - 1) if answer_span else PROGRESS_END

        async def delta(text: str) -> None:
            events.append(AnswerDelta("answer", text), min(delta_ceiling, events.progress + 1))

        ctx = ScanContext(scan, safety_identifier(scan.user_id), delta)
        for stage in self._runner.stages:
            if self._clock.now() >= deadline:
                raise ScanDeadlineExceeded()
            await self._runner.run(stage, ctx, events, progress, deadline)
        progress.step = "done"

    async def _fail(
        self, scan: AcceptedScan, events: EventLog, progress: ScanProgress, exc: Exception
    ) -> None:
        error = exc if isinstance(exc, EcoscanError) else InternalError()
        if isinstance(exc, EcoscanError):
            cause = exc.__cause__ or exc
            log.warning("scan %s failed in %s: %s (%s)", scan.id, progress.step, error.code, cause)
        else:
            log.exception("scan %s failed in %s with an unexpected error", scan.id, progress.step)
        self._metrics.scans.labels("failed", error.code).inc()
        await self._record_end(scan, "failed", progress, (progress.step, error.code, error.message))
        events.append(ScanErrored(progress.step, error.code, error.message, error.retryable))

    async def _record_end(
        self, scan: AcceptedScan, status: str, progress: ScanProgress, error: tuple[str, str, str]
    ) -> None:
        progress.timings["total_ms"] = _ms(time.perf_counter() - scan.received_at)
        finish = self._store.finish(
            scan.id, status, result=progress.result, timings=progress.timings, error=error
        )
        try:
            # Shielded: a second cancellation (shutdown) must not lose the terminal row.
            await asyncio.shield(finish)
        except DatabaseError:
            log.error("scan %s: could not record its %s row", scan.id, status)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)
