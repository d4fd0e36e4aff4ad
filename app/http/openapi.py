"""What `/openapi.json` says about the API: for client generators, fuzzers and readers.

Documentation only. The scan endpoint reads its raw body itself (the acceptance service
parses and validates it in the CPU lane), so nothing here is used to parse a request or
to shape a response: the models below are never instantiated, they only give the
document its schemas.

Two parts:

- what the route decorators in `app/http/routes.py` carry (`responses`, `openapi_extra`,
  `response_model`): the operations, their parameters, bodies and responses, with
  `$ref`s to the schemas below;
- `install_openapi(app, settings)`: the app's `openapi()`, which adds the schemas no
  route declares as a model (the request bodies, the event stream's events) and the
  limits of this deployment (`USER_INPUT_MAX_CHARS`, `IMAGE_MAX_BYTES`...).

The event stream is described the way OpenAPI 3.2 describes sequential media types, and
FastAPI its own SSE routes: the `text/event-stream` media type has an `itemSchema`, the
schema of one event (`event`, `id`, `data`), whose `data` is JSON
(`contentMediaType`/`contentSchema`) of the schema its event name selects. Tools that do
not know `itemSchema` (OpenAPI 3.1 has no keyword for one event) see an untyped body: a
generated client returns the stream's text.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, JsonValue
from pydantic.json_schema import SkipJsonSchema, models_json_schema

from app.errors import (
    ClientDisconnected,
    DatabaseUnavailable,
    EcoscanError,
    InternalError,
    InvalidRequest,
    NotFound,
    Overloaded,
    ProcessLost,
    RequestRejected,
    ScanAlreadyFinished,
    ScanConflict,
    ScanEventsGone,
    ScanFailed,
    ScanNotFound,
    ScanRunningElsewhere,
    ServerBusy,
    TokenExpired,
    TokenInvalid,
    Unauthorized,
)
from app.intake.acceptance import MAX_IDEMPOTENCY_KEY_CHARS
from app.intake.identity import MAX_USER_ID_CHARS
from app.intake.image_url import MAX_IMAGE_URL_CHARS
from app.settings import Settings

REF = "#/components/schemas/"
IMAGE_TYPES = "image/jpeg, image/png, image/webp, image/gif"
# A 1x1 PNG: the smallest image a scan accepts.
EXAMPLE_DATA_URL = (
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR42mPQWBAFAAIWASMT0+0EAAAAAElFTkSuQmCC"
)

# --- errors ------------------------------------------------------------------------

# The scan endpoint refuses with every client mistake and admission refusal of the error
# tree but these: nobody reads a 499, and the scans-as-resources refusals belong to the
# endpoints that read, follow or cancel a scan (of them, a POST that repeats an earlier
# one with its `Idempotency-Key` can only meet `SCAN_RUNNING_ELSEWHERE`). Derived, so
# that a refusal added to the tree is documented with it.
_NOT_SCAN_REFUSALS: frozenset[type[EcoscanError]] = frozenset(
    {ClientDisconnected, NotFound, ScanNotFound, ScanConflict, ScanAlreadyFinished, ScanEventsGone}
)


def _subclasses(cls: type[EcoscanError]) -> Iterator[type[EcoscanError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def scan_refusals() -> list[type[EcoscanError]]:
    """The errors the scan endpoint answers with JSON before any stream starts."""
    found = [
        cls
        for base in (RequestRejected, Overloaded)
        for cls in _subclasses(base)
        if cls not in _NOT_SCAN_REFUSALS
    ]
    # 500: a bug (rendered by app/main.py). A database failure while a repeated POST's
    # earlier scan is read is 503 DATABASE_UNAVAILABLE, already among the refusals.
    return [*dict.fromkeys(found), InternalError]


# What the identity layer (app/intake/identity.py) refuses with, wherever it is asked who calls:
# a malformed X-User-ID (gateway mode), no identity where one is required, a bad or
# expired bearer token (jwt mode), and the JWKS keys unavailable (AUTH_JWKS_URL).
IDENTITY_REFUSALS: list[type[EcoscanError]] = [
    InvalidRequest,
    Unauthorized,
    TokenInvalid,
    TokenExpired,
    ServerBusy,
]

# The endpoints that read a scan back: a database that does not answer is 503
# `DATABASE_UNAVAILABLE` (with Retry-After), a bug 500.
_READ_FAILURES: list[type[EcoscanError]] = [InternalError, DatabaseUnavailable]

SCAN_STATUS_ERRORS: list[type[EcoscanError]] = [ScanNotFound, *IDENTITY_REFUSALS, *_READ_FAILURES]
SCAN_EVENTS_ERRORS: list[type[EcoscanError]] = [
    ScanNotFound,
    ScanRunningElsewhere,
    ScanEventsGone,
    *IDENTITY_REFUSALS,
    *_READ_FAILURES,
]
SCAN_CANCEL_ERRORS: list[type[EcoscanError]] = [
    ScanNotFound,
    ScanAlreadyFinished,
    ScanRunningElsewhere,
    *IDENTITY_REFUSALS,
    *_READ_FAILURES,
]
CHARACTERS_ERRORS: list[type[EcoscanError]] = [*IDENTITY_REFUSALS, DatabaseUnavailable, InternalError]

# Why an error is answered, where its default message does not say it.
_WHY: dict[type[EcoscanError], str] = {
    InvalidRequest: (
        "The request is invalid: a malformed field, header (X-User-ID, Idempotency-Key, "
        "Last-Event-ID) or parameter (`after`)."
    ),
    Unauthorized: (
        "No identity where one is required (AUTH_MODE=jwt: no `Authorization: Bearer` token; "
        "or AUTH_ALLOW_ANONYMOUS=false; `/users/me/...`: an anonymous caller)."
    ),
    ServerBusy: (
        "At capacity, or (AUTH_MODE=jwt with AUTH_JWKS_URL) the keys that verify tokens are unavailable."
    ),
    ScanNotFound: (
        "No such scan, not a scan id, or not the caller's (the same answer: existence is not disclosed)."
    ),
    DatabaseUnavailable: "The database did not answer (while the scan was being read, or recorded).",
}


# Rendered outside the error tree: by app/main.py's HTTPException handler (404, 405) and
# by app/http/protocol.py for requests the application never sees (malformed HTTP, 400;
# a request head over its limit, 431).
_OTHER_ERROR_CODES = ["NOT_FOUND", "METHOD_NOT_ALLOWED", "BAD_HTTP_REQUEST", "REQUEST_HEADERS_TOO_LARGE"]


def error_codes() -> list[str]:
    """Every `code` a JSON error body may carry."""
    documented = [
        *scan_refusals(),
        *SCAN_STATUS_ERRORS,
        *SCAN_EVENTS_ERRORS,
        *SCAN_CANCEL_ERRORS,
        *CHARACTERS_ERRORS,
    ]
    return list(dict.fromkeys([cls.code for cls in documented] + _OTHER_ERROR_CODES))


def stream_error_codes() -> list[str]:
    """The codes of `error` events (failures after the stream started). A scan whose
    client went away (and did not come back in time) ends with `CLIENT_DISCONNECTED`,
    which its owner reads back; `PROCESS_LOST` is a row's, never an event's."""
    codes = [cls.code for cls in _subclasses(ScanFailed) if cls is not ProcessLost]
    return list(dict.fromkeys([*codes, ClientDisconnected.code]))


class Error(BaseModel):
    """Every JSON error: a message for people and a stable code for programs."""

    model_config = ConfigDict(title="Error")

    detail: str = Field(description="What went wrong, for people.")
    code: str = Field(
        description="Stable machine-readable code (see the response's description).",
        json_schema_extra={"enum": list[JsonValue](error_codes())},
    )


def _retry_after(description: str) -> dict[str, Any]:
    return {
        "Retry-After": {
            "description": description,
            "required": True,
            "schema": {"type": "integer", "minimum": 1},
        }
    }


_WWW_AUTHENTICATE = {
    "WWW-Authenticate": {
        "description": 'The challenge: `Bearer`, or `Bearer error="invalid_token"...` for a bad token.',
        "required": True,
        "schema": {"type": "string"},
    }
}

_REFUSED = "Refused before any stream started; nothing was recorded."
_UNEXPECTED = "An unexpected failure (a bug) before any stream started."


def error_responses(
    classes: list[type[EcoscanError]], *, refused: str = _REFUSED, unexpected: str = _UNEXPECTED
) -> dict[int | str, dict[str, Any]]:
    """`responses` for every status `classes` answer with: an `Error`, its codes in the
    description, and the headers every error of that status carries."""
    by_status: dict[int, list[type[EcoscanError]]] = {}
    for cls in dict.fromkeys(classes):
        by_status.setdefault(cls.status, []).append(cls)
    responses: dict[int | str, dict[str, Any]] = {}
    for status in sorted(by_status):
        group = by_status[status]
        lines = "\n".join(f"- `{cls.code}`: {_WHY.get(cls, cls.default_message)}" for cls in group)
        when = unexpected if status == InternalError.status else refused
        response: dict[str, Any] = {"model": Error, "description": f"{when}\n\n{lines}"}
        if all(issubclass(cls, Overloaded) for cls in group):
            response["headers"] = _retry_after("Seconds to wait before retrying.")
        elif all(issubclass(cls, Unauthorized) for cls in group):
            response["headers"] = _WWW_AUTHENTICATE
        responses[status] = response
    return responses


def scan_error_responses() -> dict[int | str, dict[str, Any]]:
    """`responses` of the scan endpoint for every status it refuses with."""
    return error_responses(scan_refusals())


# --- request bodies ------------------------------------------------------------------


def scan_request_schema(settings: Settings) -> dict[str, Any]:
    return {
        "title": "ScanRequest",
        "description": "A scan of an image given by URL: an `https://` URL the model fetches, or a data URL.",
        "type": "object",
        "required": ["image_url"],
        "properties": {
            "image_url": {
                "type": "string",
                "minLength": 1,
                "pattern": "^(https://|data:)",
                "description": (
                    "An `https://` URL (at most "
                    f"{MAX_IMAGE_URL_CHARS} characters, a public host name: no user name or password, "
                    "no private, loopback, link-local or reserved IP address, no `localhost`, "
                    "`*.local`, `*.internal` or single-label host), or a base64 data URL "
                    f"(`data:image/jpeg;base64,...`; {IMAGE_TYPES}; the image at most "
                    f"{settings.image_max_bytes} bytes and {settings.image_max_pixels} pixels)."
                ),
                "examples": ["https://example.com/bottle.jpg", EXAMPLE_DATA_URL],
            },
            "user_input": _user_input_schema(settings),
        },
    }


def scan_upload_schema(settings: Settings) -> dict[str, Any]:
    return {
        "title": "ScanUpload",
        "description": "A scan of an uploaded image.",
        "type": "object",
        "required": ["image"],
        "properties": {
            "image": {
                "type": "string",
                "format": "binary",
                "description": (
                    f"The photo: {IMAGE_TYPES} (recognised from its bytes), at most "
                    f"{settings.image_max_bytes} bytes and {settings.image_max_pixels} pixels."
                ),
            },
            "user_input": _user_input_schema(settings),
        },
    }


def _user_input_schema(settings: Settings) -> dict[str, Any]:
    return {
        "type": "string",
        "maxLength": settings.user_input_max_chars,
        "description": (
            "The user's question or remarks about the item, at most "
            f"{settings.user_input_max_chars} characters (USER_INPUT_MAX_CHARS) after trimming."
        ),
    }


# --- the event stream ----------------------------------------------------------------


class _Event(BaseModel):
    job_id: UUID = Field(description="The scan's id (also the response's `X-Scan-Id`).")
    seq: int = Field(ge=1, description="1, 2, 3... in order; also the event's SSE `id`.")
    progress: int = Field(ge=0, le=100, description="0-100, never decreasing.")


class Classification(BaseModel):
    major: str = Field(description="Major category (대분류).")
    middle: str | None = Field(description="Middle category; set for recyclables (재활용폐기물) only.")
    minor: str | None = Field(description="One of the category's known items, or null.")


class NotAcceptedItem(BaseModel):
    item: str
    instead: str


class RuleKey(BaseModel):
    major: str
    middle: str | None


class DisposalRules(BaseModel):
    """The rule document for the item's category."""

    title: str
    summary: str
    preparation: list[str]
    disposal: list[str]
    not_accepted: list[NotAcceptedItem]
    tips: list[str]
    matched_by: Literal["exact", "minor", "major"]
    key: RuleKey


