"""The providers the simulator plays (``SimConfig.flavor``), and what differs between them.

One ``Flavor`` per provider answers, for one simulated upstream: which URLs it serves,
how it checks the key, how it parses a request, which rate headers it sends, what its
error bodies look like and where a 429 puts the wait, what its TPM limiter counts, and
how a reply is shaped. Everything else (latency, generated content, faults) is shared.

openai (api.openai.com)
    ``POST /v1/chat/completions``, ``GET /v1/models``; ``Authorization: Bearer <key>``;
    six ``x-ratelimit-*`` headers; 429 with ``retry-after``/``retry-after-ms`` and
    ``{"error": {"message", "type", "param", "code"}}``. TPM: prompt + cap at arrival.

azure (``https://{resource}.openai.azure.com``)
    The v1 API, ``POST /openai/v1/chat/completions`` (``model`` names the deployment), and
    the classic ``POST /openai/deployments/{deployment}/chat/completions?api-version=...``
    (no api-version: 404 "Resource not found"). The key goes in ``api-key``; the v1 API
    also takes it as ``Authorization: Bearer`` (Microsoft's v1 guide uses the plain OpenAI
    client that way); on the classic path a bearer is an Entra token, refused. A missing
    or wrong key is 401 ``{"error": {"code": "401", "message": "Access denied ..."}}``. Only
    ``x-ratelimit-remaining-requests``/``-tokens``; a 429 says "Please retry after N
    seconds" and carries ``retry-after`` and ``retry-after-ms``. An unknown deployment is
    404 ``DeploymentNotFound``. Parameter errors and 5xx keep OpenAI's shape (Azure passes
    them through, with its support link in the 500). Streams start with a chunk of empty
    ``choices`` and ``prompt_filter_results``; every choice carries
    ``content_filter_results``. TPM (its quota guide): prompt + max_tokens at arrival.
    Limits are per deployment.

gemini (``https://generativelanguage.googleapis.com``)
    ``POST /v1beta/openai/chat/completions``, ``GET /v1beta/openai/models``;
    ``Authorization: Bearer <key>``. No rate headers. Errors are Google's envelope
    ``{"error": {"code", "message", "status", "details"}}`` in a one-element array; a 429
    has the wait in ``google.rpc.RetryInfo.retryDelay`` and no ``Retry-After``. Rules in
    app/sim/gemini.py. TPM counts input tokens only (the quota metric is
    ``generate_content_paid_tier_input_token_count``); images cost 258 tokens per tile.
"""

from __future__ import annotations

import json
import math
import secrets
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import unquote_plus

from app.sim.config import SimConfig, deployment_map
from app.sim.errors import (
    NO_API_KEY_MESSAGE,
    QUOTA_BODY,
    SERVER_ERROR_MESSAGE,
    InvalidRequest,
    error_body,
)
from app.sim.gemini import GoogleError, parse_gemini_request
from app.sim.issuer import token_left
from app.sim.models import family_for, listed_models
from app.sim.ratelimit import ORGANIZATION, Denial, Header, format_duration, retry_headers
from app.sim.reply import Reply, completion_body, usage
from app.sim.request import ChatRequest, decode_body, parse_request
from app.sim.streaming import (
    AZURE_CONTENT_FILTERED,
    AZURE_CONTENT_SAFE,
    AZURE_PROMPT_SAFE,
    AzureChunkEncoder,
    ChunkEncoder,
    GeminiChunkEncoder,
)

# Completion tokens charged against TPM when the request sets no cap (OpenAI and Azure
# reserve the possible output up front; a generous default makes an unset cap visibly
# expensive, as it is against the real APIs).
DEFAULT_MAX_TOKENS = 4096
_JSON = (b"content-type", b"application/json")
_OPENAI_COMMON = [(b"openai-organization", ORGANIZATION.encode()), (b"openai-version", b"2020-10-01")]


