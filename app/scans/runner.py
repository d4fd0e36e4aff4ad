"""`StageRunner` runs one stage of one scan and does, for every stage, the same things
once: the started/completed events, the stage's deadline (the sooner of its own time
limit and the scan's deadline, both on the pipeline's `Clock`; its own limit is its
setting or `TAIL` x the longest the stage took lately, app/limits/timeouts.py), the admission ticket's
owed calls, queue-vs-service timing, metrics, and keeping the stage's result where
later stages and the final result find it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from app.errors import ScanDeadlineExceeded, StageTimeout
from app.limits.clock import Clock
from app.limits.timeouts import RecentPeak
from app.runtime import tracing
from app.runtime.metrics import Metrics
from app.scans.events import EventLog, StageCompleted, StageStarted
from app.stages.base import Stage, StageDeclaration, StageResult
from app.stages.context import ScanContext

# The bar runs from here to PROGRESS_END across the stages, by their shares; `done` is 100.
PROGRESS_START = 2
PROGRESS_END = 98


@dataclass(frozen=True)
class ProgressSpan:
    started: int
    completed: int


def progress_spans(stages: Sequence[StageDeclaration]) -> dict[str, ProgressSpan]:
    """Each stage's progress at start and completion, from the stages' shares."""
    total = sum(stage.progress_share for stage in stages) or 1
    width = PROGRESS_END - PROGRESS_START
    spans: dict[str, ProgressSpan] = {}
    done = 0
    for stage in stages:
        start = PROGRESS_START + width * done // total
        done += stage.progress_share
        spans[stage.name] = ProgressSpan(start, PROGRESS_START + width * done // total)
    return spans


@dataclass
class ScanProgress:
    """What a scan has done so far: the step it is on, timings, and its result fields."""

    step: str
    timings: dict[str, float]
    result: dict[str, Any]


class StageRunner:
    def __init__(self, stages: Sequence[Stage[StageResult]], *, metrics: Metrics, clock: Clock) -> None:
        self.stages = list(stages)
        self.spans = progress_spans(stages)
        self._metrics = metrics
        self._clock = clock
        # How long each stage took lately (completed ones): what its time limit stretches to.
        self._took = {stage.name: RecentPeak() for stage in stages}
        # Each stage's span, named once: a scan's stages run on every scan, traced or not.
        self._span_args = {s.name: (f"stage {s.name}", {"ecoscan.stage": s.name}) for s in stages}

    @property
    def calls_per_scan(self) -> int:
        """Upstream calls one scan makes: what admission counts as owed when it admits one."""
        return sum(stage.upstream_calls for stage in self.stages)

    async def run(
        self,
        stage: Stage[StageResult],
        ctx: ScanContext,
        log: EventLog,
        progress: ScanProgress,
        deadline: float,
    ) -> None:
        progress.step = stage.name
        span = self.spans[stage.name]
        log.append(StageStarted(stage.name), span.started)
        ctx.scan.ticket.calls_started(stage.upstream_calls)
        started = self._clock.now()
        took = self._took[stage.name]
        limit_s = stage.timeout_s

        def stage_deadline() -> float:
            # Asked at the start and again when reached: stages that completed meanwhile
            # may say this one may take longer. Calls made from here on get the new one.
            nonlocal limit_s
            limit_s = took.timeout(stage.timeout_s, self._clock.now())
            ctx.deadline = min(deadline, started + limit_s)
            return ctx.deadline

        stage_deadline()
        try:
            result = await self._timed(stage, ctx, progress, stage_deadline)
        except TimeoutError:
            if deadline <= started + limit_s:
                raise ScanDeadlineExceeded() from None
            raise StageTimeout(f"The {stage.name} stage took longer than {limit_s:.3g}s.") from None
        took.observe(self._clock.now() - started, self._clock.now())
        ctx.results[type(result)] = result
        fields = result.event_fields()
        progress.result.update(result.done_fields(fields))
        if stage.upstream_calls:  # `done` says which deployment served each calling stage
            progress.result.setdefault("upstreams", {})[stage.name] = result.served_by()
        duration_ms = progress.timings[f"{stage.name}_ms"]
        log.append(StageCompleted(stage.name, duration_ms, fields), span.completed)

    async def _timed(
        self,
        stage: Stage[StageResult],
        ctx: ScanContext,
        progress: ScanProgress,
        deadline: Callable[[], float],
    ) -> StageResult:
        began = time.perf_counter()
        outcome = "failed"
        try:
            with tracing.span(*self._span_args[stage.name]):
                async with self._clock.timeout_at(deadline):
                    result = await stage.run(ctx)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        else:
            outcome = "completed"
            elapsed = time.perf_counter() - began
            self._metrics.stage_service.labels(stage.name).observe(elapsed - result.queue_seconds())
            return result
        finally:
            elapsed = time.perf_counter() - began
            progress.timings[f"{stage.name}_ms"] = round(elapsed * 1000, 1)
            self._metrics.stage_duration.labels(stage.name, outcome).observe(elapsed)
