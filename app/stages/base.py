"""The stage contract. A stage is a class the `StageRunner` (app/scans/runner.py) runs,
listed once in app/stages/order.py. Everything about it lives in its own module:

- what it is: `name`, `label` (the page's words for it), its share of the progress bar,
  the upstream calls it makes (admission counts them as owed until it starts), whether
  it streams text (`delta` events);
- how it starts: `start(env)` builds it from what the lifespan offers (`StageEnv`),
  loads what it needs once (its tables, a listener) and registers its own clean-up;
- what it makes: `result_type`, one pydantic model (`StageResult`) whose fields are
  its `completed` event's fields. The `done` event, the stored result, `timings`
  (`<name>_ms`) and the OpenAPI document's event schemas are all derived from it and
  from the stage list; nothing else describes a stage's output;
- a stage that calls a model declares its `call` (a `StageCall`, app/upstream/stage_call.py):
  its gate, routes, budget, reply cache and metrics follow from it (`CallingStageClass`);
- `run(ctx)` returns that result, raising only errors from the error tree (a stage maps
  its own failures: the database stages their database errors).

Later stages read earlier results from the `ScanContext` by type
(`ctx.result(VisionResult)`), importing the type from the stage that makes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import asyncpg
from pydantic import BaseModel, ConfigDict

from app.db.taxonomy import Taxonomy
from app.limits.clock import Clock
from app.runtime.metrics import Metrics
from app.settings import Settings
from app.stages.context import ScanContext
from app.upstream.client import Upstream
from app.upstream.reply_cache import ReplyCache
from app.upstream.stage_call import StageCall

R_co = TypeVar("R_co", bound="StageResult", covariant=True)


class StageResult(BaseModel):
    """What a stage hands on. Its fields are the stage's `completed` event's fields, as
    sent; `done` and the stored result carry them too, under `done_names` where a name
    would be ambiguous among all stages' fields. Data for the service only (the upstream
    call behind it) lives in private attributes, never sent or documented."""

    model_config = ConfigDict(frozen=True)

    # field -> its name in `done` and the stored result, where they differ
    done_names: ClassVar[Mapping[str, str]] = {}

    def queue_seconds(self) -> float:
        """Of the stage's time, how much was spent waiting for a gate or the budget."""
        return 0.0

    def served_by(self) -> str | None:
        """The deployment whose call made it (None: no call of this scan's, e.g. a cached reply)."""
        return None

    def event_fields(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def done_fields(self, event_fields: dict[str, Any]) -> dict[str, Any]:
        """The stage's part of `done`, from the fields its `completed` event carried."""
        if not self.done_names:
            return event_fields
        return {self.done_names.get(name, name): value for name, value in event_fields.items()}


@dataclass(frozen=True)
class StageEnv:
    """What the lifespan offers every stage's `start`. What a stage opens it closes
    through `stack`, which unwinds in reverse at shutdown."""

    settings: Settings
    pool: asyncpg.Pool[asyncpg.Record]
    dsn: str  # this process's tagged DSN, for a connection of a stage's own (LISTEN)
    taxonomy: Taxonomy
    upstream: Upstream
    metrics: Metrics
    clock: Clock
    stack: AsyncExitStack
    calls: Mapping[str, StageCall]  # every calling stage's call, as set (`Settings.stage_call`)

    def call(self, stage: str) -> StageCall:
        return self.calls[stage]

    def reply_cache(self, stage: str) -> ReplyCache | None:
        """The stage's reply cache, as its call bounds it (None: off)."""
        return ReplyCache.bounded(stage, self.calls[stage].cache, clock=self.clock, metrics=self.metrics)


class StageDeclaration(Protocol):
    """What a stage declares about itself, as class attributes (read-only here)."""

    @property
    def name(self) -> str: ...
    @property
    def label(self) -> str: ...  # the page's words for it
    @property
    def progress_share(self) -> int: ...  # relative width of this stage on the 0-100 progress bar
    @property
    def upstream_calls(self) -> int: ...  # upstream calls per run (retries are not new calls)
    @property
    def streams_text(self) -> bool: ...  # emits `delta` events while it runs
    @property
    def result_type(self) -> type[StageResult]: ...


class Stage(StageDeclaration, Protocol[R_co]):
    """A built stage, as the runner sees it."""

    @property
    def timeout_s(self) -> float: ...

    async def run(self, ctx: ScanContext) -> R_co: ...


class StageClass(StageDeclaration, Protocol):
    """A stage's class, as the stage list holds it: what it is, and how it starts."""

    async def start(self, env: StageEnv) -> Stage[StageResult]: ...


@runtime_checkable
class CallingStageClass(Protocol):
    """A stage class that calls a model: what it asks (`call`), which the settings resolve.
    The lifespan builds a gate, routes and budgets for each (app/assembly/upstream.py)."""

    call: ClassVar[StageCall]


@runtime_checkable
class BudgetedStage(Protocol):
    """A stage that can say how long a new scan's call would wait for the budget:
    admission asks the first such stage before it admits a scan."""

    def predicted_budget_wait(self, owed_calls: int) -> float: ...
