"""What a stage that calls a model asks of the upstream: one value per calling stage.

A calling stage declares its `StageCall` as a class attribute (`call`): the defaults of
its model, token cap, reasoning effort, sampling, photo detail, time limit, reply cache
and concurrency. The settings resolve it (`Settings.stage_call`): the vision and answer
stages keep their `VISION_*` / `ANSWER_*` variables, any other stage takes its overrides
from `STAGE_CALLS`. Everything built per calling stage (its gate, its routes on every
deployment naming a model for it, its reply cache, its metrics' `stage` label) follows
the list of these values, so a new calling stage is its own module and one line in the
stage order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from app.limits.sizing import LimitSpec
from app.upstream.profiles import CallShape, call_shape
from app.upstream.reply_cache import CacheLimits

DETAILS = ("low", "high", "auto")
NO_CACHE = CacheLimits(0, 0, 0.0)


@dataclass(frozen=True)
class StageCall:
    stage: str
    model: str = "gpt-4o-mini"
    max_tokens: int = 500  # the completion cap (reasoning models get their allowance on top)
    reasoning_effort: str | None = None
    temperature: float | None = None  # None: the model's default sampling
    detail: str | None = None  # a photo's detail (low, high, auto), for a stage that sends one
    timeout_s: float = 30.0  # the stage's least time limit (app/limits/timeouts.py stretches it)
    cache: CacheLimits = NO_CACHE  # its reply cache; a 0 bound: none
    concurrency: LimitSpec = field(default_factory=LimitSpec)  # its gate: sized, or fixed

    def shape(self, *, model: str | None = None, token_param: str = "auto") -> CallShape:
        """How this stage calls `model` (default: its own); ValueError says what the model
        does not accept."""
        return call_shape(
            model or self.model,
            output_tokens=self.max_tokens,
            effort=self.reasoning_effort,
            token_param=token_param,
            temperature=self.temperature,
        )

    def overridden(self, given: Mapping[str, Any]) -> StageCall:
        """This call with the fields `given` (one `STAGE_CALLS` entry) replaced; ValueError
        names a field that is unknown or of the wrong kind."""
        changes: dict[str, Any] = {}
        for name, value in given.items():
            if name not in _OVERRIDABLE:
                raise ValueError(f"{name}: unknown (known: {', '.join(sorted(_OVERRIDABLE))})")
            changes[name] = _cache(value) if name == "cache" else _field_value(name, value)
        call = replace(self, **changes)
        call.check()
        return call

    def check(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: >= 1, got {self.max_tokens}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: > 0, got {self.timeout_s}")
        if self.detail is not None and self.detail not in DETAILS:
            raise ValueError(f"detail: one of {', '.join(DETAILS)}, got {self.detail!r}")
        self.shape()


_OVERRIDABLE = {f.name for f in fields(StageCall)} - {"stage"}
_TEXT = ("model", "reasoning_effort", "detail")


def _field_value(name: str, value: Any) -> Any:
    if name == "concurrency":
        return LimitSpec.parse(f"concurrency {value!r}", str(value))
    if name in _TEXT:
        if value is None and name != "model":
            return None
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name}: a non-empty string, got {value!r}")
        return value.strip()
    # Python's JSON reads NaN and Infinity: no bound, or one no comparison fails.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: a number, got {value!r}")
    return int(value) if name == "max_tokens" else float(value)


def _cache(given: Any) -> CacheLimits:
    if given is None or given is False:
        return NO_CACHE
    try:
        limits = CacheLimits(int(given["entries"]), int(given["max_bytes"]), float(given["ttl_s"]))
    except (KeyError, TypeError, ValueError, OverflowError):
        limits = None
    if limits is None or not math.isfinite(limits.ttl_s):
        raise ValueError(f"cache: {{entries, max_bytes, ttl_s}}, got {given!r}")
    return limits
