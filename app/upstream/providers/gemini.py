"""Gemini's OpenAI-compatible endpoint (`https://generativelanguage.googleapis.com/
v1beta/openai/`). No `x-ratelimit-*` headers; errors in Google's envelope (`{"error":
{"code", "message", "status", "details"}}`, sometimes inside a JSON array) with the wait
in `google.rpc.RetryInfo.retryDelay` rather than in `Retry-After`; a subset of JSON
Schema in `response_format`; fields it does not know are a 400. Its TPM limit counts
input tokens; an image is 258 tokens per 768-px tile."""

from __future__ import annotations

from collections.abc import Mapping

from app.upstream.providers.base import ErrorInfo, Provider
from app.upstream.tokens import ImageBilling

RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"
QUOTA_FAILURE = "type.googleapis.com/google.rpc.QuotaFailure"
GEMINI_IMAGES = ImageBilling("gemini_tiles")


class Gemini(Provider):
    name = "gemini"
    rate_headers = False
    # OpenAI-only fields Gemini's compatibility layer does not know: left out, not negotiated.
    unsupported_fields = frozenset(
        {"safety_identifier", "prompt_cache_key", "service_tier", "store", "metadata"}
    )
    unsupported_schema_keywords = frozenset({"additionalProperties"})

    def limiter_tokens(self, prompt_estimate: int, completion_cap: int) -> int:
        return prompt_estimate

    def limiter_settles(self, reserved: int, prompt_tokens: int, completion_tokens: int) -> int:
        """Input tokens, as counted once the reply says how many there were."""
        return prompt_tokens

    def image_billing(self, model: str) -> ImageBilling:
        return GEMINI_IMAGES

    def error_info(self, body: object) -> ErrorInfo:
        if isinstance(body, list) and body:  # sometimes wrapped in an array
            body = body[0]
        inner = body.get("error") if isinstance(body, dict) else None
        if not isinstance(inner, dict):
            return ErrorInfo()
        delay = limit = None
        for detail in inner.get("details") or ():
            if isinstance(detail, dict) and detail.get("@type") == RETRY_INFO:
                delay = _duration(detail.get("retryDelay"))
            if isinstance(detail, dict) and detail.get("@type") == QUOTA_FAILURE:
                limit = _quota_limit(detail.get("violations"))
        status = inner.get("status")
        return ErrorInfo(
            str(status) if status is not None else None,
            str(status) if status is not None else None,
            str(inner.get("message")) if inner.get("message") is not None else None,
            delay,
            limit,
        )

    def wait_hint(self, headers: Mapping[str, str], info: ErrorInfo) -> float | None:
        return info.retry_delay_s if info.retry_delay_s is not None else super().wait_hint(headers, info)


def _quota_limit(violations: object) -> str | None:
    """`tokens` or `requests`, by the quota metric a QuotaFailure names (an input-token
    count, or a request count); None when it names neither."""
    for violation in violations if isinstance(violations, list) else ():
        metric = str(violation.get("quotaMetric", "")) if isinstance(violation, dict) else ""
        if "token" in metric:
            return "tokens"
        if "request" in metric:
            return "requests"
    return None


def _duration(value: object) -> float | None:
    """A protobuf Duration as JSON: `"17s"`, `"1.5s"`."""
    if not isinstance(value, str) or not value.endswith("s"):
        return None
    try:
        seconds = float(value[:-1])
    except ValueError:
        return None
    return seconds if seconds >= 0 else None
