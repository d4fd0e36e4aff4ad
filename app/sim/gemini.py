"""Gemini's OpenAI-compatible endpoint (``/v1beta/openai/chat/completions``): its request
rules and Google's error envelope.

What the endpoint does differently from OpenAI, and where we learnt it:

- Fields it does not know are a 400 listing every one of them, in Google's proto-parsing
  words (``Invalid JSON payload received. Unknown name "seed": Cannot find field.``) with a
  ``google.rpc.BadRequest`` detail, the whole envelope wrapped in a one-element JSON array
  (bodies quoted in public issue reports for ``seed``, ``frequency_penalty``, ``reasoning``,
  ``top_k``). The known set is the request message of Gemini's compatibility reference
  (ai.google.dev/api/compatibility: model, messages, stream, stream_options, tools,
  tool_choice, modalities, n, stop, max_completion_tokens, max_tokens, ...), the sampling
  and format fields its guide shows (temperature, top_p, response_format, reasoning_effort,
  audio) and ``extra_body`` (the guide's way to pass Gemini-only options). So
  ``safety_identifier``, ``prompt_cache_key``, ``service_tier``, ``store``, ``metadata``,
  ``seed``, ``user``, ``logprobs`` and the penalties are refused.
- ``response_format`` schemas go to Gemini's Schema object, "a select subset of an OpenAPI
  3.0 schema object": other keywords (``additionalProperties``, ``$ref``, ``$defs``,
  ``const``, ``oneOf``, ...) and a list-valued ``type`` are 400s naming the keyword and
  where it is (``generation_config.response_schema.properties[0].value``). Gemini has since
  added a JSON-Schema path (responseJsonSchema); ``schema_subset=false`` plays that one.
- The wait of a 429 is in the body (``google.rpc.RetryInfo.retryDelay``), not in a header;
  there are no ``x-ratelimit-*`` headers at all.
- The model may be named ``models/<id>``; an unknown one is Google's 404 NOT_FOUND.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from app.sim.errors import InvalidRequest
from app.sim.messages import read_prompt
from app.sim.models import ModelFamily, family_for
from app.sim.request import ChatRequest

KNOWN_PARAMS = frozenset(
    {
        "audio",
        "extra_body",
        "max_completion_tokens",
        "max_tokens",
        "messages",
        "modalities",
        "model",
        "n",
        "reasoning_effort",
        "response_format",
        "stop",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_p",
    }
)
# Gemini's Schema object (generativelanguage v1beta), the keywords response_format may use.
SCHEMA_KEYWORDS = frozenset(
    {
        "anyOf",
        "default",
        "description",
        "enum",
        "example",
        "format",
        "items",
        "maxItems",
        "maxLength",
        "maxProperties",
        "maximum",
        "minItems",
        "minLength",
        "minProperties",
        "minimum",
        "nullable",
        "pattern",
        "properties",
        "propertyOrdering",
        "required",
        "title",
        "type",
    }
)
SCHEMA_PATH = "generation_config.response_schema"
STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}
BAD_REQUEST = "type.googleapis.com/google.rpc.BadRequest"
_INT_FIELDS = ("max_completion_tokens", "max_tokens", "n")
_FLOAT_FIELDS = ("temperature", "top_p")


class GoogleError(Exception):
    """A Google API error: ``{"error": {"code", "message", "status", "details"}}``."""

    def __init__(self, code: int, message: str, details: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = list(details)

    def envelope(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "code": self.code,
            "message": self.message,
            "status": STATUS_NAMES.get(self.code, "UNKNOWN"),
        }
        if self.details:
            error["details"] = self.details
        return {"error": error}

    def body(self, wrap: bool) -> bytes:
        """The JSON body; ``wrap`` puts it in a one-element array, as the compat endpoint does."""
        envelope = self.envelope()
        return json.dumps([envelope] if wrap else envelope, ensure_ascii=False).encode()


def bad_request(violations: Sequence[tuple[str | None, str]]) -> GoogleError:
    """400 INVALID_ARGUMENT for ``(field, description)`` violations, all in one message."""
    field_violations: list[dict[str, str]] = []
    for field, description in violations:
        entry = {"field": field, "description": description} if field else {"description": description}
        field_violations.append(entry)
    message = "\n".join(description for _, description in violations)
    return GoogleError(400, message, [{"@type": BAD_REQUEST, "fieldViolations": field_violations}])


def from_invalid(exc: InvalidRequest) -> GoogleError:
    """One of the shared validators' errors (messages, images) in Google's envelope."""
    return GoogleError(exc.status if exc.status in STATUS_NAMES else 400, exc.message)


def model_not_found(name: str) -> GoogleError:
    return GoogleError(
        404,
        f"models/{name} is not found for API version v1beta, or is not supported for generateContent. "
        "Call ModelService.ListModels to see the list of available models and their supported methods.",
    )


def schema_violations(schema: Any, path: str = SCHEMA_PATH) -> list[tuple[str | None, str]]:
    """Keywords outside Gemini's Schema object, walked as Google reports them."""
    found: list[tuple[str | None, str]] = []
    if not isinstance(schema, dict):
        return found
    for key, value in schema.items():
        if key not in SCHEMA_KEYWORDS:
            found.append(
                (
                    path,
                    f"Invalid JSON payload received. Unknown name \"{key}\" at '{path}': Cannot find field.",
                )
            )
        elif key == "type" and isinstance(value, list):
            found.append(
                (
                    path,
                    f"Invalid JSON payload received. Unknown name \"type\" at '{path}': "
                    "Proto field is not repeating, cannot start list.",
                )
            )
    properties = schema.get("properties")
    if isinstance(properties, dict):
        for i, sub in enumerate(properties.values()):
            found += schema_violations(sub, f"{path}.properties[{i}].value")
    items = schema.get("items")
    if isinstance(items, dict):
        found += schema_violations(items, f"{path}.items")
    branches = schema.get("anyOf")
    if isinstance(branches, list):
        for i, sub in enumerate(branches):
            found += schema_violations(sub, f"{path}.any_of[{i}]")
    return found