class Answer(BaseModel):
    steps: list[str]
    insufficiencies: list[str] = Field(description="What the user still has to do.")
    user_answer: str


class Character(BaseModel):
    code: str
    name: str
    dialog: str


class Reward(BaseModel):
    character: Character
    received: bool = Field(description="This scan added the character to the user's collection.")
    already_owned: bool = Field(description="The user had it before (anonymous scans: both false).")


class Timings(BaseModel):
    prepare_ms: float
    vision_ms: float
    rule_ms: float
    answer_ms: float
    reward_ms: float
    total_ms: float


class StageStartedEvent(_Event):
    """`event: stage`: a stage started."""

    step: Literal["vision", "rule", "answer", "reward"]
    status: Literal["started"]


class _StageCompleted(_Event):
    status: Literal["completed"]
    duration_ms: float


class VisionCompletedEvent(_StageCompleted):
    """`event: stage`: the vision stage classified the item."""

    step: Literal["vision"]
    classification: Classification
    item_name: str = Field(description="The model's own words for the item.")
    situation_tags: list[str]


class RuleCompletedEvent(_StageCompleted):
    """`event: stage`: the disposal rules were looked up."""

    step: Literal["rule"]
    disposal_rules: DisposalRules | None
    reason: str | None = Field(description="Why `disposal_rules` is null.")


