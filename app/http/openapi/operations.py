"""What the route decorators in app/http/routes.py carry: descriptions, parameters,
security, responses and response models."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from pydantic import BaseModel, Field
from pydantic.json_schema import SkipJsonSchema

from app.http.openapi.common import REF
from app.http.openapi.errors import (
    CHARACTERS_ERRORS,
    SCAN_CANCEL_ERRORS,
    SCAN_EVENTS_ERRORS,
    SCAN_STATUS_ERRORS,
    error_responses,
    scan_error_responses,
)
from app.http.openapi.events import SCAN_STREAM_DESCRIPTION
from app.http.openapi.requests import IMAGE_TYPES
from app.intake.acceptance import MAX_IDEMPOTENCY_KEY_CHARS
from app.intake.identity import MAX_USER_ID_CHARS
from app.stages.reward import Character

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
    "X-Retry-Of": {
        "description": (
            "A new attempt under an `Idempotency-Key` whose scan ended with a retryable error: "
            "that scan's id (also the status's `retry_of`)."
        ),
        "required": False,
        "schema": {"type": "string", "format": "uuid"},
    },
    "X-Trace-Id": {
        "description": (
            "When traces are on (`OTEL_*`): the scan's trace id, 32 hex digits (also `done`'s "
            "`trace_id`); the client's `traceparent`, if sent, is its parent."
        ),
        "required": False,
        "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
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
                # One event, `itemSchema`, is the app's own: added by document.py.
                "schema": {"description": "The event stream, as text."},
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
                "instead of starting another, unless that scan ended with a retryable error: then "
                "the key starts a new attempt (`X-Retry-Of`); the same key with a different request "
                "is 422 `IDEMPOTENCY_KEY_REUSED`."
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


def _no_default(schema: dict[str, Any]) -> None:
    """Absent, not null: the schema says what the field is when it is there."""
    schema.pop("default", None)


def scan_status_model(done_event: type[BaseModel], error_event: type[BaseModel]) -> type[BaseModel]:
    """`ScanStatus`, with this app's terminal event schemas (events.py)."""

    class ScanStatus(BaseModel):
        """A scan's state; once it has ended, its terminal event's data, exactly as streamed."""

        job_id: UUID
        status: Literal["running", "completed", "failed", "cancelled"]
        created_at: datetime
        finished_at: datetime | None
        retry_of: UUID | SkipJsonSchema[None] = Field(
            default=None,
            description="The attempt this scan retries (same `Idempotency-Key`, after a retryable end).",
            json_schema_extra=_no_default,
        )
        result: done_event | SkipJsonSchema[None] = Field(  # type: ignore[valid-type]
            default=None,
            description="A completed scan's `done` event data.",
            json_schema_extra=_no_default,
        )
        error: error_event | SkipJsonSchema[None] = Field(  # type: ignore[valid-type]
            default=None,
            json_schema_extra=_no_default,
            description=(
                "A failed or cancelled scan's `error` event data (absent for a scan whose process "
                "died: `failed` with no event)."
            ),
        )

    return ScanStatus


# Its schema is the app's own (`scan_status_model`, added by document.py): referred to here.
SCAN_STATUS_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Successful Response",
        "content": {"application/json": {"schema": {"$ref": REF + "ScanStatus"}}},
    }
}


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
        "description": (
            "The same as `X-Scan-Token`, only for clients that cannot set headers (EventSource): "
            "a query string is written to proxies' access logs. Prefer the header."
        ),
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
    return SCAN_STATUS_RESPONSE | error_responses(
        SCAN_STATUS_ERRORS, refused=_NOTHING_CHANGED, unexpected=_READ_FAILED
    )


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
    upstreams: dict[str, str] = Field(
        description='Each deployment\'s breaker: "closed", "probing (why)", or "open for N s more (why)" / '
        '"out for N s more (why)" (taken out: a refused key, a missing deployment, an exhausted quota). '
        "Shown, not judged: readiness does not turn on them."
    )


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