@dataclass(frozen=True, slots=True)
class Route:
    """What a request asks for: ``chat`` or ``models``; Azure's classic path names a deployment."""

    kind: str
    deployment: str | None = None
    api_version: str = ""  # Azure's classic path: the api-version it was called with


@dataclass(frozen=True, slots=True)
class Failure:
    """A finished error reply in the flavour's words."""

    status: int
    body: bytes
    headers: tuple[Header, ...] = ()


class Refused(Exception):
    """Raised while reading a request: reply with ``failure`` (already in the flavour's words)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.status)
        self.failure = failure


def header(scope_headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in scope_headers:
        if key == name:
            return bytes(value)
    return None


def _bearer(scope_headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key of ``Authorization: Bearer <key>`` (None: no such header, "" when empty)."""
    value = header(scope_headers, b"authorization")
    if value is None:
        return None
    scheme, _, key = value.partition(b" ")
    if scheme.lower() != b"bearer":
        return ""
    return key.strip().decode("latin-1")


def _key_ok(given: str | None, config: SimConfig) -> bool:
    """Any non-empty key unless ``api_key`` names the one; with ``auth`` ``token``, a token
    the token service issued that has not expired."""
    if not given:
        return False
    if config.auth == "token":
        left = token_left(given, config.token_secret)
        return left is not None and left > 0
    return not config.api_key or given == config.api_key


