"""Validation of a Chat Completions request body into a compact ``ChatRequest``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from app.sim.errors import InvalidRequest
from app.sim.tokens import (
    MESSAGE_OVERHEAD,
    REPLY_PRIMING,
    image_tokens,
    prompt_text_tokens,
)

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
_DETAILS = {"low", "high", "auto"}
_NOT_JSON = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
    "using your HTTP library correctly. The OpenAI API expects a JSON payload, but what was "
    "sent was not valid JSON.)"
)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """What the simulator needs from a request. ``digest`` seeds the generated content."""

    model: str
    kind: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    format_type: str
    schema: dict[str, Any] | None
    prompt_tokens: int
    digest: bytes


def parse_request(raw: bytes) -> ChatRequest:
    """Validate ``raw`` JSON; raise ``InvalidRequest`` with OpenAI's param naming."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest(_NOT_JSON) from None
    if not isinstance(body, dict):
        raise InvalidRequest(_NOT_JSON)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("you must provide a model parameter", "model", None)
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest(
            "Missing required parameter: 'messages'.", "messages", "missing_required_parameter"
        )
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "expected a non-empty array")

    hasher = hashlib.sha256()
    prompt_tokens = REPLY_PRIMING
    has_image = False
    mentions_json = False
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _invalid(where, "expected an object")
        role = message.get("role")
        if role not in _ROLES:
            raise _invalid(f"{where}.role", f"expected one of {sorted(_ROLES)}")
        hasher.update(b"\x00role\x00" + str(role).encode())
        prompt_tokens += MESSAGE_OVERHEAD
        for text, image in _content_parts(message.get("content"), f"{where}.content"):
            if image is None:
                hasher.update(b"\x00text\x00" + text.encode())
                prompt_tokens += prompt_text_tokens(text)
                mentions_json = mentions_json or "json" in text.lower()
            else:
                has_image = True
                hasher.update(b"\x00image\x00" + text.encode())
                prompt_tokens += image_tokens(text, image)

    format_type, schema = _response_format(body.get("response_format"))
    if format_type == "json_object" and not mentions_json:
        raise InvalidRequest(
            "'messages' must contain the word 'json' in some form, to use 'response_format' "
            "of type 'json_object'.",
            "messages",
            None,
        )
    if schema is not None:
        schema_text = json.dumps(schema, sort_keys=True, ensure_ascii=False)
        hasher.update(b"\x00schema\x00" + schema_text.encode())
        # OpenAI injects the schema into the prompt, so it is billed.
        prompt_tokens += prompt_text_tokens(schema_text)

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _invalid("stream", "expected a boolean")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidRequest(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                "stream_options",
                None,
            )
        if not isinstance(options, dict):
            raise _invalid("stream_options", "expected an object")
        include_usage = options.get("include_usage") is True

    _check_number(body, "temperature", 0.0, 2.0)
    _check_number(body, "top_p", 0.0, 1.0)
    n = body.get("n")
    if n not in (None, 1):
        raise _invalid("n", "the simulator only supports n=1")
    return ChatRequest(
        model=model,
        kind="vision" if has_image else "text",
        stream=stream,
        include_usage=include_usage,
        max_tokens=_max_tokens(body),
        format_type=format_type,
        schema=schema,
        prompt_tokens=prompt_tokens,
        digest=hasher.digest(),
    )


def _content_parts(content: Any, where: str) -> list[tuple[str, str | None]]:
    """``(text, None)`` for text, ``(url, detail)`` for images."""
    if content is None:
        return []
    if isinstance(content, str):
        return [(content, None)]
    if not isinstance(content, list):
        raise _invalid(where, "expected a string or an array of content parts")
    parts: list[tuple[str, str | None]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise _invalid(at, "expected an object")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise _invalid(f"{at}.text", "expected a string")
            parts.append((text, None))
        elif kind == "image_url":
            image = part.get("image_url")
            if isinstance(image, str):
                image = {"url": image}
            if not isinstance(image, dict) or not isinstance(image.get("url"), str):
                raise _invalid(f"{at}.image_url.url", "expected a string")
            detail = image.get("detail", "auto")
            if detail not in _DETAILS:
                raise _invalid(f"{at}.image_url.detail", "expected 'low', 'high' or 'auto'")
            parts.append((image["url"], detail))
        else:
            raise _invalid(f"{at}.type", "expected 'text' or 'image_url'")
    return parts


def _response_format(value: Any) -> tuple[str, dict[str, Any] | None]:
    if value is None:
        return "text", None
    if not isinstance(value, dict):
        raise _invalid("response_format", "expected an object")
    kind = value.get("type")
    if kind in ("text", "json_object"):
        return str(kind), None
    if kind != "json_schema":
        raise _invalid("response_format.type", "expected 'text', 'json_object' or 'json_schema'")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(
            "Missing required parameter: 'response_format.json_schema'.",
            "response_format.json_schema",
            "missing_required_parameter",
        )
    if not isinstance(spec.get("name"), str):
        raise InvalidRequest(
            "Missing required parameter: 'response_format.json_schema.name'.",
            "response_format.json_schema.name",
            "missing_required_parameter",
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _invalid("response_format.json_schema.schema", "expected an object")
    return "json_schema", schema


def _max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _invalid(name, "expected an integer >= 1")
        return value
    return None


def _check_number(body: dict[str, Any], name: str, low: float, high: float) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise _invalid(name, f"expected a number between {low:g} and {high:g}")


def _invalid(param: str, detail: str) -> InvalidRequest:
    return InvalidRequest(f"Invalid value for '{param}': {detail}.", param, "invalid_value")
