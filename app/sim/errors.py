"""OpenAI-shaped error bodies (``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

import json

SERVER_ERROR_MESSAGE = "The server had an error while processing your request."
QUOTA_MESSAGE = (
    "You exceeded your current quota, please check your plan and billing details. "
    "For more information on this error, read the docs: "
    "https://platform.openai.com/docs/guides/error-codes/api-errors."
)


class InvalidRequest(Exception):
    """A malformed request; rendered as a 400 ``invalid_request_error``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> bytes:
        return error_body(self.message, "invalid_request_error", self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    payload = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return json.dumps(payload, ensure_ascii=False).encode()


SERVER_ERROR_BODY = error_body(SERVER_ERROR_MESSAGE, "server_error")
QUOTA_BODY = error_body(QUOTA_MESSAGE, "insufficient_quota", None, "insufficient_quota")
