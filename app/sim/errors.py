"""OpenAI-shaped error bodies (``{"error": {"message", "type", "param", "code"}}``).

The constructors below reproduce the real API's wording and codes, since clients (and
our service's retry logic) branch on ``code`` and tests compare messages.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

SERVER_ERROR_MESSAGE = "The server had an error while processing your request."
QUOTA_MESSAGE = (
    "You exceeded your current quota, please check your plan and billing details. "
    "For more information on this error, read the docs: "
    "https://platform.openai.com/docs/guides/error-codes/api-errors."
)


class InvalidRequest(Exception):
    """A rejected request; rendered as ``status`` (400 unless said) ``invalid_request_error``."""

    def __init__(
        self, message: str, param: str | None = None, code: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status

    def body(self) -> bytes:
        return error_body(self.message, "invalid_request_error", self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    payload = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return json.dumps(payload, ensure_ascii=False).encode()


SERVER_ERROR_BODY = error_body(SERVER_ERROR_MESSAGE, "server_error")
QUOTA_BODY = error_body(QUOTA_MESSAGE, "insufficient_quota", None, "insufficient_quota")


def missing_api_key() -> InvalidRequest:
    """OpenAI's 401 for a request without `Authorization: Bearer <key>` (checked before the
    body is parsed)."""
    return InvalidRequest(NO_API_KEY_MESSAGE, status=401)


NO_API_KEY_MESSAGE = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or as the password field (with blank "
    "username) if you're accessing the API from your browser and are prompted for a username and "
    "password. You can obtain an API key from https://platform.openai.com/account/api-keys."
)


def model_not_found(model: str) -> InvalidRequest:
    message = f"The model `{model}` does not exist or you do not have access to it."
    return InvalidRequest(message, None, "model_not_found", status=404)


def unrecognized_argument(name: str) -> InvalidRequest:
    return InvalidRequest(f"Unrecognized request argument supplied: {name}")


def unsupported_parameter(param: str, hint: str = "") -> InvalidRequest:
    message = f"Unsupported parameter: '{param}' is not supported with this model.{hint}"
    return InvalidRequest(message, param, "unsupported_parameter")


def unsupported_value(param: str, value: object, supported: str) -> InvalidRequest:
    """``supported`` finishes the sentence, e.g. "Only the default (1) value is supported."."""
    message = f"Unsupported value: '{param}' does not support {_shown(value)} with this model. {supported}"
    return InvalidRequest(message, param, "unsupported_value")


def invalid_enum(param: str, value: object, allowed: Sequence[str]) -> InvalidRequest:
    message = f"Invalid value: {_shown(value)}. Supported values are: {quoted_list(allowed)}."
    return InvalidRequest(message, param, "invalid_value")


def invalid_type(param: str, expected: str, value: object) -> InvalidRequest:
    message = f"Invalid type for '{param}': expected {expected}, but got {json_kind(value)} instead."
    return InvalidRequest(message, param, "invalid_type")


def out_of_range(param: str, value: float, low: float | None, high: float | None) -> InvalidRequest:
    """OpenAI's bound errors: ``decimal_above_max_value``, ``integer_below_min_value``, ..."""
    kind = "integer" if isinstance(value, int) else "decimal"
    above = high is not None and value > high
    bound = high if above else low
    word, rel = ("above maximum", "<=") if above else ("below minimum", ">=")
    message = (
        f"Invalid '{param}': {kind} {word} value. Expected a value {rel} {bound:g}, "
        f"but got {value:g} instead."
    )
    code = f"{kind}_{'above_max' if above else 'below_min'}_value"
    return InvalidRequest(message, param, code)


def string_too_long(param: str, value: str, limit: int) -> InvalidRequest:
    message = (
        f"Invalid '{param}': string too long. Expected a string with maximum length {limit}, "
        f"but got a string with length {len(value)} instead."
    )
    return InvalidRequest(message, param, "string_above_max_length")


def quoted_list(values: Sequence[str]) -> str:
    """``'a', 'b', and 'c'`` as OpenAI lists supported values."""
    quoted = [f"'{v}'" for v in values]
    if len(quoted) <= 2:
        return " and ".join(quoted)
    return ", ".join(quoted[:-1]) + ", and " + quoted[-1]


def json_kind(value: object) -> str:
    """The article + JSON type name OpenAI uses in type errors (``a string``, ``an integer``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _shown(value: object) -> str:
    """Strings quoted, numbers and null bare, as OpenAI echoes an offending value."""
    return f"'{value}'" if isinstance(value, str) else json.dumps(value)
