"""The `Error` body, and which refusals each operation answers with: derived from the error
tree (app/errors.py), so a refusal added there is documented with it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from app.errors import (
    ClientDisconnected,
    DatabaseUnavailable,
    EcoscanError,
    FollowerLimit,
    GatewaySecretInvalid,
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

# --- errors ------------------------------------------------------------------------

# The scan endpoint refuses with every client mistake and admission refusal of the error
# tree but these: nobody reads a 499, and the scans-as-resources refusals belong to the
# endpoints that read, follow or cancel a scan (of them, a POST that repeats an earlier
# one with its `Idempotency-Key` can only meet `SCAN_RUNNING_ELSEWHERE` and `FOLLOWER_LIMIT`). Derived, so
# that a refusal added to the tree is documented with it.
_NOT_SCAN_REFUSALS: frozenset[type[EcoscanError]] = frozenset(
    {
        ClientDisconnected,
        NotFound,
        ScanNotFound,
        ScanConflict,
        ScanAlreadyFinished,
        ScanEventsGone,
    }
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
# expired bearer token (jwt mode), the JWKS keys unavailable (AUTH_JWKS_URL), and an
# X-User-ID without the gateway's secret (AUTH_GATEWAY_SECRET).
IDENTITY_REFUSALS: list[type[EcoscanError]] = [
    InvalidRequest,
    Unauthorized,
    TokenInvalid,
    TokenExpired,
    GatewaySecretInvalid,
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
    FollowerLimit,
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
