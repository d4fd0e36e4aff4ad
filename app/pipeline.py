"""The scan pipeline: vision -> rule -> answer -> reward, inline as coroutines.

Each accepted scan runs as one asyncio task that publishes SSE events to a queue;
the HTTP response only reads that queue (see `app/streaming.py`). Keeping the work
in its own plain-asyncio task, rather than inside the response generator, means a
client disconnect is one `task.cancel()`: the in-flight upstream stream is closed
by the stage's own cleanup, the `cancelled` row is written, every slot is released,
and nothing runs inside the SSE library's cancel scopes.

Invariants: every scan emits exactly one terminal event (`done` or `error`) and
writes exactly one terminal row (`completed`, `failed` or `cancelled`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sse_starlette import ServerSentEvent

from app.errors import (
    DatabaseError,
    EcoscanError,
    InternalError,
    ScanDeadlineExceeded,
    StageTimeout,
)
from app.events import EventBuilder
from app.limits.admission import Ticket
from app.limits.clock import Clock
from app.metrics import Metrics
from app.scan_input import ScanInput
from app.scan_store import DB_ERRORS, ScanStore
from app.stages.answer import AnswerStage
from app.stages.reward import RewardStage
from app.stages.rule import RuleBook
from app.stages.vision import VisionStage
from app.upstream import safety_identifier

log = logging.getLogger(__name__)
T = TypeVar("T")
UPSTREAM_STAGES = frozenset({"vision", "answer"})


@dataclass(frozen=True)
class StageTimeouts:
    vision_s: float
    rule_s: float
    answer_s: float
    reward_s: float
    scan_deadline_s: float


@dataclass
class AcceptedScan:
    id: uuid.UUID
    user_id: str | None
    input: ScanInput
    ticket: Ticket
    received_at: float  # perf_counter at request arrival
    timings: dict[str, float] = field(default_factory=dict)


class ScanRun:
    """One running scan: its task and the queue of events it publishes."""

    def __init__(self, scan: AcceptedScan) -> None:
        self.scan = scan
        self.queue: asyncio.Queue[ServerSentEvent] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()


class ScanPipeline:
    def __init__(
        self,
        *,
        vision: VisionStage,
        rules: RuleBook,
        answer: AnswerStage,
        reward: RewardStage,
        store: ScanStore,
        metrics: Metrics,
        timeouts: StageTimeouts,
        clock: Clock,
        on_finished: Callable[[float], None] | None = None,
    ) -> None:
        self._vision = vision
        self._rules = rules
        self._answer = answer
        self._reward = reward
        self._store = store
        self._metrics = metrics
        self._timeouts = timeouts
        self._clock = clock
        self._on_finished = on_finished
        self.running: set[asyncio.Task[None]] = set()
        self._shutting_down = False

    def start(self, scan: AcceptedScan) -> ScanRun:
        run = ScanRun(scan)
        run.task = asyncio.create_task(self._run(scan, run.queue.put_nowait), name=f"scan-{scan.id}")
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

    async def _run(self, scan: AcceptedScan, emit: Callable[[ServerSentEvent], None]) -> None:
        events = EventBuilder(str(scan.id))
        state = _ScanState()
        started = time.perf_counter()
        self._metrics.scans_in_flight.inc()
        outcome = "failed"
        try:
            try:
                async with asyncio.timeout(self._timeouts.scan_deadline_s):
                    result = await self._stages(scan, events, emit, state)
            except TimeoutError:
                raise ScanDeadlineExceeded() from None
            state.timings["total_ms"] = _ms(time.perf_counter() - scan.received_at)
            await self._store.finish(scan.id, "completed", result=result, timings=state.timings)
            emit(events.make("done", "done", 100, **result, timings=state.timings))
            outcome = "completed"
            self._metrics.scans.labels("completed", "").inc()
        except asyncio.CancelledError:
            outcome = "cancelled"
            self._metrics.scans.labels("cancelled", "").inc()
            await self._record_end(
                scan,
                "cancelled",
                state,
                ("server", "SERVER_SHUTDOWN", "The server shut down.")
                if self._shutting_down
                else ("client", "CLIENT_DISCONNECTED", "The client went away."),
            )
            raise
        except Exception as exc:
            error = exc if isinstance(exc, EcoscanError) else InternalError()
            if not isinstance(exc, EcoscanError):
                log.exception("scan %s failed in %s with an unexpected error", scan.id, state.step)
            else:
                log.warning(
                    "scan %s failed in %s: %s (%s)",
                    scan.id,
                    state.step,
                    error.code,
                    exc.__cause__ or exc,
                )
            self._metrics.scans.labels("failed", error.code).inc()
            await self._record_end(scan, "failed", state, (state.step, error.code, error.message))
            emit(
                events.make(
                    "error",
                    state.step,
                    None,
                    code=error.code,
                    message=error.message,
                    retryable=error.retryable,
                )
            )
        finally:
            scan.ticket.release()
            elapsed = time.perf_counter() - started
            self._metrics.scans_in_flight.dec()
            self._metrics.scan_duration.labels(outcome).observe(elapsed)
            if self._on_finished is not None and outcome == "completed":
                self._on_finished(elapsed)

    async def _record_end(
        self, scan: AcceptedScan, status: str, state: _ScanState, error: tuple[str | None, str, str]
    ) -> None:
        state.timings["total_ms"] = _ms(time.perf_counter() - scan.received_at)
        try:
            # Shielded: a second cancellation (shutdown) must not lose the terminal row.
            await asyncio.shield(
                self._store.finish(scan.id, status, result=state.partial, timings=state.timings, error=error)
            )
        except DatabaseError:
            log.error("scan %s: could not record its %s row", scan.id, status)

    async def _stages(
        self,
        scan: AcceptedScan,
        events: EventBuilder,
        emit: Callable[[ServerSentEvent], None],
        state: _ScanState,
    ) -> dict[str, Any]:
        t = self._timeouts
        scan_deadline = self._clock.now() + t.scan_deadline_s
        state.timings.update(scan.timings)
        safety_id = safety_identifier(scan.user_id)

        async def stage(
            name: str, timeout_s: float, start_pct: int, work: Callable[[float], Awaitable[T]]
        ) -> T:
            state.step = name
            emit(events.make("stage", name, start_pct, status="started"))
            if name in UPSTREAM_STAGES:
                scan.ticket.call_started()
            began = time.perf_counter()
            deadline = min(scan_deadline, self._clock.now() + timeout_s)
            outcome = "failed"
            try:
                async with asyncio.timeout(timeout_s):
                    value = await work(deadline)
                outcome = "completed"
                return value
            except TimeoutError:
                raise StageTimeout(f"The {name} stage took longer than {timeout_s:g}s.") from None
            except DB_ERRORS as exc:
                raise DatabaseError() from exc
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            finally:
                elapsed = time.perf_counter() - began
                state.timings[f"{name}_ms"] = _ms(elapsed)
                self._metrics.stage_duration.labels(name, outcome).observe(elapsed)

        def completed(name: str, pct: int, **fields: Any) -> None:
            emit(
                events.make(
                    "stage",
                    name,
                    pct,
                    status="completed",
                    duration_ms=state.timings[f"{name}_ms"],
                    **fields,
                )
            )

        vision = await stage(
            "vision", t.vision_s, 5, lambda d: self._vision.run(scan.input, deadline=d, safety_id=safety_id)
        )
        # The prepared image (~100 KB of base64) is only needed by the vision call; with
        # thousands of scans in flight, holding it through the answer adds up.
        scan.input = scan.input.without_image()
        self._metrics.stage_service.labels("vision").observe(vision.call.service_s)
        state.partial.update(vision.to_json())
        completed("vision", 30, **vision.to_json())

        rule = await stage(
            "rule",
            t.rule_s,
            35,
            lambda _d: self._timed_service("rule", self._rules.find(vision.classification)),
        )
        state.partial["disposal_rules"] = rule.to_json()
        completed("rule", 45, disposal_rules=rule.to_json(), reason=rule.reason)

        async def delta(text: str) -> None:
            emit(events.make("delta", "answer", min(88, 50 + events.seq), text=text))

        answer = await stage(
            "answer",
            t.answer_s,
            50,
            lambda d: self._answer.run(
                vision, rule, scan.input.user_input, deadline=d, emit=delta, safety_id=safety_id
            ),
        )
        if answer.call is not None:
            self._metrics.stage_service.labels("answer").observe(answer.call.service_s)
        state.partial["answer"] = answer.to_json()
        completed("answer", 90, answer=answer.to_json())

        reward = await stage(
            "reward",
            t.reward_s,
            92,
            lambda _d: self._timed_service(
                "reward",
                self._reward.run(
                    user_id=scan.user_id,
                    scan_id=scan.id,
                    c=vision.classification,
                    rule=rule,
                    answer=answer,
                ),
            ),
        )
        state.partial["reward"] = reward.to_json() if reward else None
        completed("reward", 98, reward=state.partial["reward"])
        state.step = "done"
        return {
            **vision.to_json(),
            "disposal_rules": rule.to_json(),
            "disposal_rules_reason": rule.reason,
            "answer": answer.to_json(),
            "reward": state.partial["reward"],
        }

    async def _timed_service(self, stage: str, work: Awaitable[T]) -> T:
        began = time.perf_counter()
        try:
            return await work
        finally:
            self._metrics.stage_service.labels(stage).observe(time.perf_counter() - began)


@dataclass
class _ScanState:
    step: str = "vision"
    timings: dict[str, float] = field(default_factory=dict)
    partial: dict[str, Any] = field(default_factory=dict)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)
