"""One OpenAI call as a stage sees it: what it asks (`ChatCall`), what comes back
(`ChatResult`), and why an attempt failed (`AttemptFailed`, for the retry loop in
app/upstream/client.py to weigh)."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from app.upstream.profiles import CallShape


@dataclass(frozen=True)
class ChatCall:
    stage: str
    shape: CallShape  # model, token cap, reasoning effort: fixed per stage at start-up
    messages: list[dict[str, Any]]
    prompt_estimate: int
    response_format: dict[str, Any] | None = None
    safety_identifier: str | None = None

    @property
    def model(self) -> str:
        return self.shape.model

    @property
    def reservation_tokens(self) -> int:
        return self.prompt_estimate + self.shape.completion_cap


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


# A reply's usage: prompt, completion (reasoning included), reasoning, cached tokens.
Usage = tuple[int, int, int, int]

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