class Flavor:
    """OpenAI's behaviour; the other flavours override what differs."""

    name: ClassVar[str] = "openai"
    base_path: ClassVar[str] = "/v1"
    chat_path: ClassVar[str] = "/v1/chat/completions"
    models_path: ClassVar[str] = "/v1/models"
    header_style: ClassVar[str] = "openai"
    uses_prompt_cache: ClassVar[bool] = True

    # --- routing and the key ---------------------------------------------------------

    def route(self, method: str, path: str, query: bytes) -> Route | Failure:
        if path == self.chat_path:
            return _CHAT if method == "POST" else self.not_found(method, path, 405)
        if path == self.models_path:
            return _MODELS if method == "GET" else self.not_found(method, path, 405)
        return self.not_found(method, path)

    def not_found(self, method: str, path: str, status: int = 404) -> Failure:
        message = f"Invalid URL ({method} {path})"
        return Failure(status, error_body(message, "invalid_request_error"))

    def check_key(
        self, headers: list[tuple[bytes, bytes]], route: Route, config: SimConfig
    ) -> Failure | None:
        key = _bearer(headers)
        if not key:
            return Failure(401, error_body(NO_API_KEY_MESSAGE, "invalid_request_error"))
        if not _key_ok(key, config):
            shown = key[:3] + "*" * max(0, len(key) - 7) + key[-4:] if len(key) > 7 else key
            message = (
                f"Incorrect API key provided: {shown}. You can find your API key at "
                "https://platform.openai.com/account/api-keys."
            )
            return Failure(401, error_body(message, "invalid_request_error", None, "invalid_api_key"))
        return None

    # --- the request -----------------------------------------------------------------

    def decode(self, raw: bytes, config: SimConfig) -> dict[str, Any]:
        """The body's JSON object; raises ``Refused`` with the flavour's error."""
        try:
            return decode_body(raw)
        except InvalidRequest as exc:
            raise Refused(self.invalid(exc, config)) from None

    def parse(self, body: dict[str, Any], route: Route, config: SimConfig) -> ChatRequest:
        """The validated request; raises ``Refused`` with the flavour's error."""
        try:
            return parse_request(body)
        except InvalidRequest as exc:
            raise Refused(self.invalid(exc, config)) from None

    def invalid(self, exc: InvalidRequest, config: SimConfig) -> Failure:
        return Failure(exc.status, exc.body())

    def charge(self, request: ChatRequest, config: SimConfig) -> int:
        """What the TPM limiter counts for ``request`` at arrival: prompt estimate + cap,
        counted the way ``config`` says this limiter counts (``counted``).

        Two readings exist. OpenAI's rate-limit guide says the limit "is calculated as the
        maximum of max_tokens and the estimated number of tokens based on the character
        count of your request"; Azure OpenAI's quota guide says the estimate *adds* the
        prompt text and ``max_tokens`` (and ``best_of``), and field reports on OpenAI's own
        limiter agree with the sum. We charge the sum: it is the stricter reading, so a
        budget that never sees a 429 here never sees one under either. Nothing is given
        back when the reply is shorter than the cap.
        """
        return counted(request.prompt_tokens + (request.cap or DEFAULT_MAX_TOKENS), request, config)

    def limiter_key(self, request: ChatRequest) -> str:
        return request.model

    # --- headers and errors ------------------------------------------------------------

    def common_headers(self) -> list[Header]:
        return [(b"x-request-id", f"req_{secrets.token_hex(16)}".encode()), *_OPENAI_COMMON]

    def processing_headers(self, latency_s: float) -> list[Header]:
        return [(b"openai-processing-ms", str(round(latency_s * 1000)).encode())]

    def quota(self, request: ChatRequest, route: Route, config: SimConfig) -> Failure:
        return Failure(429, QUOTA_BODY)

    def forced_rate_limit(
        self, request: ChatRequest, route: Route, config: SimConfig, wait_s: float
    ) -> Failure:
        """``reject_next``: a 429 on requests, as if the RPM bucket were empty."""
        message = (
            f"Rate limit reached for {request.model} in organization {ORGANIZATION} on requests per min "
            f"(RPM): Limit {config.rpm}, Used {config.rpm}, Requested 1. "
            f"Please try again in {format_duration(wait_s)}."
        )
        return Failure(
            429, error_body(message, "requests", None, "rate_limit_exceeded"), tuple(retry_headers(wait_s))
        )

    def rate_limited(self, request: ChatRequest, route: Route, denial: Denial, config: SimConfig) -> Failure:
        body = error_body(denial.message, denial.limit_type, None, "rate_limit_exceeded")
        return Failure(429, body, tuple(retry_headers(denial.retry_after_s)))

    def server_error(self, status: int) -> bytes:
        return error_body(SERVER_ERROR_MESSAGE, "server_error")

    def unavailable(self) -> bytes:
        """The outage switch's 503."""
        return error_body("The engine is currently overloaded, please try again later.", "server_error")

    # --- the 200 path ----------------------------------------------------------------

    def models_body(self, config: SimConfig) -> bytes:
        data = [
            {"id": name, "object": "model", "created": 1_715_367_049, "owned_by": "system"}
            for name in listed_models()
        ]
        return json.dumps({"object": "list", "data": data}).encode()

    def usage(self, prompt: int, reply: Reply, cached: int) -> dict[str, Any]:
        return usage(prompt, reply, cached)

    def completion_body(
        self, completion_id: str, created: int, request: ChatRequest, reply: Reply, totals: dict[str, Any]
    ) -> bytes:
        return completion_body(completion_id, created, request, reply, totals)

    def encoder(self, completion_id: str, created: int, request: ChatRequest, reply: Reply) -> ChunkEncoder:
        return ChunkEncoder(completion_id, created, request.model, request.include_usage, reply.field)

    def completion_id(self) -> str:
        return f"chatcmpl-{secrets.token_urlsafe(21)}"


_CHAT = Route("chat")
_MODELS = Route("models")


