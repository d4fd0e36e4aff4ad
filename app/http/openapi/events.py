"""The event stream's schemas, derived from the stage list: each stage's `completed` event
carries its result type's fields, `done` all of them (under their `done` names) and
`timings` one `<name>_ms` per stage, `delta` belongs to the stages that stream text.
A stage added to the list is documented by being added.

The stream is described the way OpenAPI 3.2 describes sequential media types, and
FastAPI its own SSE routes: the `text/event-stream` media type has an `itemSchema`, the
schema of one event (`event`, `id`, `data`), whose `data` is JSON
(`contentMediaType`/`contentSchema`) of the schema its event name selects. Tools that do
not know `itemSchema` (OpenAPI 3.1 has no keyword for one event) see an untyped body: a
generated client returns the stream's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal
from uuid import UUID

from pydantic import BaseModel, Field, create_model
from pydantic.fields import FieldInfo

from app.http.openapi.common import REF
from app.http.openapi.errors import stream_error_codes
from app.stages.base import StageClass
from app.stages.items import FoundItem
from app.stages.rule import ItemRule, RuleBook
from app.stages.vision import VisionStage

# Where a stream response's description lists what each stage's `completed` event
# carries: filled in for the app's stage list (`stream_description`).
STAGE_FIELDS = "{stage fields}"

SCAN_STREAM_DESCRIPTION = f"""\
The scan's progress as Server-Sent Events, ending with exactly one `done` or `error`.

Every event's `data` is JSON with `job_id` (the scan id), `step`, `seq` (1, 2, 3...,
also the SSE `id`) and `progress` (0-100, never decreasing), plus, by event name:

{STAGE_FIELDS}
- `error`: terminal failure: `step`, `code`, `message`, `retryable`, and `retry_after`
  (seconds) when it is known when capacity returns.

Comment lines (`: ping`) keep an idle connection alive. The `itemSchema` of
`text/event-stream` is the schema of one event; its `data` has the `*Event` schema
its event name selects."""


class _Event(BaseModel):
    job_id: UUID = Field(description="The scan's id (also the response's `X-Scan-Id`).")
    seq: int = Field(ge=1, description="1, 2, 3... in order; also the event's SSE `id`.")
    progress: int = Field(ge=0, le=100, description="0-100, never decreasing.")


class _StageCompleted(_Event):
    status: Literal["completed"]
    duration_ms: float


def _one_of(values: Sequence[str]) -> Any:
    """`Literal[values...]`, for a list known only when the app is built."""
    return Literal.__getitem__(tuple(values))


def _result_fields(stage: StageClass, *, done: bool = False) -> dict[str, tuple[Any, FieldInfo]]:
    names = stage.result_type.done_names if done else {}
    fields = stage.result_type.model_fields
    return {names.get(name, name): (info.annotation, info) for name, info in fields.items()}


def _model_name(stage_name: str) -> str:
    return "".join(part.title() for part in stage_name.split("_"))


def _sentence(doc: str | None, fallback: str) -> str:
    text = " ".join((doc or fallback).split())
    return text[:1].lower() + text[1:]


def event_models(stages: Sequence[StageClass]) -> dict[str, list[type[BaseModel]]]:
    """Each event name's `data` schemas, for this stage list."""
    names = [stage.name for stage in stages]
    started = _model(
        "StageStartedEvent",
        "`event: stage`: a stage started.",
        step=(_one_of(names), ...),
        status=(_one_of(["started"]), ...),
    )
    completed = [
        _model(
            f"{_model_name(stage.name)}CompletedEvent",
            "`event: stage`: " + _sentence(stage.result_type.__doc__, f"{stage.name} ended."),
            base=_StageCompleted,
            step=(_one_of([stage.name]), ...),
            **_result_fields(stage),
        )
        for stage in stages
    ]
    streaming = [stage.name for stage in stages if stage.streams_text]
    delta = _model(
        "DeltaEvent",
        "`event: delta`: the next piece of the guidance as it is written.",
        step=(_one_of(streaming) if streaming else str, ...),
        text=(str, ...),
    )
    discard = _model(
        "DiscardEvent",
        "`event: discard`: the text streamed so far is void: the call writing it failed and "
        "starts again (on another deployment); the `delta`s that follow are the new text.",
        step=(_one_of(streaming) if streaming else str, ...),
    )
    done = _done_model(stages)
    failed_step = (
        f"The step that failed: {', '.join(names)} or done; `client` when the client went away and "
        "did not come back in time (`CLIENT_DISCONNECTED`, read back later)."
    )
    error = _model(
        "ErrorEvent",
        "`event: error`: terminal failure after the stream started.",
        step=(str, Field(description=failed_step)),
        code=(str, Field(description="Stable code: " + ", ".join(stream_error_codes()) + ".")),
        message=(str, ...),
        retryable=(bool, ...),
        retry_after=(
            int | None,
            Field(
                default=None,
                ge=1,
                description="Seconds until a retry may succeed, when known (e.g. every deployment is down).",
            ),
        ),
    )
    return {
        "stage": [started, *completed],
        **item_event_models(stages),
        "delta": [delta],
        "discard": [discard],
        "done": [done],
        "error": [error],
    }