class AnswerCompletedEvent(_StageCompleted):
    """`event: stage`: the guidance is written (the `delta` texts were its rendering)."""

    step: Literal["answer"]
    answer: Answer


class RewardCompletedEvent(_StageCompleted):
    """`event: stage`: the reward was matched (null unless the item earns one)."""

    step: Literal["reward"]
    reward: Reward | None


class DeltaEvent(_Event):
    """`event: delta`: the next piece of the guidance as it is written."""

    step: Literal["answer"]
    text: str


class DoneEvent(_Event):
    """`event: done`: terminal success; authoritative over the deltas."""

    step: Literal["done"]
    classification: Classification
    item_name: str
    situation_tags: list[str]
    disposal_rules: DisposalRules | None
    disposal_rules_reason: str | None
    answer: Answer
    reward: Reward | None
    timings: Timings


class ErrorEvent(_Event):
    """`event: error`: terminal failure after the stream started."""

    step: str = Field(
        description=(
            "The step that failed: vision, rule, answer, reward or done; `client` when the client "
            "went away and did not come back in time (`CLIENT_DISCONNECTED`, read back later)."
        )
    )
    code: str = Field(description="Stable code: " + ", ".join(stream_error_codes()) + ".")
    message: str
    retryable: bool


_STREAM_EVENTS: dict[str, list[type[BaseModel]]] = {
    "stage": [
        StageStartedEvent,
        VisionCompletedEvent,
        RuleCompletedEvent,
        AnswerCompletedEvent,
        RewardCompletedEvent,
    ],
    "delta": [DeltaEvent],
    "done": [DoneEvent],
    "error": [ErrorEvent],
}


