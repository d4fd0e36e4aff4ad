"""Gemini's OpenAI-compatible endpoint: the Gemini API's (`https://generativelanguage.
googleapis.com/v1beta/openai/`, an API key as a bearer token), or Vertex AI's (`auth`
`vertex_ai`: `https://{location}-aiplatform.googleapis.com/v1/projects/{project}/
locations/{location}/endpoints/openapi`, models named `google/gemini-2.5-flash`, a Google
OAuth access token from Application Default Credentials, through google-auth: `pip install
ecoscan[google]`). No `x-ratelimit-*` headers; errors in Google's envelope (`{"error":
{"code", "message", "status", "details"}}`, sometimes inside a JSON array) with the wait
in `google.rpc.RetryInfo.retryDelay` rather than in `Retry-After`; a subset of JSON
Schema in `response_format`; fields it does not know are a 400. Its TPM limit counts
input tokens; an image is 258 tokens per 768-px tile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from datetime import UTC
from typing import Any

from app.upstream.credentials import TOKEN_WAIT_S, Credential, RefreshingToken, Token
from app.upstream.providers import register
from app.upstream.providers.base import KEY, Deployment, ErrorInfo, Provider, installed
from app.upstream.tokens import GeminiTiles, ImageBilling

RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"
QUOTA_FAILURE = "type.googleapis.com/google.rpc.QuotaFailure"
GEMINI_IMAGES = GeminiTiles()
VERTEX_AI = "vertex_ai"
# The scope Vertex AI's OpenAI-compatible endpoint takes a token for.
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
# A token whose service states no end (never, for an access token): taken as an hour's.
ASSUMED_LIFE_S = 3600.0


class Gemini(Provider):
    name = "gemini"
    rate_headers = False
    # OpenAI-only fields Gemini's compatibility layer does not know: left out, not negotiated.
    unsupported_fields = frozenset(
        {"safety_identifier", "prompt_cache_key", "service_tier", "store", "metadata"}
    )
    unsupported_schema_keywords = frozenset({"additionalProperties"})
    auths = (KEY, VERTEX_AI)

    def check(self, deployment: Deployment) -> str | None:
        if deployment.auth == VERTEX_AI and not installed("google.auth"):
            return "auth: vertex_ai needs google-auth (pip install 'ecoscan[google]')"
        return super().check(deployment)

    def credential(self, deployment: Deployment) -> Credential:
        if deployment.auth != VERTEX_AI:
            return super().credential(deployment)
        source = GoogleTokens()
        return RefreshingToken(deployment.name, source.fetch, close=source.aclose)

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


class GoogleTokens:
    """Access tokens from Application Default Credentials (GOOGLE_APPLICATION_CREDENTIALS,
    the metadata server, gcloud's login...). google-auth refreshes synchronously, over
    `requests`: in a thread, each HTTP wait bounded by `TOKEN_WAIT_S`, never on the loop."""

    def __init__(self) -> None:
        self._credentials: Any = None
        self._session: Any = None

    async def fetch(self) -> Token:
        return await asyncio.to_thread(self._refresh)

    def _refresh(self) -> Token:
        import google.auth
        import google.auth.transport.requests
        import requests

        if self._credentials is None:
            self._credentials, _ = google.auth.default(scopes=[CLOUD_PLATFORM])
            self._session = requests.Session()
        request = google.auth.transport.requests.Request(self._session)
        self._credentials.refresh(
            lambda *args, **kwargs: request(*args, **{**kwargs, "timeout": TOKEN_WAIT_S})
        )
        expiry = self._credentials.expiry  # naive UTC, as google-auth keeps it
        ends = expiry.replace(tzinfo=UTC).timestamp() if expiry is not None else time.time() + ASSUMED_LIFE_S
        return Token(str(self._credentials.token), ends)

    async def aclose(self) -> None:
        if self._session is not None:
            self._session.close()


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


register(Gemini())
