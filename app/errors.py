"""The one error tree. Every error a client can see is a subclass of `EcoscanError`
and carries its HTTP status (used before a stream starts), its stable `code`
(used in JSON bodies and in SSE `error` events) and whether retrying may help.

    EcoscanError
    ├── RequestRejected          client mistakes: 4xx JSON before any stream
    │   ├── ImageMissing, ImageInvalid, ImageTypeUnsupported, ImageTooLarge,
    │   │   ImageTooManyPixels, PayloadTooLarge, InvalidRequest, UserInputTooLong,
    │   │   ContentTypeUnsupported, BodyReadTimeout,
    │   │   ClientDisconnected (499: gone before its body was read),
    │   │   InvalidText, ContentEncodingUnsupported
    │   └── Unauthorized (401 + WWW-Authenticate), TokenInvalid, TokenExpired,
    │       GatewaySecretInvalid
    ├── Overloaded               admission refused (503 / 429 with Retry-After)
    │   ├── ServerBusy, UpstreamBudgetExhausted, UserOverLimit, FollowerLimit, CpuLaneSaturated,
    │   │   DatabaseUnavailable, UploadsAtCapacity, ClientUploadsAtCapacity,
    │   │   ServerShuttingDown
    │   └── UserRateLimited, UserQuotaExhausted (429: the caller's scans per minute / 24 h)
    └── ScanFailed               after the stream started: an SSE `error` event
        ├── UpstreamError, UpstreamRateLimited, UpstreamUnavailable, UpstreamQuotaExhausted, UpstreamRejected,
        │   UpstreamBadResponse, UpstreamTimeout, UpstreamTokenLimit, UpstreamRefused,
        │   UpstreamContentFiltered, StageTimeout, ScanDeadlineExceeded
        ├── ServerShutdown, ProcessLost
        └── DatabaseError, InternalError

Messages are written for the client; internal details go to the log only. Two more
codes come from the deploy kits' balancer, never from the service: SERVICE_UNAVAILABLE
(502/503) and GATEWAY_TIMEOUT (504), when no replica answers (docs/api.md).
"""

from __future__ import annotations

from typing import Any, ClassVar


class EcoscanError(Exception):
    status: ClassVar[int] = 500
    code: ClassVar[str] = "INTERNAL_ERROR"
    retryable: ClassVar[bool] = False
    # Refused with the request body half read: the response says `Connection: close`,
    # so the rest of that body is never parsed as a next request.
    close_connection: ClassVar[bool] = False
    default_message: ClassVar[str] = "Internal error."

    def __init__(self, message: str | None = None) -> None:
        self.message = message or self.default_message
        super().__init__(self.message)

    def to_json(self) -> dict[str, Any]:
        return {"detail": self.message, "code": self.code}

    def headers(self) -> dict[str, str]:
        """Response headers this error needs (a fresh dict, the caller may add to it)."""
        return {}


# --- client mistakes ---------------------------------------------------------------


class RequestRejected(EcoscanError):
    status = 400
    code = "INVALID_REQUEST"
    default_message = "The request is invalid."


class ImageMissing(RequestRejected):
    code = "IMAGE_MISSING"
    default_message = "No image: send JSON with image_url, or multipart with an 'image' file."


class ImageInvalid(RequestRejected):
    code = "IMAGE_INVALID"
    default_message = "The image could not be decoded (not an image, truncated or corrupt)."


class ImageTypeUnsupported(RequestRejected):
    status = 415
    code = "IMAGE_TYPE_UNSUPPORTED"
    default_message = "Unsupported image type: use JPEG, PNG, WebP or GIF."


class ImageTooLarge(RequestRejected):
    status = 413
    code = "IMAGE_TOO_LARGE"
    default_message = "The image is larger than the size limit."


class PayloadTooLarge(RequestRejected):
    status = 413
    code = "PAYLOAD_TOO_LARGE"
    close_connection = True
    default_message = "The request body is larger than the size limit."


class ImageTooManyPixels(RequestRejected):
    status = 413
    code = "IMAGE_TOO_MANY_PIXELS"
    default_message = "The image has more pixels than the limit."


class InvalidRequest(RequestRejected):
    status = 422
    code = "INVALID_REQUEST"


class UserInputTooLong(RequestRejected):
    status = 422
    code = "USER_INPUT_TOO_LONG"
    default_message = "user_input is too long."


class ImageUrlRejected(RequestRejected):
    """An `image_url` we will not hand to a model that fetches it (private hosts, userinfo...)."""

    status = 422
    code = "IMAGE_URL_REJECTED"
    default_message = "image_url must be a public https:// URL."


class ContentTypeUnsupported(RequestRejected):
    status = 415
    code = "CONTENT_TYPE_UNSUPPORTED"
    default_message = "Send application/json or multipart/form-data."


class NotFound(RequestRejected):
    status = 404
    code = "NOT_FOUND"
    default_message = "Not found."


