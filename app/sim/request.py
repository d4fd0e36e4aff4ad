"""Validation of a Chat Completions request body into a compact ``ChatRequest``.

The order of checks follows what the real API reports first: a body that is not JSON,
then unknown arguments, then the model, then the per-model parameter rules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.sim.errors import InvalidRequest, model_not_found
from app.sim.messages import read_prompt
from app.sim.models import ModelFamily, family_for
from app.sim.params import (
    check_choices,
    check_identifiers,
    check_known,
    check_sampling,
    reasoning_effort,
    stream_flags,
    token_cap,
)

_NOT_JSON = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
    "using your HTTP library correctly. The OpenAI API expects a JSON payload, but what was "
    "sent was not valid JSON.)"
)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """What the simulator needs from a request. ``digest`` seeds the generated content.

    ``cap`` is the completion-token cap (``max_completion_tokens`` or ``max_tokens``);
    ``effort`` is the effective reasoning effort (None for non-reasoning models).
    """

    model: str
    family: ModelFamily
    effort: str | None
    kind: str
    stream: bool
    include_usage: bool
    cap: int | None
    format_type: str
    schema: dict[str, Any] | None
    prompt_tokens: int
    digest: bytes
    text: str = ""  # the last user message's text
    schema_key: bytes = b""  # digest of the schema alone
    prefixes: tuple[bytes, ...] = ()  # the prompt cache's prefix digests (app/sim/prompt_cache.py)
    prompt_cache_key: str = ""
    deployment: str = ""  # Azure: the deployment the call named (its limits are its own)
    image_key: bytes = b""  # a digest of the images alone (what several items are drawn from)
    hangul: int = 0  # Hangul syllables in the prompt (see Flavor.charge)
    schema_name: str = ""  # response_format.json_schema.name: which of a client's calls this is


def decode_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body, or OpenAI's "could not parse" 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest(_NOT_JSON) from None
    if not isinstance(body, dict):
        raise InvalidRequest(_NOT_JSON)
    return body


def parse_request(body: dict[str, Any], deployment: tuple[str, str] | None = None) -> ChatRequest:
    """Validate a decoded body; raise ``InvalidRequest`` with OpenAI's status, param and code.

    ``deployment``: Azure's ``(deployment, model)``, already resolved from the URL or the
    body's ``model``; the reply then names the model and the limits are the deployment's.
    """
    check_known(body)
    if deployment is None:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("you must provide a model parameter", "model")
    else:
        model = deployment[1]
    family = family_for(model)
    if family is None:
        raise model_not_found(model)
    cap = token_cap(body, family)
    effort = reasoning_effort(body, family)
    check_sampling(body, family, effort)
    check_identifiers(body)
    check_choices(body)
    stream, include_usage = stream_flags(body)
    prompt = read_prompt(body, family)
    return ChatRequest(
        model=model,
        family=family,
        effort=effort,
        kind="vision" if prompt.has_image else "text",
        stream=stream,
        include_usage=include_usage,
        cap=cap,
        format_type=prompt.format_type,
        schema=prompt.schema,
        prompt_tokens=prompt.tokens,
        digest=prompt.digest,
        text=prompt.text,
        schema_key=prompt.schema_key,
        prefixes=prompt.prefixes,
        prompt_cache_key=body.get("prompt_cache_key") or "",
        schema_name=_schema_name(body),
        deployment=deployment[0] if deployment is not None else "",
        image_key=prompt.image_key,
        hangul=prompt.hangul,
    )


def _schema_name(body: dict[str, Any]) -> str:
    """The structured output's name (a checked body's), or "" for a call without one."""
    response_format = body.get("response_format")
    if not isinstance(response_format, dict) or response_format.get("type") != "json_schema":
        return ""
    name = (response_format.get("json_schema") or {}).get("name")
    return name if isinstance(name, str) else ""
