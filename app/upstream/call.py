"""One model call: what a stage wants (`ChatRequest`), how one deployment is asked for it
(`ChatCall`, made by its route: app/upstream/routes.py), what comes back (`ChatResult`),
and why an attempt failed (`AttemptFailed`, for the retry loop in app/upstream/client.py
to weigh)."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from app.upstream.profiles import CallShape


@dataclass(frozen=True)
class ChatRequest:
    """What a stage asks, whoever serves it: the model, its parameters, the token estimate
    and the image billing are the serving deployment's (`Route.shaped`)."""

    stage: str
    messages: list[dict[str, Any]]
    response_format: dict[str, Any] | None = None
    safety_identifier: str | None = None
    image_sizes: Mapping[str, tuple[int, int]] | None = None  # image URL -> (width, height)
    extra_prompt_tokens: int = 0  # what the prompt counts beyond the messages (the schema)

    @property
    def kind(self) -> str:
        """`image` or `text`: limiters count the two differently from our estimate, so
        what they charge is learned apart (app/limits/charge_learning.py)."""
        for message in self.messages:
            content = message.get("content")
            if isinstance(content, list) and any(
                isinstance(part, Mapping) and part.get("type") == "image_url" for part in content
            ):
                return "image"
        return "text"


@dataclass(frozen=True)
class ChatCall:
    """A request as one deployment is asked for it."""

    stage: str
    shape: CallShape  # this deployment's model, token cap, reasoning effort
    messages: list[dict[str, Any]]
    prompt_estimate: int
    response_format: dict[str, Any] | None = None
    safety_identifier: str | None = None
    upstream: str = ""  # the deployment's name
    reservation_tokens: int = 0  # what its provider's limiter counts at arrival, as learned
    limiter_estimate: int = 0  # the same by today's formula, before learning
    kind: str = "text"  # ChatRequest.kind

    @property
    def model(self) -> str:
        return self.shape.model


@dataclass
class ChatResult:
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None  # reasoning included
    reasoning_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt, served from OpenAI's prompt cache
    finish_reason: str | None = None
    refusal: str = ""
    attempts: int = 0
    queue_s: float = 0.0  # waiting for the stage gate and the budget, all attempts
    service_s: float = 0.0  # talking to the upstream, all attempts
    upstream: str | None = None  # the deployment that served it
    late_timeouts: int = 0  # timeouts forgiven because our loop was late (at most one)
    response_model: str | None = None  # the model the reply names (with its usage)
    first_chunk_at: float | None = None  # perf_counter at a streamed attempt's first chunk


# A reply's usage: prompt, completion (reasoning included), reasoning, cached tokens.
Usage = tuple[int, int, int, int]

# Called when a call that had streamed text starts again (elsewhere): the consumer drops
# what it showed of the failed attempt.
OnRestart = Callable[[], Awaitable[None]]

# Called with everything this attempt has received so far (a retry starts again from an
# empty text, so the consumer can tell a fresh attempt from a continuation); returns how
# long the consumer can do without more: the reader lets that much of the stream pile up.
OnText = Callable[[str], Awaitable[float]]


def safety_identifier(user_id: str | None) -> str | None:
    """What OpenAI's `safety_identifier` gets: a stable hash of the user id, never the id."""
    if user_id is None:
        return None
    return hashlib.sha256(b"ecoscan-user:" + user_id.encode("utf-8", "surrogatepass")).hexdigest()


class AttemptFailed(Exception):
    """One attempt failed; `error` is what the client sees if no retry remains, `retry`
    whether another attempt may help, `reason` the metric's and the log's word for it,
    `wait_s` how long the upstream asked us to wait (`retry-after`), if it did."""

    def __init__(self, error: Exception, *, retry: bool, reason: str, wait_s: float | None = None):
        super().__init__(reason)
        self.error = error
        self.retry = retry
        self.reason = reason
        self.wait_s = wait_s