class BodyReadTimeout(RequestRejected):
    status = 408
    code = "BODY_READ_TIMEOUT"
    close_connection = True
    default_message = "The request body arrived too slowly (see BODY_READ_TIMEOUT_S)."


class ClientDisconnected(RequestRejected):
    """The client went away while its request was being read: an ordinary event, logged
    in one line; the response (nginx's 499) is never seen by anyone."""

    status = 499
    code = "CLIENT_DISCONNECTED"
    default_message = "The client disconnected before the request was read."


class InvalidText(RequestRejected):
    """A text field that is not text: invalid UTF-8, NUL, a lone surrogate or a Unicode
    noncharacter. Refused here, never left for the database (or the SDK) to refuse."""

    status = 422
    code = "INVALID_TEXT"
    default_message = "user_input contains characters that are not text."


class ContentEncodingUnsupported(RequestRejected):
    """A compressed (or otherwise encoded) body: bodies are read as sent, identity only."""

    status = 415
    code = "CONTENT_ENCODING_UNSUPPORTED"
    default_message = "Content-Encoding is not supported: send the body uncompressed."


class ScanNotFound(NotFound):
    """No such scan, or not the caller's (the same answer: existence is not disclosed)."""

    code = "SCAN_NOT_FOUND"
    default_message = "No such scan."


class ScanConflict(RequestRejected):
    status = 409
    code = "SCAN_CONFLICT"


class ScanAlreadyFinished(ScanConflict):
    code = "SCAN_FINISHED"
    default_message = "The scan has already finished."


class ScanRunningElsewhere(ScanConflict):
    code = "SCAN_RUNNING_ELSEWHERE"
    default_message = "The scan runs on another replica; its events can be read once it has finished."


class ScanEventsGone(ScanConflict):
    status = 410
    code = "SCAN_EVENTS_UNAVAILABLE"
    default_message = (
        "The scan ended without a stored event log (its process was lost); read its status instead."
    )


class IdempotencyKeyReused(RequestRejected):
    status = 422
    code = "IDEMPOTENCY_KEY_REUSED"
    default_message = "This Idempotency-Key was used for a different request."


class Unauthorized(RequestRejected):
    """No acceptable identity: no bearer token where one is required (AUTH_MODE=jwt), or
    no X-User-ID when AUTH_ALLOW_ANONYMOUS is false. The challenge goes in WWW-Authenticate."""

    status = 401
    code = "UNAUTHENTICATED"
    default_message = "Authentication is required."
    challenge: ClassVar[str] = "Bearer"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": self.challenge}


class TokenInvalid(Unauthorized):
    """A bearer token was given but cannot be accepted: malformed, bad signature, an
    algorithm or key not allowed, wrong issuer or audience, not yet valid, no usable `sub`."""

    code = "TOKEN_INVALID"
    default_message = "The access token is invalid."
    challenge = 'Bearer error="invalid_token"'


class TokenExpired(TokenInvalid):
    code = "TOKEN_EXPIRED"
    default_message = "The access token has expired."
    challenge = 'Bearer error="invalid_token", error_description="The access token expired"'


class GatewaySecretInvalid(Unauthorized):
    """AUTH_GATEWAY_SECRET is set and a request names a user (X-User-ID) without the
    gateway's secret in X-Gateway-Secret: it did not come through the gateway."""

    code = "GATEWAY_SECRET_INVALID"
    default_message = "X-User-ID is only accepted from the gateway (X-Gateway-Secret missing or wrong)."


# --- admission -------------------------------------------------------------------


