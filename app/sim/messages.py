"""``messages`` and ``response_format``: validation, prompt-token count, content digest and
the prefix digests OpenAI's prompt caching matches (app/sim/prompt_cache.py)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from app.sim.errors import InvalidRequest
from app.sim.images import image_tokens
from app.sim.models import ModelFamily
from app.sim.prompt_cache import MIN_TOKENS, Part, prefix_digests, text_part
from app.sim.tokens import MESSAGE_OVERHEAD, REPLY_PRIMING, count_hangul

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
_DETAILS = {"low", "high", "auto"}


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the messages (and a schema) cost and which content they hold."""

    tokens: int
    has_image: bool
    format_type: str
    schema: dict[str, Any] | None
    digest: bytes
    # The last user message's text (what the simulator reads to answer in context) and
    # a digest of the schema alone (what it derives from a schema is cached by it).
    text: str = ""
    schema_key: bytes = b""
    prefixes: tuple[bytes, ...] = ()  # see app/sim/prompt_cache.py; empty under MIN_TOKENS
    image_key: bytes = b""  # a digest of the images alone: what a photo shows, whatever is asked
    hangul: int = 0  # Hangul syllables in its text (the limiter may count them its own way)


def read_prompt(body: dict[str, Any], family: ModelFamily, json_word_required: bool = True) -> Prompt:
    """Walk ``messages`` and ``response_format``; raise ``InvalidRequest`` like OpenAI.

    ``json_word_required``: OpenAI's rule that JSON mode needs "json" in the messages.
    """
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest(
            "Missing required parameter: 'messages'.", "messages", "missing_required_parameter"
        )
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "expected a non-empty array")
    hasher = hashlib.sha256()
    image_hasher = hashlib.sha256()
    tokens = REPLY_PRIMING
    has_image = mentions_json = False
    hangul = 0
    user_text = ""
    parts: list[Part] = []  # in reading order, for the prompt cache
    for i, message in enumerate(messages):
        role = _role(message, f"messages[{i}]")
        texts: list[str] = []
        hasher.update(b"\x00role\x00" + role.encode())
        tokens += MESSAGE_OVERHEAD
        parts.append(Part(MESSAGE_OVERHEAD, label=role))
        for j, (text, detail) in enumerate(_content_parts(message.get("content"), f"messages[{i}].content")):
            if detail is None:
                hasher.update(b"\x00text\x00" + text.encode())
                parts.append(text_part(text))
                tokens += parts[-1].tokens
                mentions_json = mentions_json or "json" in text.lower()
                hangul += count_hangul(text)
                texts.append(text)
                continue
            if family.images is None:
                raise InvalidRequest(
                    "Invalid content type. image_url is only supported by certain models.",
                    f"messages.[{i}].content.[{j}].type",
                )
            has_image = True
            hasher.update(b"\x00image\x00" + text.encode())
            image_hasher.update(text.encode())
            parts.append(Part(image_tokens(text, detail, family.images), label=f"{detail} {text}"))
            tokens += parts[-1].tokens
        if role == "user":
            user_text = "\n".join(texts)
    format_type, schema = _response_format(
        body.get("response_format"), mentions_json or not json_word_required
    )
    schema_key = b""
    if schema is not None:
        schema_text = json.dumps(schema, sort_keys=True, ensure_ascii=False)
        schema_key = hashlib.sha256(schema_text.encode()).digest()
        hasher.update(b"\x00schema\x00" + schema_key)
        # OpenAI injects the schema into the prompt, so it is billed; it comes first.
        parts.insert(0, text_part(schema_text))
        tokens += parts[0].tokens
        hangul += count_hangul(schema_text)
    parts.append(Part(REPLY_PRIMING, label="assistant priming"))
    prefixes = prefix_digests(parts) if tokens >= MIN_TOKENS else ()
    image_key = image_hasher.digest() if has_image else b""
    return Prompt(
        tokens,
        has_image,
        format_type,
        schema,
        hasher.digest(),
        user_text,
        schema_key,
        prefixes,
        hangul=hangul,
        image_key=image_key,
    )


def _role(message: Any, where: str) -> str:
    if not isinstance(message, dict):
        raise invalid(where, "expected an object")
    role = message.get("role")
    if role not in _ROLES:
        raise invalid(f"{where}.role", f"expected one of {sorted(_ROLES)}")
    return str(role)


def _content_parts(content: Any, where: str) -> list[tuple[str, str | None]]:
    """``(text, None)`` for text, ``(url, detail)`` for images."""
    if content is None:
        return []
    if isinstance(content, str):
        return [(content, None)]
    if not isinstance(content, list):
        raise invalid(where, "expected a string or an array of content parts")
    return [_content_part(part, f"{where}[{j}]") for j, part in enumerate(content)]


def _content_part(part: Any, at: str) -> tuple[str, str | None]:
    if not isinstance(part, dict):
        raise invalid(at, "expected an object")
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{at}.text", "expected a string")
        return text, None
    if kind != "image_url":
        raise invalid(f"{at}.type", "expected 'text' or 'image_url'")
    image = part.get("image_url")
    if isinstance(image, str):
        image = {"url": image}
    if not isinstance(image, dict) or not isinstance(image.get("url"), str):
        raise invalid(f"{at}.image_url.url", "expected a string")
    detail = image.get("detail", "auto")
    if detail not in _DETAILS:
        raise invalid(f"{at}.image_url.detail", "expected 'low', 'high' or 'auto'")
    return image["url"], str(detail)


def _response_format(value: Any, mentions_json: bool) -> tuple[str, dict[str, Any] | None]:
    if value is None:
        return "text", None
    if not isinstance(value, dict):
        raise invalid("response_format", "expected an object")
    kind = value.get("type")
    if kind == "json_object" and not mentions_json:
        raise InvalidRequest(
            "'messages' must contain the word 'json' in some form, to use 'response_format' "
            "of type 'json_object'.",
            "messages",
        )
    if kind in ("text", "json_object"):
        return str(kind), None
    if kind != "json_schema":
        raise invalid("response_format.type", "expected 'text', 'json_object' or 'json_schema'")
    return "json_schema", _json_schema(value.get("json_schema"))


def _json_schema(spec: Any) -> dict[str, Any]:
    if not isinstance(spec, dict):
        raise _missing("response_format.json_schema")
    if not isinstance(spec.get("name"), str):
        raise _missing("response_format.json_schema.name")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise invalid("response_format.json_schema.schema", "expected an object")
    return schema


def _missing(param: str) -> InvalidRequest:
    return InvalidRequest(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def invalid(param: str, detail: str) -> InvalidRequest:
    return InvalidRequest(f"Invalid value for '{param}': {detail}.", param, "invalid_value")