def _data(models: list[type[BaseModel]]) -> dict[str, Any]:
    refs = [{"$ref": REF + m.__name__} for m in models]
    return {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": refs[0] if len(refs) == 1 else {"oneOf": refs},
    }


def sse_item_schema() -> dict[str, Any]:
    """One event of the stream, as OpenAPI 3.2 models a `text/event-stream` item."""
    return {
        "type": "object",
        "required": ["event", "data", "id"],
        "properties": {
            "event": {"type": "string", "enum": list(_STREAM_EVENTS)},
            "id": {"type": "string", "description": "The event's `seq`."},
            "data": {"type": "string", "contentMediaType": "application/json"},
        },
        "oneOf": [
            {"properties": {"event": {"const": name}, "data": _data(models)}}
            for name, models in _STREAM_EVENTS.items()
        ],
    }


SCAN_STREAM_DESCRIPTION = """\
The scan's progress as Server-Sent Events, ending with exactly one `done` or `error`.

Every event's `data` is JSON with `job_id` (the scan id), `step`, `seq` (1, 2, 3...,
also the SSE `id`) and `progress` (0-100, never decreasing), plus, by event name:

- `stage`: `status: "started"`; or `status: "completed"`, `duration_ms` and the stage's
  result: vision → `classification`, `item_name`, `situation_tags`; rule →
  `disposal_rules`, `reason`; answer → `answer`; reward → `reward`.
- `delta`: `step: "answer"`, `text`: the next piece of the guidance as it is written.
- `done`: terminal success: `classification`, `item_name`, `situation_tags`,
  `disposal_rules`, `disposal_rules_reason`, `answer`, `reward`, `timings`.
- `error`: terminal failure: `step`, `code`, `message`, `retryable`.

Comment lines (`: ping`) keep an idle connection alive. The `itemSchema` of
`text/event-stream` is the schema of one event; its `data` has the `*Event` schema
its event name selects."""


