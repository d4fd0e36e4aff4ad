"""Each upstream attempt as the OpenTelemetry GenAI conventions describe a model call: its
span (`chat {model}`, a client span, when tracing is on: app/runtime/tracing.py) and the
`gen_ai_client_*` Prometheus metrics (always: they cost a few label lookups a call).

What they carry: the provider, deployment, models, server, token counts, finish reason and
failure. Never the messages, the reply, the image or the user: nothing here reads them.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable
from typing import TypeVar
from urllib.parse import urlsplit

from app.runtime import tracing
from app.runtime.metrics import Metrics
from app.upstream.call import ChatCall, ChatResult, Usage
from app.upstream.providers.gemini import VERTEX_AI
from app.upstream.routes import Route

T = TypeVar("T")

OPERATION = "chat"
# `gen_ai.provider.name` by our provider name; an OpenAI-compatible server is none of theirs.
PROVIDER_NAMES = {"openai": "openai", "azure": "azure.ai.openai", "gemini": "gcp.gemini"}
OTHER_PROVIDER = "_OTHER"


# Gemini through Vertex AI (`auth = "vertex_ai"`) is its own provider in the conventions.
VERTEX_AI_PROVIDER = "gcp.vertex_ai"


def provider_name(route: Route) -> str:
    if route.provider.name == "gemini" and route.deployment.auth == VERTEX_AI:
        return VERTEX_AI_PROVIDER
    return PROVIDER_NAMES.get(route.provider.name, OTHER_PROVIDER)


def _where(route: Route) -> tuple[str, str, str, str]:
    """The labels every GenAI metric starts with."""
    return OPERATION, provider_name(route), route.name, route.model


@functools.lru_cache(maxsize=64)
def _server(base_url: str) -> tuple[str, int]:
    parts = urlsplit(base_url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def traced(attempt: Awaitable[T], route: Route, call: ChatCall) -> Awaitable[T]:
    """`attempt` inside its span (as is, with tracing off)."""
    if not tracing.recording():  # off, or a trace not sampled
        return attempt
    return _in_span(attempt, route, call)


async def _in_span(attempt: Awaitable[T], route: Route, call: ChatCall) -> T:
    address, port = _server(route.deployment.base_url)
    attributes: dict[str, str | int] = {
        "gen_ai.operation.name": OPERATION,
        "gen_ai.provider.name": provider_name(route),
        "gen_ai.request.model": call.model,
        "server.address": address,
        "server.port": port,
        "ecoscan.deployment": route.name,
        "ecoscan.stage": call.stage,
    }
    with tracing.span(f"{OPERATION} {call.model}", attributes, client=True):
        return await attempt


def waited(gate_s: float, budget_s: float) -> None:
    """The attempt's waits before it was sent, as events on its span."""
    if not tracing.recording():
        return
    tracing.event("gate_wait", {"ecoscan.wait_s": round(gate_s, 6)})
    tracing.event("budget_wait", {"ecoscan.wait_s": round(budget_s, 6)})


def used(metrics: Metrics, route: Route, usage: Usage, result: ChatResult) -> None:
    """A reply's usage: the token histogram, and the span's `gen_ai.usage.*`."""
    input_tokens, output_tokens, reasoning, cached = usage
    where = _where(route)
    metrics.genai_token_usage.labels(*where, "input").observe(input_tokens)
    metrics.genai_token_usage.labels(*where, "output").observe(output_tokens)
    if not tracing.recording():
        return
    tracing.attributes(
        {
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "gen_ai.usage.cache_read.input_tokens": cached,
            "gen_ai.usage.reasoning.output_tokens": reasoning,
            "gen_ai.response.model": result.response_model or route.model,
            "gen_ai.response.finish_reasons": [result.finish_reason] if result.finish_reason else [],
        }
    )


def ended(
    metrics: Metrics, route: Route, elapsed_s: float, error_type: str, result: ChatResult, sent_at: float
) -> None:
    """An attempt's end: its duration (`error_type` "" when it succeeded) and, streamed, the
    time its first chunk took (`sent_at`: perf_counter as it was sent)."""
    where = _where(route)
    metrics.genai_duration.labels(*where, error_type).observe(elapsed_s)
    if result.first_chunk_at is not None:
        metrics.genai_first_chunk.labels(*where).observe(result.first_chunk_at - sent_at)