def _done_model(stages: Sequence[StageClass]) -> type[BaseModel]:
    """`done`: every stage's result fields, who served each calling stage, the timings."""
    per_stage = {f"{stage.name}_ms": (float, ...) for stage in stages}
    timings = _model(
        "Timings", None, base=BaseModel, prepare_ms=(float, ...), **per_stage, total_ms=(float, ...)
    )
    done_fields: dict[str, Any] = {}
    for stage in stages:
        done_fields.update(_result_fields(stage, done=True))
    calling = [stage.name for stage in stages if stage.upstream_calls]
    if calling:
        served = _model(
            "Upstreams",
            "The deployment that served each stage that calls a model (null: a cached reply).",
            base=BaseModel,
            **{name: (str | None, ...) for name in calling},
        )
        done_fields["upstreams"] = (served, ...)
    return _model(
        "DoneEvent",
        "`event: done`: terminal success; authoritative over the deltas.",
        step=(_one_of(["done"]), ...),
        **done_fields,
        timings=(timings, ...),
        trace_id=(
            str | None,
            Field(None, description="The scan's trace (32 hex digits), when traces are on (`OTEL_*`)."),
        ),
    )


def item_event_models(stages: Sequence[StageClass]) -> dict[str, list[type[BaseModel]]]:
    """The vision and rule stages' item events (app/stages/items.py), where they are listed."""
    events: dict[str, list[type[BaseModel]]] = {}
    if VisionStage in stages:
        vision = (_one_of([VisionStage.name]), ...)
        events["items"] = [
            _model(
                "ItemsEvent",
                "`event: items`: how many items the photo holds (sent for every photo, before "
                "the vision stage completes); `item` events follow for a photo of several.",
                step=vision,
                count=(int, Field(ge=1, description="Items found, at most MAX_ITEMS.")),
                main=(int, Field(ge=0, description="The main item's `index`.")),
                dropped=(int, Field(ge=0, description="Items the reply named that were left out.")),
            )
        ]
        item_fields: dict[str, Any] = {
            name: (info.annotation, info) for name, info in FoundItem.model_fields.items()
        }
        events["item"] = [
            _model(
                "ItemEvent",
                "`event: item`: one item of a photo of several, classified, with its box.",
                step=vision,
                **item_fields,
            )
        ]
    if RuleBook in stages:
        rule_fields: dict[str, Any] = {
            name: (info.annotation, info) for name, info in ItemRule.model_fields.items()
        }
        events["item_rule"] = [
            _model(
                "ItemRuleEvent",
                "`event: item_rule`: one item of a photo of several, its rules found.",
                step=(_one_of([RuleBook.name]), ...),
                **rule_fields,
            )
        ]
    return events


def _model(name: str, doc: str | None, *, base: type[BaseModel] = _Event, **fields: Any) -> type[BaseModel]:
    """A model whose fields are known only when the app is built (pydantic's `create_model`)."""
    model: type[BaseModel] = create_model(name, __base__=base, __doc__=doc, **fields)
    return model


def _data(models: list[type[BaseModel]]) -> dict[str, Any]:
    refs = [{"$ref": REF + m.__name__} for m in models]
    return {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": refs[0] if len(refs) == 1 else {"oneOf": refs},
    }


def sse_item_schema(events: dict[str, list[type[BaseModel]]]) -> dict[str, Any]:
    """One event of the stream, as OpenAPI 3.2 models a `text/event-stream` item."""
    return {
        "type": "object",
        "required": ["event", "data", "id"],
        "properties": {
            "event": {"type": "string", "enum": list(events)},
            "id": {"type": "string", "description": "The event's `seq`."},
            "data": {"type": "string", "contentMediaType": "application/json"},
        },
        "oneOf": [
            {"properties": {"event": {"const": name}, "data": _data(models)}}
            for name, models in events.items()
        ],
    }


def _listed(names: Sequence[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)


def stream_description(description: str, stages: Sequence[StageClass]) -> str:
    """`description` with `STAGE_FIELDS` filled in for this stage list."""
    results = "; ".join(f"{stage.name} → {_listed(list(_result_fields(stage)))}" for stage in stages)
    done = [name for stage in stages for name in _result_fields(stage, done=True)]
    streaming = [stage.name for stage in stages if stage.streams_text]
    lines = [
        '- `stage`: `status: "started"`; or `status: "completed"`, `duration_ms` and the stage\'s '
        f"result: {results}.",
        *_item_lines(stages),
        f"- `delta`: `step` ({_listed(streaming)}), `text`: the next piece of the guidance as it is written.",
        "- `discard`: `step`: the text of that step streamed so far is void (its call starts "
        "again elsewhere); the deltas that follow are the new text.",
        f"- `done`: terminal success: {_listed([*done, 'upstreams', 'timings'])}.",
    ]
    return description.replace(STAGE_FIELDS, "\n".join(lines))


def _item_lines(stages: Sequence[StageClass]) -> list[str]:
    lines = []
    if VisionStage in stages:
        lines.append(
            "- `items`: `count`, `main`, `dropped`: how many items the photo holds, for every photo, "
            "before vision completes; for a photo of several, `item` events follow: `index`, `main`, "
            "`classification`, `item_name`, `situation_tags`, `box` (shares of the image, or null)."
        )
    if RuleBook in stages:
        lines.append(
            "- `item_rule`: `index`, `disposal_rules`, `reason`: one item's rules (a photo of several), "
            "each as soon as it is found."
        )
    return lines