class AzureFlavor(Flavor):
    name = "azure"
    base_path = "/openai/v1"
    chat_path = "/openai/v1/chat/completions"
    models_path = "/openai/v1/models"
    header_style = "azure"
    _DEPLOYMENTS = "/openai/deployments/"
    _CLASSIC_TAIL = "/chat/completions"

    def route(self, method: str, path: str, query: bytes) -> Route | Failure:
        if path.startswith(self._DEPLOYMENTS) and path.endswith(self._CLASSIC_TAIL):
            deployment = path[len(self._DEPLOYMENTS) : -len(self._CLASSIC_TAIL)]
            if not deployment or "/" in deployment or method != "POST":
                return self.not_found(method, path)
            api_version = _query_value(query, b"api-version")
            if not api_version:
                return self.not_found(method, path)
            return Route("chat", deployment, api_version)
        return super().route(method, path, query)

    def not_found(self, method: str, path: str, status: int = 404) -> Failure:
        return Failure(404, _azure_error("404", "Resource not found"))

    def check_key(
        self, headers: list[tuple[bytes, bytes]], route: Route, config: SimConfig
    ) -> Failure | None:
        key = header(headers, b"api-key")
        if key is not None and config.auth == "token":
            return Failure(403, _azure_error("AuthenticationTypeDisabled", _AZURE_KEYS_DISABLED))
        if key is not None:
            if _key_ok(key.decode("latin-1").strip(), config):
                return None
            return Failure(401, _azure_error("401", _AZURE_BAD_KEY))
        bearer = _bearer(headers)
        if bearer is None:
            return Failure(401, _azure_error("401", _AZURE_NO_KEY))
        if (route.deployment is None or config.auth == "token") and _key_ok(bearer, config):
            return None  # the v1 API takes the key as a bearer too; both take an Entra token
        return Failure(401, _azure_error("401", _AZURE_BAD_TOKEN))

    def parse(self, body: dict[str, Any], route: Route, config: SimConfig) -> ChatRequest:
        deployment = route.deployment
        if deployment is None:
            named = body.get("model")
            if not isinstance(named, str) or not named:
                missing = InvalidRequest("you must provide a model parameter", "model")
                raise Refused(self.invalid(missing, config))
            deployment = named
        model = resolve_deployment(deployment, config)
        if model is None:
            raise Refused(Failure(404, _azure_error("DeploymentNotFound", _AZURE_NO_DEPLOYMENT)))
        try:
            return parse_request(body, (deployment, model))
        except InvalidRequest as exc:
            raise Refused(self.invalid(exc, config)) from None

    def limiter_key(self, request: ChatRequest) -> str:
        return request.deployment or request.model

    def common_headers(self) -> list[Header]:
        request_id = str(uuid.uuid4()).encode()
        return [
            (b"apim-request-id", request_id),
            (b"x-request-id", request_id),
            (b"x-ms-region", b"Sim Central"),
        ]

    def processing_headers(self, latency_s: float) -> list[Header]:
        return []

    def quota(self, request: ChatRequest, route: Route, config: SimConfig) -> Failure:
        # Azure has no billing-quota error on this path; an exhausted tier reads like this.
        return self._throttled("token", 86_400.0, route.api_version or "v1")

    def forced_rate_limit(
        self, request: ChatRequest, route: Route, config: SimConfig, wait_s: float
    ) -> Failure:
        return self._throttled("call", wait_s, route.api_version or "v1")

    def rate_limited(self, request: ChatRequest, route: Route, denial: Denial, config: SimConfig) -> Failure:
        kind = "call" if denial.limit_type == "requests" else "token"
        return self._throttled(kind, denial.retry_after_s, route.api_version or "v1")

    def _throttled(self, kind: str, wait_s: float, api_version: str) -> Failure:
        seconds = max(1, math.ceil(wait_s))
        unit = "second" if seconds == 1 else "seconds"
        message = (
            f"Requests to the ChatCompletions_Create Operation under Azure OpenAI API version {api_version} "
            f"have exceeded {kind} rate limit of your current OpenAI S0 pricing tier. Please retry after "
            f"{seconds} {unit}. Please go here: https://aka.ms/oai/quotaincrease if you would like to "
            "further increase the default rate limit."
        )
        return Failure(429, _azure_error("429", message), tuple(retry_headers(wait_s)))

    def server_error(self, status: int) -> bytes:
        message = (
            "The server had an error while processing your request. Sorry about that! You can retry your "
            "request, or contact us through an Azure support request at: "
            "https://go.microsoft.com/fwlink/?linkid=2213926 if the error persists. "
            f"(Please include the request ID {uuid.uuid4()} in your message.)"
        )
        return error_body(message, "server_error")

    def unavailable(self) -> bytes:
        return _azure_error(
            "ServiceUnavailable",
            "The service is temporarily unable to process your request. Please try again later.",
        )

    def completion_body(
        self, completion_id: str, created: int, request: ChatRequest, reply: Reply, totals: dict[str, Any]
    ) -> bytes:
        payload = json.loads(completion_body(completion_id, created, request, reply, totals))
        del payload["service_tier"]
        payload["prompt_filter_results"] = [{"prompt_index": 0, "content_filter_results": AZURE_PROMPT_SAFE}]
        verdict = AZURE_CONTENT_FILTERED if reply.finish == "content_filter" else AZURE_CONTENT_SAFE
        payload["choices"][0]["content_filter_results"] = verdict
        return json.dumps(payload, ensure_ascii=False).encode()

    def encoder(self, completion_id: str, created: int, request: ChatRequest, reply: Reply) -> ChunkEncoder:
        return AzureChunkEncoder(completion_id, created, request.model, request.include_usage, reply.field)


