"""What one running scan knows: its input, its deadlines, and the results of the stages
that ran so far. Stages read earlier results here (typed), never from each other."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

from app.images.prepare import PreparedImage
from app.limits.admission import Ticket
from app.stages.results import Answer, Reward, RuleMatch, VisionResult

T = TypeVar("T")

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


@dataclass
class ScanContext:
    scan: AcceptedScan
    safety_id: str | None  # what OpenAI's safety_identifier gets (a hash, never the id)
    emit_delta: Callable[[str], Awaitable[None]]  # the answer stage's streamed text
    deadline: float = 0.0  # the current stage's, on the pipeline's clock
    results: dict[str, Any] = field(default_factory=dict)  # stage name -> its result

    def _result(self, stage: str, kind: type[T]) -> T:
        if stage not in self.results:
            raise LookupError(f"the {stage} stage has not run before this one")
        result: T = self.results[stage]  # what the stage stored (its `kind`), not checked per call
        return result

    @property
    def vision(self) -> VisionResult:
        return self._result("vision", VisionResult)

    @property
    def rule(self) -> RuleMatch:
        return self._result("rule", RuleMatch)

    @property
    def answer(self) -> Answer:
        return self._result("answer", Answer)

    @property
    def reward(self) -> Reward | None:
        return cast("Reward | None", self.results.get("reward"))
