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

from app.errors import (
    ClientDisconnected,
    DatabaseError,
    EcoscanError,
    InternalError,
    ProcessLost,
    ScanDeadlineExceeded,
    ServerShutdown,
)
from app.limits.clock import Clock
from app.metrics import Metrics
from app.scan_context import AcceptedScan, ScanContext
from app.scan_events import AnswerDelta, EventLog, ScanDone, ScanErrored
from app.scan_store import ScanStore, TerminalRow
from app.stage_runner import PROGRESS_END, ScanProgress, StageRunner
from app.upstream import safety_identifier

log = logging.getLogger(__name__)

# Waiting for the database to take a finished scan's `completed` row: retried at this
# pace until the scan's deadline, since `done` may only go out after that commit.
COMMIT_FIRST_RETRY_S = 0.2
COMMIT_MAX_RETRY_S = 2.0


class ScanRun:
    """One running scan: its task and the log of events it publishes."""

    def __init__(self, scan: AcceptedScan) -> None:
        self.scan = scan
        self.log = EventLog()
        self.task: asyncio.Task[None] | None = None
        self.started = False
        self.cancel_requested = False

    def cancel(self) -> None:
        """Cancel the scan. A task cancelled before its first step would never run its
        cleanup (no terminal row or event, the admission slot kept), so until it has
        started the request is only noted, and the scan cancels itself at its start."""
        if self.task is None or self.task.done():
            return
        if self.started:
            self.task.cancel()
        else:
            self.cancel_requested = True


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
        self.running: dict[asyncio.Task[None], ScanRun] = {}
        self.accepting = True
        self._shutting_down = False
        self._row_writes: set[asyncio.Task[None]] = set()

    def start(self, scan: AcceptedScan) -> ScanRun:
        run = ScanRun(scan)
        run.task = task = asyncio.create_task(self._run(run), name=f"scan-{scan.id}")
        self.running[task] = run
        task.add_done_callback(self._forget)
        if self._shutting_down:  # accepted while the drain was ending: it ends at once
            run.cancel()
        return run

    def _forget(self, task: asyncio.Task[None]) -> None:
        self.running.pop(task, None)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every running scan to end; True if they all did."""
        try:
            async with asyncio.timeout(timeout_s):
                while self.running:
                    await asyncio.wait(list(self.running))
        except TimeoutError:
            return False
        return True

    async def cancel_all(self) -> None:
        """Shutdown: end every scan still running with `SERVER_SHUTDOWN` (row, then
        event) and wait for them."""
        self.accepting = False
        self._shutting_down = True
        runs = list(self.running.values())
        for run in runs:
            run.cancel()
        await asyncio.gather(*(run.task for run in runs if run.task), return_exceptions=True)
        if self._row_writes:  # rows still being written by scans cancelled mid-write (each bounded)
            await asyncio.wait(list(self._row_writes))

    async def _run(self, run: ScanRun) -> None:
        scan, events = run.scan, run.log
        progress = ScanProgress(self._runner.stages[0].name, dict(scan.timings), {})
        deadline = self._clock.now() + self._scan_deadline_s
        started = time.perf_counter()
        self._metrics.scans_in_flight.inc()
        outcome = "failed"
        try:
            run.started = True
            if run.cancel_requested:
                raise asyncio.CancelledError()
            await self._stages(scan, events, progress, deadline)
            await self._commit_completed(scan, progress, deadline)
            events.append(ScanDone("done", progress.result, progress.timings), 100)
            outcome = "completed"
            self._metrics.scans.labels("completed", "").inc()
        except asyncio.CancelledError:
            outcome = "cancelled"
            await self._cancelled(scan, events, progress)
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

    async def _stages(
        self, scan: AcceptedScan, events: EventLog, progress: ScanProgress, deadline: float
    ) -> None:
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

    async def _commit_completed(self, scan: AcceptedScan, progress: ScanProgress, deadline: float) -> None:
        """`done` goes out only after this commit; while the database is away the
        finished scan waits for it, up to its deadline, then fails with DATABASE_ERROR."""
        progress.timings["total_ms"] = _ms(time.perf_counter() - scan.received_at)
        row = TerminalRow("completed", progress.result, progress.timings)
        delay = COMMIT_FIRST_RETRY_S
        while True:
            try:
                return await self._store.finish(scan.id, row)
            except DatabaseError:
                if self._clock.now() + delay >= deadline:
                    raise
                log.warning("scan %s: waiting for the database to record its result", scan.id)
                await self._clock.sleep(delay)
                delay = min(delay * 2, COMMIT_MAX_RETRY_S)

    async def _cancelled(self, scan: AcceptedScan, events: EventLog, progress: ScanProgress) -> None:
        if self._shutting_down:
            error: EcoscanError = ServerShutdown()
            log.warning("scan %s cancelled in %s: the shutdown drain ended", scan.id, progress.step)
            step = progress.step
        else:  # the client went away; the event is for the log only, nobody is listening
            error, step = ClientDisconnected("The client went away."), "client"
        self._metrics.scans.labels("cancelled", "" if step == "client" else error.code).inc()
        await self._end(scan, events, progress, "cancelled", step, error)

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
        await self._end(scan, events, progress, "failed", progress.step, error)

    async def _end(
        self,
        scan: AcceptedScan,
        events: EventLog,
        progress: ScanProgress,
        status: str,
        step: str,
        error: EcoscanError,
    ) -> None:
        """The terminal row, then the terminal event. Cancelled while the row is being
        written (shutdown), the write goes on and the event still goes out."""
        progress.timings["total_ms"] = _ms(time.perf_counter() - scan.received_at)
        row = TerminalRow(status, progress.result, progress.timings, (step, error.code, error.message))
        writing = asyncio.create_task(self._write_terminal_row(scan, row))
        # Held until done: a write that outlives a cancelled scan must not be collected.
        self._row_writes.add(writing)
        writing.add_done_callback(self._row_writes.discard)
        try:
            await asyncio.shield(writing)
        finally:
            events.append(ScanErrored(step, error.code, error.message, error.retryable))

    async def _write_terminal_row(self, scan: AcceptedScan, row: TerminalRow) -> None:
        """If the database does not take the row now, the store keeps writing it."""
        try:
            await self._store.finish(scan.id, row)
        except DatabaseError:
            log.warning(
                "scan %s: database unavailable; its %s row is written when it is back", scan.id, row.status
            )
            self._store.defer(scan.id, row)
        except ProcessLost:
            log.error("scan %s: its row is missing", scan.id)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)