class GeminiFlavor(Flavor):
    name = "gemini"
    base_path = "/v1beta/openai"
    chat_path = "/v1beta/openai/chat/completions"
    models_path = "/v1beta/openai/models"
    header_style = "none"
    uses_prompt_cache = False

    def route(self, method: str, path: str, query: bytes) -> Route | Failure:
        # Vertex AI's OpenAI-compatible endpoint:
        # /v1/projects/{project}/locations/{location}/endpoints/openapi/chat/completions
        parts = path.split("/")
        if (
            len(parts) == 10
            and parts[1:3] == ["v1", "projects"]
            and parts[4] == "locations"
            and parts[6:] == ["endpoints", "openapi", "chat", "completions"]
            and all(parts[3:6])
        ):
            return _CHAT if method == "POST" else self.not_found(method, path, 405)
        return super().route(method, path, query)

    def not_found(self, method: str, path: str, status: int = 404) -> Failure:
        return Failure(404, GoogleError(404, "Method not found.").body(False))

    def _error(self, error: GoogleError, config: SimConfig, headers: tuple[Header, ...] = ()) -> Failure:
        return Failure(error.code, error.body(config.error_array), headers)

    def check_key(
        self, headers: list[tuple[bytes, bytes]], route: Route, config: SimConfig
    ) -> Failure | None:
        key = _bearer(headers)
        if key is None:
            error = GoogleError(
                403,
                "Method doesn't allow unregistered callers (callers without established identity). "
                "Please use API Key or other form of API consumer identity to call this API.",
            )
            return self._error(error, config)
        if not key:
            return self._error(GoogleError(401, _GOOGLE_UNAUTHENTICATED), config)
        if config.auth == "token" and not _key_ok(key, config):
            left = token_left(key, config.token_secret)
            reason = "ACCESS_TOKEN_EXPIRED" if left is not None else "ACCESS_TOKEN_TYPE_UNSUPPORTED"
            info = {
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": reason,
                "domain": "googleapis.com",
            }
            return self._error(GoogleError(401, _GOOGLE_UNAUTHENTICATED, [info]), config)
        if not _key_ok(key, config):
            details: list[dict[str, Any]] = [
                {
                    "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": "API_KEY_INVALID",
                    "domain": "googleapis.com",
                    "metadata": {"service": "generativelanguage.googleapis.com"},
                },
                {
                    "@type": "type.googleapis.com/google.rpc.LocalizedMessage",
                    "locale": "en-US",
                    "message": "API key not valid. Please pass a valid API key.",
                },
            ]
            return self._error(
                GoogleError(400, "API key not valid. Please pass a valid API key.", details), config
            )
        return None

    def decode(self, raw: bytes, config: SimConfig) -> dict[str, Any]:
        try:
            return decode_body(raw)
        except InvalidRequest:
            error = GoogleError(400, "Invalid JSON payload received. Unexpected token.")
            raise Refused(self._error(error, config)) from None

    def parse(self, body: dict[str, Any], route: Route, config: SimConfig) -> ChatRequest:
        try:
            return parse_gemini_request(body, config.schema_subset)
        except GoogleError as exc:
            raise Refused(self._error(exc, config)) from None

    def invalid(self, exc: InvalidRequest, config: SimConfig) -> Failure:
        error = GoogleError(exc.status if exc.status in (400, 401, 404) else 400, exc.message)
        return self._error(error, config)

    def charge(self, request: ChatRequest, config: SimConfig) -> int:
        """Input tokens only: Gemini's TPM quota is an input-token count."""
        return counted(request.prompt_tokens, request, config)

    def common_headers(self) -> list[Header]:
        return []

    def processing_headers(self, latency_s: float) -> list[Header]:
        return [(b"server-timing", f"gfet4t7; dur={round(latency_s * 1000)}".encode())]

    def quota(self, request: ChatRequest, route: Route, config: SimConfig) -> Failure:
        return self._exhausted(
            request,
            config,
            "generate_requests_per_model_per_day",
            "GenerateRequestsPerDayPerProjectPerModel",
            config.rpm,
            3600.0,
        )

    def forced_rate_limit(
        self, request: ChatRequest, route: Route, config: SimConfig, wait_s: float
    ) -> Failure:
        return self._exhausted(
            request,
            config,
            "generate_requests_per_model",
            "GenerateRequestsPerMinutePerProjectPerModel",
            config.rpm,
            wait_s,
        )

    def rate_limited(self, request: ChatRequest, route: Route, denial: Denial, config: SimConfig) -> Failure:
        if denial.limit_type == "requests":
            metric, quota_id = "generate_requests_per_model", "GenerateRequestsPerMinutePerProjectPerModel"
        else:
            metric = "generate_content_paid_tier_input_token_count"
            quota_id = "GenerateContentPaidTierInputTokensPerModelPerMinute"
        return self._exhausted(request, config, metric, quota_id, denial.limit, denial.retry_after_s)

    def _exhausted(
        self, request: ChatRequest, config: SimConfig, metric: str, quota_id: str, limit: int, wait_s: float
    ) -> Failure:
        """429 RESOURCE_EXHAUSTED: QuotaFailure, Help and RetryInfo; the wait only in the body."""
        full_metric = f"generativelanguage.googleapis.com/{metric}"
        message = (
            "You exceeded your current quota, please check your plan and billing details. For more "
            "information on this error, head to: https://ai.google.dev/gemini-api/docs/rate-limits. To "
            "monitor your current usage, head to: https://ai.dev/rate-limit. \n"
            f"* Quota exceeded for metric: {full_metric}, limit: {limit}, model: {request.model}\n"
            f"Please retry in {max(0.0, wait_s):.9f}s."
        )
        details: list[dict[str, Any]] = [
            {
                "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                "violations": [
                    {
                        "quotaMetric": full_metric,
                        "quotaId": quota_id,
                        "quotaDimensions": {"location": "global", "model": request.model},
                        "quotaValue": str(limit),
                    }
                ],
            },
            {
                "@type": "type.googleapis.com/google.rpc.Help",
                "links": [
                    {
                        "description": "Learn more about Gemini API quotas",
                        "url": "https://ai.google.dev/gemini-api/docs/rate-limits",
                    }
                ],
            },
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": retry_delay(wait_s)},
        ]
        return self._error(GoogleError(429, message, details), config)

    def server_error(self, status: int) -> bytes:
        if status == 503:
            return self.unavailable()
        message = (
            "An internal error has occurred. Please retry or report in "
            "https://developers.generativeai.google/guide/troubleshooting"
        )
        return GoogleError(status, message).body(True)

    def unavailable(self) -> bytes:
        return GoogleError(503, "The model is overloaded. Please try again later.").body(True)

    def models_body(self, config: SimConfig) -> bytes:
        data = [
            {"id": f"models/{name}", "object": "model", "created": 0, "owned_by": "google"}
            for name in listed_models("gemini")
        ]
        return json.dumps({"object": "list", "data": data}).encode()

    def usage(self, prompt: int, reply: Reply, cached: int) -> dict[str, Any]:
        """``completion_tokens`` counts the visible reply only, ``total_tokens`` adds the
        thinking too (candidatesTokenCount / totalTokenCount); no token details."""
        visible = len(reply.tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": visible,
            "total_tokens": prompt + visible + reply.reasoning,
        }

    def completion_body(
        self, completion_id: str, created: int, request: ChatRequest, reply: Reply, totals: dict[str, Any]
    ) -> bytes:
        payload = {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": request.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply.text},
                    "finish_reason": reply.finish,
                }
            ],
            "usage": totals,
        }
        return json.dumps(payload, ensure_ascii=False).encode()

    def encoder(self, completion_id: str, created: int, request: ChatRequest, reply: Reply) -> ChunkEncoder:
        return GeminiChunkEncoder(completion_id, created, request.model, True)

    def completion_id(self) -> str:
        return secrets.token_urlsafe(18)


