"""Top-level request parameters, checked per model family with OpenAI's real error bodies.

The simulator is a strict double: whatever the real API refuses for a model is refused
here the same way, so a client that works against the simulator works against OpenAI.
"""

from __future__ import annotations

from typing import Any

from app.sim.errors import (
    InvalidRequest,
    invalid_enum,
    invalid_type,
    out_of_range,
    quoted_list,
    string_too_long,
    unrecognized_argument,
    unsupported_parameter,
    unsupported_value,
)
from app.sim.models import EFFORT_VALUES, ModelFamily

# CreateChatCompletionRequest's properties in OpenAI's OpenAPI description.
KNOWN_PARAMS = frozenset(
    {
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "messages",
        "metadata",
        "modalities",
        "model",
        "moderation",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    }
)
SAFETY_IDENTIFIER_MAX = 64
_USE_COMPLETION_CAP = " Use 'max_completion_tokens' instead."
_ONLY_DEFAULT = "Only the default (1) value is supported."


def check_known(body: dict[str, Any]) -> None:
    """Any name outside the API's request schema is refused, as OpenAI does."""
    for name in body:
        if name not in KNOWN_PARAMS:
            raise unrecognized_argument(name)


def token_cap(body: dict[str, Any], family: ModelFamily) -> int | None:
    """The completion cap; reasoning models take only ``max_completion_tokens``."""
    given = [name for name in ("max_tokens", "max_completion_tokens") if body.get(name) is not None]
    for name in given:
        if name not in family.cap_params:
            raise unsupported_parameter(name, _USE_COMPLETION_CAP)
    if len(given) > 1:
        raise InvalidRequest(
            "Setting 'max_tokens' and 'max_completion_tokens' at the same time is not supported.",
            "max_tokens",
            "invalid_parameter_combination",
        )
    if not given:
        return None
    name = given[0]
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_type(name, "an integer", value)
    if value < 1:
        raise out_of_range(name, value, 1, None)
    return value


def reasoning_effort(body: dict[str, Any], family: ModelFamily) -> str | None:
    """The effective effort: the one asked for, else the family default (None: no reasoning)."""
    value = body.get("reasoning_effort")
    if value is None:
        return family.default_effort
    if not isinstance(value, str):
        raise invalid_type("reasoning_effort", "a string", value)
    if value not in EFFORT_VALUES:
        raise invalid_enum("reasoning_effort", value, EFFORT_VALUES)
    if not family.reasoning:
        raise unsupported_parameter("reasoning_effort")
    if value not in family.efforts:
        supported = f"Supported values are: {quoted_list(family.efforts)}."
        raise unsupported_value("reasoning_effort", value, supported)
    return value


def check_sampling(body: dict[str, Any], family: ModelFamily, effort: str | None) -> None:
    """temperature in [0, 2], top_p in [0, 1]; values other than 1 only where allowed."""
    for name, high in (("temperature", 2.0), ("top_p", 1.0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid_type(name, "a decimal", value)
        if not 0 <= value <= high:
            raise out_of_range(name, value, 0, high)
        if value != 1 and not family.sampling_allowed(effort):
            raise unsupported_value(name, value, _ONLY_DEFAULT)


def check_identifiers(body: dict[str, Any]) -> None:
    """``user``, ``prompt_cache_key`` and ``safety_identifier`` (at most 64 characters)."""
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise invalid_type(name, "a string", value)
    safety = body.get("safety_identifier")
    if isinstance(safety, str) and len(safety) > SAFETY_IDENTIFIER_MAX:
        raise string_too_long("safety_identifier", safety, SAFETY_IDENTIFIER_MAX)


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """``(stream, include_usage)``; stream_options without streaming is refused."""
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid_type("stream", "a boolean", stream)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise InvalidRequest(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options"
        )
    if not isinstance(options, dict):
        raise invalid_type("stream_options", "an object", options)
    return stream, options.get("include_usage") is True


def check_choices(body: dict[str, Any]) -> None:
    """``n`` must be 1: the simulator generates a single choice (a documented limitation)."""
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise InvalidRequest("Invalid value for 'n': the simulator only supports n=1.", "n", "invalid_value")
