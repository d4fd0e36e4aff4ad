"""What one running scan knows: its input, its deadlines, and the results of the stages
that ran so far. Stages read earlier results here, by the result's type."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from app.images.prepare import PreparedImage
from app.limits.admission import Ticket

T = TypeVar("T")


async def _no_item_events(kind: str, fields: dict[str, Any]) -> None:
    """For a context built without a log (a stage run on its own): item events go nowhere."""


ImageSource = Literal["upload", "data_url", "url"]


@dataclass(frozen=True)
class ScanInput:
    source: ImageSource
    image_url: str  # what the vision call sends: our prepared data URL, or the https URL
    user_input: str | None
    image: PreparedImage | None = None  # None for https URLs, passed through as is

    def without_image(self) -> ScanInput:
        return dataclasses.replace(self, image_url="", image=None)


@dataclass
class AcceptedScan:
    """A scan that passed admission, was read, prepared and recorded: ready to run."""

    id: uuid.UUID
    user_id: str | None
    input: ScanInput
    ticket: Ticket  # held until the scan ends, released exactly once by the pipeline
    received_at: float  # perf_counter at request arrival
    timings: dict[str, float] = field(default_factory=dict)
    retry_of: uuid.UUID | None = None  # the attempt this one retries (same Idempotency-Key)
    traceparent: str | None = None  # the request's span (W3C), when traced: the scan's parent


@dataclass
class ScanContext:
    scan: AcceptedScan
    safety_id: str | None  # what OpenAI's safety_identifier gets (a hash, never the id)
    emit_delta: Callable[[str], Awaitable[None]]  # text a stage streams (`delta` events)
    discard_text: Callable[[], Awaitable[None]]  # ...void from here on (a `discard` event)
    # An item event (`items`, `item`, `item_rule`: app/stages/items.py) with its fields.
    emit_item: Callable[[str, dict[str, Any]], Awaitable[None]] = _no_item_events
    deadline: float = 0.0  # the current stage's, on the pipeline's clock (it may move later)
    results: dict[type, object] = field(default_factory=dict)  # result type -> the result

    def current_deadline(self) -> float:
        """The stage's deadline as it is now: what a call reads before each attempt, so a
        limit stretched meanwhile (app/scans/runner.py) reaches its retries."""
        return self.deadline

    def result(self, kind: type[T]) -> T:
        """An earlier stage's result, by its type (`ctx.result(VisionResult)`)."""
        found = self.results.get(kind)
        if not isinstance(found, kind):
            raise LookupError(f"no {kind.__name__}: the stage that makes it has not run before this one")
        return found
