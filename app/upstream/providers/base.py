"""What differs between the providers a deployment can be, in one class a provider: where
the endpoint is, how it knows who calls (a key, a token: its `credential`), how its
limiter counts a request and bills an image, where an error says how long to wait, what
a request may carry. `Provider` itself is OpenAI's behaviour; each other provider's module
overrides what its provider does differently and registers itself (app/upstream/providers/)."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from app.limits.retry import retry_after_from_headers
from app.upstream.credentials import Credential, StaticHeaders
from app.upstream.tokens import ImageBilling

KEY = "key"


class Deployment(Protocol):
    """What a provider reads of a deployment (`Deployment` in app/upstream/deployments.py,
    which checks each against the registered providers: not imported here, so no cycle)."""

    @property
    def name(self) -> str: ...
    @property
    def base_url(self) -> str: ...
    @property
    def auth(self) -> str: ...
    @property
    def api_key_env(self) -> str | None: ...
    @property
    def api_key(self) -> str | None: ...
    @property
    def api_version(self) -> str | None: ...


@dataclass(frozen=True)
class ErrorInfo:
    """What an error body says, whatever its envelope."""

    code: str | None = None  # e.g. insufficient_quota, rate_limit_exceeded, RESOURCE_EXHAUSTED
    kind: str | None = None  # OpenAI's `type`, Google's `status`
    message: str | None = None
    retry_delay_s: float | None = None  # a wait the body states (Google's RetryInfo)
    # Which limit a 429 says ran out, `requests` or `tokens`, where it says (a token 429
    # tells the learned charge it was too low: app/limits/charge_learning.py).
    limit: str | None = None


class Provider:
    """OpenAI's Chat Completions, as OpenAI serves it."""

    name = "openai"
    # Whether its replies carry `x-ratelimit-*` headers the budget can learn from.
    rate_headers = True
    # Body fields it refuses outright (sent elsewhere, left out here without a call).
    unsupported_fields: frozenset[str] = frozenset()
    # JSON Schema keywords its `response_format` refuses (dropped from our schemas here).
    unsupported_schema_keywords: frozenset[str] = frozenset()
    # A deployment's `auth`: how it proves who calls; the first is the default. `key`: the
    # key in the variable `api_key_env` names.
    auths: tuple[str, ...] = (KEY,)
    # Whether a `key` deployment must name its key (a local server may take none).
    key_required = True
    # Whether a deployment of it may set `api_version` (Azure's classic layout).
    versioned = False

    def check(self, deployment: Deployment) -> str | None:
        """What is wrong with `deployment` for this provider, as `field: why` (None: nothing)."""
        d = deployment
        if d.auth not in self.auths:
            return f"auth: one of {', '.join(self.auths)} for provider {self.name!r}, got {d.auth!r}"
        if d.auth == KEY and d.api_key_env is None and self.key_required:
            return f"api_key_env: required for provider {self.name!r}"
        if d.auth != KEY and d.api_key_env is not None:
            return f"api_key_env: not used with auth {d.auth!r}"
        if d.api_version is not None and not self.versioned:
            return f"api_version: not for provider {self.name!r}"
        return None

    def chat_url(self, deployment: Deployment, model: str) -> str:
        return deployment.base_url.rstrip("/") + "/chat/completions"

    def credential(self, deployment: Deployment) -> Credential:
        """What its requests carry to prove who calls: by default its key, fixed."""
        return StaticHeaders(self.auth_headers(deployment))

    def auth_headers(self, deployment: Deployment) -> dict[str, str]:
        return {"Authorization": f"Bearer {deployment.api_key}"} if deployment.api_key else {}

    def limiter_tokens(self, prompt_estimate: int, completion_cap: int) -> int:
        """What its token limiter counts when the request arrives. OpenAI's rate-limit guide
        words it as the larger of the two; Azure's quota doc as their sum, which is also what
        field reports on OpenAI's limiter see. The sum is the reading a budget can trust:
        it never under-counts under either."""
        return prompt_estimate + completion_cap

    def limiter_settles(self, reserved: int, prompt_tokens: int, completion_tokens: int) -> int:
        """What its limiter counted in the end. OpenAI's gives nothing back: what it counted
        at arrival stays counted, however short the reply."""
        return reserved

    def image_billing(self, model: str) -> ImageBilling | None:
        """How it bills an image for `model`; None: the model profile's (OpenAI's table)."""
        return None

    def error_info(self, body: object) -> ErrorInfo:
        """OpenAI's envelope: `{"error": {"message", "type", "code", "param"}}`; inside a
        one-element array too, as some servers behind a `compatible` deployment send it."""
        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        inner = body.get("error", body) if isinstance(body, dict) else None
        if not isinstance(inner, dict):
            return ErrorInfo()
        kind = _text(inner.get("type"))
        limit = kind if kind in LIMITS else None
        return ErrorInfo(_text(inner.get("code")), kind, _text(inner.get("message")), limit=limit)

    def wait_hint(self, headers: Mapping[str, str], info: ErrorInfo) -> float | None:
        """How long the reply asks us to wait: `retry-after-ms`, then `retry-after`."""
        return retry_after_from_headers(headers)

    def refused_parameter(self, status: int, info: ErrorInfo) -> str | None:
        """The request field a 400 says this deployment does not take, if it names one:
        OpenAI's `param` is not kept in `ErrorInfo`, so the message is read (its wording
        names the parameter in quotes)."""
        if status != 400 or not info.message:
            return None
        return _named_parameter(info.message)


LIMITS = ("requests", "tokens")
_QUOTED = re.compile(r"['\"`]([A-Za-z_]+(?:\.[A-Za-z_]+)*)['\"`]")
# What a 400 about an optional parameter says, across providers' wordings.
_REFUSING = (
    "unsupported",
    "not supported",
    "unknown",
    "unrecognized",
    "unexpected",
    "invalid",
    "not allowed",
)


def installed(module: str) -> bool:
    """Whether `module` (dotted) can be imported: False, not ModuleNotFoundError, when its
    top-level package is missing too (find_spec imports the parents)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _named_parameter(message: str) -> str | None:
    lower = message.lower()
    if not any(word in lower for word in _REFUSING):
        return None
    found = _QUOTED.findall(message)
    return found[0] if found else None


def _text(value: object) -> str | None:
    return None if value is None else str(value)