class Overloaded(EcoscanError):
    """Refused before the stream started; `retry_after_s` goes into `Retry-After`."""

    status = 503
    code = "SERVER_BUSY"
    retryable = True
    default_message = "The service is at capacity; retry later."

    def __init__(self, message: str | None = None, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServerBusy(Overloaded):
    pass


class UpstreamBudgetExhausted(Overloaded):
    code = "UPSTREAM_BUDGET_EXHAUSTED"
    default_message = "The OpenAI rate budget is spent for now; retry later."


class CpuLaneSaturated(Overloaded):
    code = "CPU_SATURATED"
    default_message = "Image processing is at capacity; retry later."


class UserOverLimit(Overloaded):
    status = 429
    code = "USER_CONCURRENCY_LIMIT"
    default_message = "Too many scans in flight for this user; wait for one to finish."


class UserRateLimited(Overloaded):
    """USER_SCAN_RATE_PER_MIN scans started in the last minute (app/limits/user_quota.py)."""

    status = 429
    code = "USER_RATE_LIMITED"
    default_message = "This user started too many scans in the last minute; retry after Retry-After."


class UserQuotaExhausted(Overloaded):
    """USER_DAILY_SCAN_QUOTA scans started in the last 24 hours (app/limits/user_quota.py)."""

    status = 429
    code = "USER_QUOTA_EXHAUSTED"
    default_message = "This user's scans for the last 24 hours are used up; retry after Retry-After."


class FollowerLimit(Overloaded):
    """Following scans of other replicas: this user, or this scan, holds its share of the
    process's Redis follower connections (app/scans/followers.py)."""

    status = 429
    code = "FOLLOWER_LIMIT"
    default_message = "Too many streams of scans running elsewhere are open; close one, then retry."


class DatabaseUnavailable(Overloaded):
    code = "DATABASE_UNAVAILABLE"
    default_message = "The database is unavailable; retry later."


class UploadsAtCapacity(Overloaded):
    code = "UPLOADS_AT_CAPACITY"
    close_connection = True
    default_message = "Too many uploads are being received at once; retry shortly."


class ClientUploadsAtCapacity(Overloaded):
    """One client's bodies being received already hold `BODY_BUFFER_MAX_BYTES_PER_CLIENT`:
    its stalled uploads cannot take everyone's room."""

    status = 429
    code = "CLIENT_UPLOADS_AT_CAPACITY"
    close_connection = True
    default_message = "Too many of your uploads are being received at once; finish one, then retry."


class ServerShuttingDown(Overloaded):
    code = "SERVER_SHUTTING_DOWN"
    default_message = "This server is shutting down; retry (another replica will take the scan)."


# --- failures after the stream started -----------------------------------------------


class ScanFailed(EcoscanError):
    code = "SCAN_FAILED"
    default_message = "The scan failed."

    def __init__(self, message: str | None = None, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        # When retrying may succeed again, if known: the `error` event's `retry_after`.
        self.retry_after_s = retry_after_s


class UpstreamError(ScanFailed):
    code = "UPSTREAM_ERROR"
    retryable = True
    default_message = "The AI service failed; retry later."


class UpstreamRateLimited(UpstreamError):
    code = "UPSTREAM_RATE_LIMITED"
    default_message = "The AI service is rate limiting us; retry later."


class UpstreamUnavailable(UpstreamError):
    code = "UPSTREAM_UNAVAILABLE"
    default_message = "No AI service can take the request now; retry later."


class UpstreamQuotaExhausted(ScanFailed):
    code = "UPSTREAM_QUOTA_EXHAUSTED"
    retryable = False
    default_message = "The AI service quota is exhausted."


class UpstreamRejected(ScanFailed):
    """The upstream refused the request itself (400/401/403/404): retrying cannot help."""

    code = "UPSTREAM_REJECTED"
    default_message = "The AI service rejected the request."


class UpstreamBadResponse(UpstreamError):
    code = "UPSTREAM_BAD_RESPONSE"
    default_message = "The AI service returned an unusable response."


class UpstreamTimeout(UpstreamError):
    code = "UPSTREAM_TIMEOUT"
    default_message = "The AI service did not answer in time."


class UpstreamTokenLimit(ScanFailed):
    """The reply hit its completion cap (`finish_reason: length`); with a reasoning model,
    usually all of it went on reasoning. Retrying with the same cap will not help."""

    code = "UPSTREAM_TOKEN_LIMIT"
    default_message = "The AI reply was cut off at its token limit."


class UpstreamRefused(ScanFailed):
    """The model declined to answer (`refusal`); the refusal text is the message."""

    code = "UPSTREAM_REFUSED"
    default_message = "The AI model declined to answer."


class UpstreamContentFiltered(ScanFailed):
    code = "UPSTREAM_CONTENT_FILTERED"
    default_message = "The AI service's content filter stopped the reply."


class StageTimeout(ScanFailed):
    code = "STAGE_TIMEOUT"
    retryable = True
    default_message = "A stage took longer than its time limit."


class ScanDeadlineExceeded(ScanFailed):
    code = "SCAN_DEADLINE_EXCEEDED"
    retryable = True
    default_message = "The scan took longer than its deadline."


class ScanCancelled(ScanFailed):
    """The owner cancelled the scan (DELETE /api/v1/scan/{id})."""

    code = "CANCELLED"
    retryable = False
    default_message = "The scan was cancelled by its owner."


class ServerShutdown(ScanFailed):
    """The scan outlived the shutdown drain (`SHUTDOWN_DRAIN_S`)."""

    code = "SERVER_SHUTDOWN"
    retryable = True
    default_message = "The server shut down before the scan finished; retry it."


class ProcessLost(ScanFailed):
    """The process running the scan died; a later start-up sweep recorded it."""

    code = "PROCESS_LOST"
    retryable = True
    default_message = "The server running this scan stopped before it finished; retry it."


class DatabaseError(ScanFailed):
    code = "DATABASE_ERROR"
    retryable = True
    default_message = "A database operation failed."


class InternalError(ScanFailed):
    code = "INTERNAL_ERROR"
    default_message = "Internal error."


def retryable_scan_codes() -> frozenset[str]:
    """The codes of the scan failures a retry may cure: an `Idempotency-Key` whose scan
    ended with one of them starts a new attempt instead of replaying that end."""
    found, todo = set(), [ScanFailed]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.retryable:
            found.add(cls.code)
    return frozenset(found)
