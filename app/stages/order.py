"""The scan's stages, in the order they run: the one list. The lifespan builds them from
it, the OpenAPI document, the page, the tests and the benchmark tools read it."""

from __future__ import annotations

from app.stages.answer import AnswerStage
from app.stages.base import StageClass
from app.stages.reward import RewardStage
from app.stages.rule import RuleBook
from app.stages.vision import VisionStage

STAGES: tuple[StageClass, ...] = (VisionStage, RuleBook, AnswerStage, RewardStage)


def stage_names() -> list[str]:
    return [stage.name for stage in STAGES]