_SCAN_ID_HEADER = {
    "X-Scan-Id": {
        "description": "The scan's id (the events' `job_id`).",
        "required": True,
        "schema": {"type": "string", "format": "uuid"},
    }
}

_NEW_SCAN_HEADERS = {
    "X-Scan-Token": {
        "description": (
            "Anonymous scans only, shown once: the capability token that reads, follows or cancels "
            "this scan (`X-Scan-Token` header or `token` parameter of `/api/v1/scan/{job_id}...`)."
        ),
        "required": False,
        "schema": {"type": "string"},
    },
    "Idempotent-Replayed": {
        "description": (
            "`true` when this response is the stream of an earlier scan with the same "
            "`Idempotency-Key` (replayed from its first event, then live); absent for a new scan."
        ),
        "required": False,
        "schema": {"type": "string", "enum": ["true"]},
    },
}


def scan_stream_response(
    description: str = SCAN_STREAM_DESCRIPTION, headers: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "description": description,
        "headers": {**_SCAN_ID_HEADER, **(headers or {})},
        "content": {
            "text/event-stream": {
                # No `type`: the whole stream (OpenAPI 3.2 reads this as the list of its
                # events); one event is `itemSchema`.
                "schema": {"description": "The event stream, as text."},
                "itemSchema": sse_item_schema(),
            }
        },
    }


# --- the scan operation ----------------------------------------------------------------

SCAN_DESCRIPTION = """\
Classify a photo of an item of waste and stream the disposal guidance.

Send the image either as JSON (`image_url`: an `https://` URL or a data URL) or as a
multipart upload (`image`), with an optional `user_input`. Refusals come before any
stream as a JSON `Error` with the status below; an accepted scan answers `200` with a
`text/event-stream` of its stages, which ends with one `done` or `error` event."""

# Who calls: with AUTH_MODE=gateway (the default) the gateway's X-User-ID, with
# AUTH_MODE=jwt a bearer token (the other is then ignored).
BEARER_SCHEME = "bearerAuth"
SECURITY_SCHEMES: dict[str, Any] = {
    BEARER_SCHEME: {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "JWT",
        "description": (
            "AUTH_MODE=jwt only: the token's `sub` is the user id. Required unless anonymous "
            "callers are allowed (AUTH_ALLOW_ANONYMOUS); a token that is given but invalid or "
            "expired is always 401. Ignored with AUTH_MODE=gateway."
        ),
    }
}
# Optional: anonymous callers (no token at all) are served where the deployment allows them.
OPTIONAL_BEARER: list[dict[str, list[str]]] = [{}, {BEARER_SCHEME: []}]