def parse_gemini_request(body: dict[str, Any], schema_subset: bool) -> ChatRequest:
    """Validate a decoded body as Gemini's compat endpoint does; raise ``GoogleError``."""
    unknown = [name for name in body if name not in KNOWN_PARAMS]
    if unknown:
        raise bad_request(
            [
                (None, f'Invalid JSON payload received. Unknown name "{name}": Cannot find field.')
                for name in unknown
            ]
        )
    _check_types(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GoogleError(400, "Model name must be specified.")
    name = model.removeprefix("models/").removeprefix("google/")  # Vertex AI: publisher/model
    family = family_for(name, "gemini")
    if family is None:
        raise model_not_found(name)
    effort = _effort(body.get("reasoning_effort"), family, name)
    cap = body.get("max_completion_tokens")
    if cap is None:
        cap = body.get("max_tokens")
    if cap is not None and cap < 1:
        raise GoogleError(400, "max_output_tokens must be positive.")
    n = body.get("n")
    if n is not None and n != 1:
        raise GoogleError(400, "The simulator only supports n=1.")
    try:
        prompt = read_prompt(body, family, json_word_required=False)
    except InvalidRequest as exc:
        raise from_invalid(exc) from None
    if schema_subset and prompt.schema is not None:
        violations = schema_violations(prompt.schema)
        if violations:
            raise bad_request(violations)
    return ChatRequest(
        model=name,
        family=family,
        effort=effort,
        kind="vision" if prompt.has_image else "text",
        stream=body.get("stream") is True,
        include_usage=True,  # the compat endpoint puts usage on the last chunk regardless
        cap=cap,
        format_type=prompt.format_type,
        schema=prompt.schema,
        prompt_tokens=prompt.tokens,
        digest=prompt.digest,
        text=prompt.text,
        schema_key=prompt.schema_key,
        prefixes=(),  # no implicit-cache hits reported through the compat endpoint (assumed)
        image_key=prompt.image_key,
        hangul=prompt.hangul,
    )


def _check_types(body: dict[str, Any]) -> None:
    """Proto JSON parsing: a wrong scalar type is a 400 naming the field and proto type."""
    wrong: list[tuple[str | None, str]] = []
    for name in _INT_FIELDS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            wrong.append((name, f"Invalid value at '{name}' (TYPE_INT32), {json.dumps(value)}"))
    for name in _FLOAT_FIELDS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            wrong.append((name, f"Invalid value at '{name}' (TYPE_FLOAT), {json.dumps(value)}"))
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        wrong.append(("stream", f"Invalid value at 'stream' (TYPE_BOOL), {json.dumps(stream)}"))
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        wrong.append(
            ("reasoning_effort", f"Invalid value at 'reasoning_effort' (TYPE_STRING), {json.dumps(effort)}")
        )
    if wrong:
        raise bad_request(wrong)


def _effort(value: str | None, family: ModelFamily, name: str) -> str | None:
    """The thinking level: asked for, else the model's default (None: no thinking)."""
    if value is None:
        return family.default_effort
    if not family.reasoning:
        raise GoogleError(400, f"Thinking is not enabled for models/{name}")
    if value == "none" and "none" not in family.efforts:
        raise GoogleError(400, "Budget 0 is invalid. This model only works in thinking mode.")
    if value not in family.efforts:
        allowed = ", ".join(family.efforts)
        raise GoogleError(
            400, f"Invalid reasoning_effort '{value}' for models/{name}; expected one of: {allowed}."
        )
    return value
