"""The scan pipeline: the stages (vision -> rule -> answer -> reward), inline as coroutines.

Each accepted scan runs as one asyncio task that appends domain events to its
`EventLog`; the HTTP response only follows that log (see `app/streaming/responses.py`). Keeping
the work in its own plain-asyncio task, rather than inside the response generator,
means a client disconnect is one `task.cancel()`: the in-flight upstream stream is
closed by the stage's own cleanup, the `cancelled` row is written, every slot is
released, and nothing runs inside the SSE library's cancel scopes.

Invariants: every scan emits exactly one terminal event (`done` or `error`) and
writes exactly one terminal row (`completed`, `failed` or `cancelled`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

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
from app.runtime import tracing
from app.runtime.metrics import Metrics
from app.scans.events import (
    ITEM_EVENTS,
    AnswerDelta,
    EventLog,
    LogEntry,
    ScanDone,
    ScanErrored,
    TextDiscarded,
    item_event_key,
)
from app.scans.finished import FinishedScans
from app.scans.handover import Handover, Recovered, recover
from app.scans.mirror import ScanStreams
from app.scans.run import ScanRun
from app.scans.runner import ScanProgress, StageRunner
from app.scans.store import ScanStore, TerminalRow
from app.stages.context import AcceptedScan, ScanContext
from app.upstream.call import safety_identifier
from app.upstream.prices import ScanSpend

log = logging.getLogger(__name__)

# Waiting for the database to take a finished scan's `completed` row: retried at this
# pace until the scan's deadline, since `done` may only go out after that commit.
COMMIT_FIRST_RETRY_S = 0.2
COMMIT_MAX_RETRY_S = 2.0


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
        disconnect_grace_s: float = 0.0,
        streams: ScanStreams | None = None,
    ) -> None:
        self._runner = runner
        self._streams = streams  # REDIS_URL: every scan's events mirrored for other replicas
        self._disconnect_grace_s = disconnect_grace_s
        self._store = store
        self._metrics = metrics
        self._scan_deadline_s = scan_deadline_s
        self._clock = clock
        self._on_finished = on_finished
        self.running: dict[asyncio.Task[None], ScanRun] = {}
        # By scan id, while running: what GET /api/v1/scan/{id}/events follows live...
        self.runs: dict[uuid.UUID, ScanRun] = {}
        # ...and once ended, the terminal row for a while (resumes that race the row's
        # write, or a row the database has not taken yet).
        self.finished = FinishedScans()
        self.accepting = True
        self._shutting_down = False
        self._row_writes: set[asyncio.Task[None]] = set()

    def start(self, scan: AcceptedScan, *, token_sha256: str | None = None) -> ScanRun:
        run = self._new_run(scan, token_sha256)
        if self._streams is not None:
            handover = Handover.of(scan, token_sha256=token_sha256, deadline_s=self._scan_deadline_s)
            self._streams.mirror(scan.id, run.log, scan_input=handover.encode())
        return self._launch(run, self._run(run))

    def adopt(
        self,
        scan: AcceptedScan,
        entries: list[LogEntry],
        *,
        deadline_s: float,
        token_sha256: str | None,
        lost: EcoscanError | None = None,
    ) -> ScanRun:
        """Run on a scan whose process died (app/scans/liveness.py), from its mirrored
        `entries`: the stages it completed are not run again, `seq` goes on from the last
        entry, and it ends within `deadline_s`. With `lost`, it ends at once with it."""
        run = self._new_run(scan, token_sha256)
        for entry in entries:
            run.log.publish(entry)
        if self._streams is not None:
            self._streams.mirror(scan.id, run.log, written=len(entries))
        recovered = recover(run.log, self._runner.stages)
        work = self._run(run, recovered=recovered, deadline_s=deadline_s, lost=lost)
        return self._launch(run, work, adopted=True)

    def _new_run(self, scan: AcceptedScan, token_sha256: str | None) -> ScanRun:
        followed = functools.partial(self._streams.followed_elsewhere, scan.id) if self._streams else None
        return ScanRun(
            scan, grace_s=self._disconnect_grace_s, token_sha256=token_sha256, followed_elsewhere=followed
        )

    def _launch(self, run: ScanRun, work: Coroutine[Any, Any, None], *, adopted: bool = False) -> ScanRun:
        scan = run.scan
        if tracing.recording() or (adopted and tracing.enabled()):  # a sampled trace, or its takeover
            work = _traced(scan, work, adopted=adopted)
        run.task = task = asyncio.create_task(work, name=f"scan-{scan.id}")
        self.running[task] = run
        self.runs[scan.id] = run
        task.add_done_callback(self._forget)
        if self._shutting_down:  # accepted while the drain was ending: it ends at once
            run.cancel()
        return run

    def _forget(self, task: asyncio.Task[None]) -> None:
        run = self.running.pop(task, None)
        if run is None:
            return
        self.runs.pop(run.scan.id, None)
        if (stored := run.as_stored()) is not None:
            self.finished.keep(stored)

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

    async def _run(
        self,
        run: ScanRun,
        *,
        recovered: Recovered | None = None,
        deadline_s: float | None = None,
        lost: EcoscanError | None = None,
    ) -> None:
        scan, events = run.scan, run.log
        if recovered is None:
            progress = ScanProgress(self._runner.stages[0].name, dict(scan.timings), {})
        else:
            progress = ScanProgress(recovered.step, {**scan.timings, **recovered.timings}, recovered.result)
        if (trace_id := tracing.trace_id()) is not None:  # `done` says which trace to look up
            progress.result["trace_id"] = trace_id
        deadline = self._clock.now() + (self._scan_deadline_s if deadline_s is None else deadline_s)
        started = time.perf_counter()
        self._metrics.scans_in_flight.inc()
        outcome = "failed"
        spend = ScanSpend.start()  # this task's calls (and its hedges') add to it
        try:
            run.started = True
            if run.cancel_requested:
                raise asyncio.CancelledError()
            if lost is not None:
                raise lost
            await self._stages(scan, events, progress, deadline, recovered)
            done, stored_log = await self._commit_completed(scan, events, progress, deadline)
            run.ended("completed", stored_log)
            events.publish(done)
            outcome = "completed"
            self._metrics.scans.labels("completed", "").inc()
        except asyncio.CancelledError:
            outcome = "cancelled"
            await self._cancelled(run, progress)
            raise
        except Exception as exc:
            await self._fail(run, progress, exc)
        finally:
            scan.ticket.release()
            elapsed = time.perf_counter() - started
            self._metrics.scans_in_flight.dec()
            # An exemplar: a slow scan's bucket links to its trace (OpenMetrics /metrics).
            sampled = tracing.trace_id(sampled=True)
            exemplar = {"trace_id": sampled} if sampled is not None else None
            self._metrics.scan_duration.labels(outcome).observe(elapsed, exemplar)
            if spend.total_usd is not None:
                self._metrics.scan_cost.observe(spend.total_usd)
            if self._on_finished is not None and outcome == "completed":
                self._on_finished(elapsed)

    async def _stages(
        self,
        scan: AcceptedScan,
        events: EventLog,
        progress: ScanProgress,
        deadline: float,
        recovered: Recovered | None = None,
    ) -> None:
        async def delta(text: str) -> None:
            # Text the running stage streams: its progress creeps up, short of its completion.
            ceiling = self._runner.spans[progress.step].completed - 1
            events.append(AnswerDelta(progress.step, text), min(ceiling, events.progress + 1))

        async def discard() -> None:
            # The stage's text so far is void: its call starts again (elsewhere).
            events.append(TextDiscarded(progress.step))

        # Item events already in the log (a taken-over scan whose owner sent them before
        # it died): the stage run over does not send them twice.
        sent = set() if recovered is None else set(recovered.item_events)

        async def item(kind: str, fields: dict[str, Any]) -> None:
            key = item_event_key(kind, fields)
            if key is None or key in sent:
                return
            sent.add(key)
            ceiling = self._runner.spans[progress.step].completed - 1
            events.append(ITEM_EVENTS[kind](progress.step, fields), min(ceiling, events.progress + 1))

        ctx = ScanContext(scan, safety_identifier(scan.user_id), delta, discard, item)
        if recovered is not None:  # taken over: what the dead owner completed stands
            ctx.results.update(recovered.results)
            scan.ticket.calls_started(
                sum(s.upstream_calls for s in self._runner.stages if not recovered.runs(s))
            )
            if recovered.text_void:
                await discard()
        for stage in self._runner.stages:
            if recovered is not None and not recovered.runs(stage):
                continue
            if self._clock.now() >= deadline:
                raise ScanDeadlineExceeded()
            await self._runner.run(stage, ctx, events, progress, deadline)
        progress.step = "done"

    async def _commit_completed(
        self, scan: AcceptedScan, events: EventLog, progress: ScanProgress, deadline: float
    ) -> tuple[LogEntry, str]:
        """The `done` entry and the log stored with it, committed with the row before
        anyone sees it; while the database is away the finished scan waits for it, up to
        its deadline, then fails with DATABASE_ERROR."""
        progress.timings["total_ms"] = _ms(time.perf_counter() - scan.received_at)
        done = events.next_entry(ScanDone("done", progress.result, progress.timings), 100)
        stored_log = events.to_json(done)
        row = TerminalRow("completed", progress.result, progress.timings, events=stored_log, cost_usd=_cost())
        delay = COMMIT_FIRST_RETRY_S
        while True:
            try:
                await self._store.finish(scan.id, row)
                return done, stored_log
            except DatabaseError:
                if self._clock.now() + delay >= deadline:
                    raise
                log.warning("scan %s: waiting for the database to record its result", scan.id)
                await self._clock.sleep(delay)
                delay = min(delay * 2, COMMIT_MAX_RETRY_S)

    async def _cancelled(self, run: ScanRun, progress: ScanProgress) -> None:
        scan = run.scan
        error: EcoscanError
        if run.cancel_reason is not None:
            error, step = run.cancel_reason, progress.step
        elif self._shutting_down:
            error = ServerShutdown()
            log.warning("scan %s cancelled in %s: the shutdown drain ended", scan.id, progress.step)
            step = progress.step
        else:  # the client went away; the event is for the log only, nobody is listening
            error, step = ClientDisconnected("The client went away."), "client"
        self._metrics.scans.labels("cancelled", "" if step == "client" else error.code).inc()
        await self._end(run, progress, "cancelled", step, error)

    async def _fail(self, run: ScanRun, progress: ScanProgress, exc: Exception) -> None:
        scan = run.scan
        error = exc if isinstance(exc, EcoscanError) else InternalError()
        if isinstance(exc, EcoscanError):
            cause = exc.__cause__ or exc
            log.warning("scan %s failed in %s: %s (%s)", scan.id, progress.step, error.code, cause)
        else:
            log.exception("scan %s failed in %s with an unexpected error", scan.id, progress.step)
        self._metrics.scans.labels("failed", error.code).inc()
        await self._end(run, progress, "failed", progress.step, error)

    async def _end(
        self, run: ScanRun, progress: ScanProgress, status: str, step: str, error: EcoscanError
    ) -> None:
        """The terminal row, then the terminal event. Cancelled while the row is being
        written (shutdown), the write goes on and the event still goes out."""
        scan, events = run.scan, run.log
        tracing.failed(error.code, error=status == "failed")
        progress.timings["total_ms"] = _ms(time.perf_counter() - scan.received_at)
        wait_s = getattr(error, "retry_after_s", None)
        retry_after = math.ceil(wait_s) if wait_s is not None else None
        terminal = events.next_entry(
            ScanErrored(step, error.code, error.message, error.retryable, retry_after)
        )
        stored_log = events.to_json(terminal)
        row = TerminalRow(
            status,
            progress.result,
            progress.timings,
            (step, error.code, error.message),
            events=stored_log,
            cost_usd=_cost(),
        )
        writing = asyncio.create_task(self._write_terminal_row(scan, row))
        # Held until done: a write that outlives a cancelled scan must not be collected.
        self._row_writes.add(writing)
        writing.add_done_callback(self._row_writes.discard)
        try:
            await asyncio.shield(writing)
        finally:
            run.ended(status, stored_log)
            events.publish(terminal)

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


async def _traced(scan: AcceptedScan, work: Coroutine[Any, Any, None], *, adopted: bool) -> None:
    """The scan's span around its run: the request's child; taken over, the child of the
    request span its first owner kept in the handover, so the scan stays one trace."""
    attributes: dict[str, str | bool] = {"ecoscan.scan.id": str(scan.id), "ecoscan.scan.taken_over": adopted}
    if scan.user_id is not None and tracing.user_ids():
        attributes["user.id"] = scan.user_id
    # Taken over, the stored parent; else the current span (the request's) is the parent.
    with tracing.span("scan", attributes, parent=scan.traceparent if adopted else None):
        await work


def _cost() -> float | None:
    """What the running scan's calls cost so far (read in its own task)."""
    spend = ScanSpend.current.get()
    return None if spend is None else spend.total_usd


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)