def user_id_header(who: str) -> dict[str, Any]:
    return {
        "name": "X-User-ID",
        "in": "header",
        "required": False,
        "description": (
            f"{who}: printable, at most {MAX_USER_ID_CHARS} characters, set by the gateway "
            "(AUTH_MODE=gateway; ignored with AUTH_MODE=jwt)."
        ),
        "schema": {"type": "string", "maxLength": MAX_USER_ID_CHARS},
    }


SCAN_OPENAPI_EXTRA: dict[str, Any] = {
    "parameters": [
        user_id_header(
            "Who scans. Without it the scan is anonymous (a reward match but no ownership row; "
            "the per-user limit applies to the client address; its token comes in `X-Scan-Token`)"
        ),
        {
            "name": "Idempotency-Key",
            "in": "header",
            "required": False,
            "description": (
                f"1-{MAX_IDEMPOTENCY_KEY_CHARS} printable characters. A POST repeating an earlier one "
                "of the same caller with the same key and the same image and `user_input` (within "
                "IDEMPOTENCY_TTL_S) answers with that scan's stream (`Idempotent-Replayed: true`) "
                "instead of starting another; the same key with a different request is 422 "
                "`IDEMPOTENCY_KEY_REUSED`."
            ),
            "schema": {"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY_CHARS},
        },
    ],
    "security": OPTIONAL_BEARER,
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": REF + "ScanRequest"}},
            "multipart/form-data": {
                "schema": {"$ref": REF + "ScanUpload"},
                "encoding": {"image": {"contentType": IMAGE_TYPES.replace(" ", "")}},
            },
        },
    },
}


def scan_responses() -> dict[int | str, dict[str, Any]]:
    return {200: scan_stream_response(headers=_NEW_SCAN_HEADERS), **scan_error_responses()}


# --- scans as resources -------------------------------------------------------------------


class ScanStatus(BaseModel):
    """A scan's state; once it has ended, its terminal event's data, exactly as streamed."""

    job_id: UUID
    status: Literal["running", "completed", "failed", "cancelled"]
    created_at: datetime
    finished_at: datetime | None
    result: DoneEvent | SkipJsonSchema[None] = Field(
        default=None, description="A completed scan's `done` event data."
    )
    error: ErrorEvent | SkipJsonSchema[None] = Field(
        default=None,
        description=(
            "A failed or cancelled scan's `error` event data (absent for a scan whose process "
            "died: `failed` with no event)."
        ),
    )


class CancelAccepted(BaseModel):
    """The scan is being cancelled; its stream ends with an `error` event `CANCELLED`."""

    job_id: UUID
    status: Literal["cancelling"]


class OwnedCharacter(Character):
    acquired_at: datetime
    scan_id: UUID = Field(description="The scan that earned it.")


class CharacterCollection(BaseModel):
    """The caller's characters, the most recently acquired first."""

    characters: list[OwnedCharacter]


_JOB_ID = {
    "name": "job_id",
    "in": "path",
    "required": True,
    "description": "The scan's id (`X-Scan-Id`, the events' `job_id`).",
    "schema": {"type": "string", "format": "uuid"},
}

_READER_PARAMETERS: list[dict[str, Any]] = [
    _JOB_ID,
    user_id_header("Who reads: the user who created the scan"),
    {
        "name": "X-Scan-Token",
        "in": "header",
        "required": False,
        "description": "An anonymous scan's capability token (its POST's `X-Scan-Token`).",
        "schema": {"type": "string"},
    },
    {
        "name": "token",
        "in": "query",
        "required": False,
        "description": "The same as `X-Scan-Token`, for clients that cannot set headers (EventSource).",
        "schema": {"type": "string"},
    },
]

# Same answer for a scan that does not exist and one that is not the caller's.
_NOTHING_CHANGED = "Refused; nothing changed."
_READ_FAILED = "The scan could not be read: a bug, or a database failure."