def counted(tokens: int, request: ChatRequest, config: SimConfig) -> int:
    """``tokens`` of the documented formula as this limiter counts them. No provider
    publishes its limiter's estimator (OpenAI's guesses from the characters without
    tokenizing, Azure's counts "prompt text and count" with max_tokens): ``charge_hangul``
    and ``charge_factor`` make it differ from ours the way a test needs."""
    hangul_extra = (config.charge_hangul - 1.0) * request.hangul
    return max(1, round((tokens + hangul_extra) * config.charge_factor))


def retry_delay(seconds: float) -> str:
    """``google.rpc.RetryInfo.retryDelay``: a protobuf Duration in whole seconds, as observed."""
    return f"{max(0, math.floor(seconds))}s"


def resolve_deployment(deployment: str, config: SimConfig) -> str | None:
    """Azure: the model behind ``deployment`` (a configured pair, else a model's own name)."""
    model = deployment_map(config).get(deployment)
    if model is None and family_for(deployment) is not None:
        model = deployment
    if model is None or family_for(model) is None:
        return None
    return model


def _query_value(query: bytes, name: bytes) -> str:
    for part in query.split(b"&"):
        key, _, value = part.partition(b"=")
        if key == name:
            return unquote_plus(value.decode("latin-1"))
    return ""


