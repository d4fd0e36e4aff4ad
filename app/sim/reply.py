"""What a successful call answers: visible tokens, reasoning, finish reason, usage, body.

Kept apart from the ASGI handler so the accounting rules (the cap covers reasoning
first, faults cut the text) read in one place and are identical streamed or not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.sim.reasoning import split_cap
from app.sim.request import ChatRequest
from app.sim.tokens import split_tokens

REFUSAL_TEXT = "I'm sorry, but I can't help with that."


@dataclass(frozen=True, slots=True)
class Reply:
    """``field`` is ``content`` or ``refusal``; ``finish`` None means a truncated stream."""

    field: str
    tokens: list[str]
    finish: str | None
    reasoning: int

    @property
    def text(self) -> str:
        return "".join(self.tokens)

    @property
    def completion_tokens(self) -> int:
        return self.reasoning + len(self.tokens)


def plan_reply(content: str, fault: str | None, cap: int | None, drawn_reasoning: int) -> Reply:
    """Apply the cap (reasoning first, then visible tokens) and an injected fault.

    A cap that reasoning used up leaves the content empty with finish ``length``, as the
    real API does. ``content_filter`` and ``truncate`` keep the first half of the text.
    """
    field = "refusal" if fault == "refuse" else "content"
    tokens = split_tokens(REFUSAL_TEXT if fault == "refuse" else content)
    reasoning, room = split_cap(cap, drawn_reasoning)
    finish: str | None = "stop"
    if room is not None and len(tokens) > room:
        tokens = tokens[:room]
        finish = "length"
    if fault in ("content_filter", "truncate"):
        tokens = tokens[: len(tokens) // 2]
        finish = "content_filter" if fault == "content_filter" else None
    return Reply(field, tokens, finish, reasoning)


def usage(prompt: int, reply: Reply, cached: int = 0) -> dict[str, Any]:
    """``cached``: of the prompt, the tokens the prompt cache served (app/sim/prompt_cache.py)."""
    completion = reply.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": reply.reasoning,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def completion_body(
    completion_id: str, created: int, request: ChatRequest, reply: Reply, usage: dict[str, Any]
) -> bytes:
    """A non-streamed ``chat.completion``; a refusal has null content, like OpenAI's."""
    refused = reply.field == "refusal"
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if refused else reply.text,
        "refusal": reply.text if refused else None,
        "annotations": [],
    }
    payload = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": request.model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reply.finish}],
        "usage": usage,
        "service_tier": "default",
        "system_fingerprint": "fp_sim",
    }
    return json.dumps(payload, ensure_ascii=False).encode()