_OWNERSHIP = (
    "Only its owner sees a scan: the user who created it, or for an anonymous scan whoever "
    "presents its token (`X-Scan-Token` header or `token` parameter); anyone else gets 404 "
    "`SCAN_NOT_FOUND`, as for a scan that does not exist."
)

SCAN_STATUS_DESCRIPTION = f"""\
A scan's status, and once it has ended its result (`result`: the `done` event's data) or
failure (`error`: the `error` event's data), exactly as they were streamed.

{_OWNERSHIP}"""

SCAN_STATUS_OPENAPI_EXTRA: dict[str, Any] = {"parameters": _READER_PARAMETERS, "security": OPTIONAL_BEARER}


def scan_status_responses() -> dict[int | str, dict[str, Any]]:
    return error_responses(SCAN_STATUS_ERRORS, refused=_NOTHING_CHANGED, unexpected=_READ_FAILED)


SCAN_EVENTS_DESCRIPTION = f"""\
A scan's events with `seq` greater than `Last-Event-ID` (or `after`; neither: all of them),
identical to those first sent, then live until its `done` or `error` event: how a client
that lost its connection resumes (a scan outlives its client by DISCONNECT_GRACE_S).
The events are those of `POST /api/v1/scan/classify/completion`.

A scan running on another replica is followed live through Redis when REDIS_URL is
set; otherwise, or while Redis cannot serve the position, 409 `SCAN_RUNNING_ELSEWHERE`.
{_OWNERSHIP}"""

SCAN_EVENTS_OPENAPI_EXTRA: dict[str, Any] = {
    "parameters": [
        *_READER_PARAMETERS,
        {
            "name": "after",
            "in": "query",
            "required": False,
            "description": "Send the events after this `seq` (it wins over `Last-Event-ID`).",
            "schema": {"type": "integer", "minimum": 0, "maximum": 999_999_999},
        },
        {
            "name": "Last-Event-ID",
            "in": "header",
            "required": False,
            "description": "The `id` of the last event received (what an EventSource sends on reconnecting).",
            "schema": {"type": "string", "pattern": "^[0-9]{1,9}$"},
        },
    ],
    "security": OPTIONAL_BEARER,
}


def scan_events_responses() -> dict[int | str, dict[str, Any]]:
    stream = scan_stream_response(
        "The scan's events from the requested position on, as in `POST /api/v1/scan/classify/completion`.\n\n"
        + SCAN_STREAM_DESCRIPTION
    )
    past_the_end = {
        "description": "The scan has finished and nothing follows the requested position (e.g. an "
        "EventSource reconnecting after `done` with its id): no content, and EventSource stops reconnecting."
    }
    return {
        200: stream,
        204: past_the_end,
        **error_responses(SCAN_EVENTS_ERRORS, refused=_NOTHING_CHANGED, unexpected=_READ_FAILED),
    }


CANCEL_SCAN_DESCRIPTION = f"""\
Cancel a running scan: 202 at once; its stream then ends with an `error` event `CANCELLED`
and its status becomes `cancelled`. 409 `SCAN_FINISHED` if it has already ended, 409
`SCAN_RUNNING_ELSEWHERE` if another replica runs it. {_OWNERSHIP}"""

CANCEL_SCAN_OPENAPI_EXTRA: dict[str, Any] = {"parameters": _READER_PARAMETERS, "security": OPTIONAL_BEARER}


def cancel_scan_responses() -> dict[int | str, dict[str, Any]]:
    return error_responses(SCAN_CANCEL_ERRORS, refused=_NOTHING_CHANGED, unexpected=_READ_FAILED)


MY_CHARACTERS_DESCRIPTION = (
    "The characters the caller's scans have earned, the most recent first. Anonymous callers "
    "have no collection: 401 `UNAUTHENTICATED`."
)

MY_CHARACTERS_OPENAPI_EXTRA: dict[str, Any] = {
    "parameters": [user_id_header("Whose collection")],
    "security": OPTIONAL_BEARER,
}


def my_characters_responses() -> dict[int | str, dict[str, Any]]:
    return error_responses(CHARACTERS_ERRORS, refused="Refused.", unexpected="An unexpected failure (a bug).")