def _azure_error(code: str, message: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message}}).encode()


_AZURE_BAD_KEY = (
    "Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a valid "
    "key for an active subscription and use a correct regional API endpoint for your resource."
)
_AZURE_NO_KEY = (
    "Access denied due to missing subscription key. Make sure to include subscription key when making "
    "requests to an API."
)
_AZURE_BAD_TOKEN = (
    "Unauthorized. Access token is missing, invalid, audience is incorrect "
    "(https://cognitiveservices.azure.com), or have expired."
)
_AZURE_KEYS_DISABLED = "Key based authentication is disabled for this resource."
_AZURE_NO_DEPLOYMENT = (
    "The API deployment for this resource does not exist. If you created the deployment within the last "
    "5 minutes, please wait a moment and try again."
)
_GOOGLE_UNAUTHENTICATED = (
    "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other "
    "valid authentication credential. See https://developers.google.com/identity/sign-in/web/devconsole-project."
)

FLAVORS: dict[str, Flavor] = {"openai": Flavor(), "azure": AzureFlavor(), "gemini": GeminiFlavor()}


def flavor_of(config: SimConfig) -> Flavor:
    return FLAVORS[config.flavor]


def json_headers(body: bytes) -> list[Header]:
    return [_JSON, (b"content-length", str(len(body)).encode())]