# --- other endpoints --------------------------------------------------------------------


class MiddleCategory(BaseModel):
    name: str
    description: str
    minors: list[str] = Field(description="Known items of this middle category.")


class MajorCategory(BaseModel):
    name: str
    description: str
    recyclable: bool
    middles: list[MiddleCategory]
    minors: list[str] = Field(description="Known items directly under this major category.")


class SituationTag(BaseModel):
    name: str
    tag_group: str
    description: str


class Categories(BaseModel):
    """The taxonomy vision classifies into."""

    majors: list[MajorCategory]
    situation_tags: list[SituationTag]
    paths: list[str] = Field(description="The category paths vision may return.")
    path_separator: str


class Health(BaseModel):
    status: Literal["ok"]


class ReadinessChecks(BaseModel):
    accepting: str = Field(description='"yes", or "no (shutting down)" once the shutdown drain began.')
    database: str = Field(description='"ok", or "unreachable" (no answer within 1 s).')
    upstream: str = Field(description='"simulator" (the built-in OpenAI simulator) or "configured".')


class Readiness(BaseModel):
    ready: bool
    checks: ReadinessChecks


READYZ_DESCRIPTION = (
    "200 when this process accepts scans and the database answers within 1 s; 503 otherwise, "
    "and at once when the shutdown drain begins (the load balancer then sends scans elsewhere)."
)

READYZ_RESPONSES: dict[int | str, dict[str, Any]] = {
    503: {"model": Readiness, "description": "Not ready: shutting down, or the database does not answer."}
}

METRICS_DESCRIPTION = "Prometheus text exposition format (version 0.0.4)."

# --- the document --------------------------------------------------------------------------

_BODY_MODELS: list[type[BaseModel]] = [m for models in _STREAM_EVENTS.values() for m in models]

API_DESCRIPTION = """\
Photograph an item of waste; ecoscan tells you how to dispose of it (Korean household
waste sorting). `POST /api/v1/scan/classify/completion` streams each stage of a scan
over Server-Sent Events; `/api/v1/scan/{job_id}` reads a scan back (status, its events
from any point on, cancelling it). Every JSON error is `{"detail", "code"}` (`Error`)."""


def document_schemas(settings: Settings) -> dict[str, Any]:
    """The component schemas no route declares as a model."""
    _, top = models_json_schema([(m, "serialization") for m in _BODY_MODELS], ref_template=REF + "{model}")
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    schemas["ScanRequest"] = scan_request_schema(settings)
    schemas["ScanUpload"] = scan_upload_schema(settings)
    return schemas


def build_openapi(app: FastAPI, settings: Settings) -> dict[str, Any]:
    document = get_openapi(
        title=app.title,
        version=app.version,
        openapi_version=app.openapi_version,
        description=API_DESCRIPTION,
        routes=app.routes,
    )
    _merge_parameters(document)
    components = document.setdefault("components", {})
    components["securitySchemes"] = SECURITY_SCHEMES
    schemas = components.setdefault("schemas", {})
    for name, schema in document_schemas(settings).items():
        if name in schemas and schemas[name] != schema:
            raise RuntimeError(f"two different schemas named {name} in the OpenAPI document")
        schemas[name] = schema
    components["schemas"] = dict(sorted(schemas.items()))
    return document


def _merge_parameters(document: dict[str, Any]) -> None:
    """One parameter per name and location: a route's `openapi_extra` parameters are
    appended to those FastAPI derives from its signature (`job_id`); the later, written
    for the document, wins, in the place of the first."""
    for path_item in document.get("paths", {}).values():
        for operation in path_item.values():
            merged: dict[tuple[str, str], dict[str, Any]] = {}
            for parameter in operation.get("parameters", []):
                name = parameter["name"].lower() if parameter["in"] == "header" else parameter["name"]
                merged[(parameter["in"], name)] = parameter
            if merged:
                operation["parameters"] = list(merged.values())


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Make `app.openapi()` (and so `/openapi.json`) the document above."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
