"""``POST /v1/chat/completions`` as a raw ASGI app (the hot path: no framework per-chunk cost)."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from starlette.types import Receive, Scope, Send

from app.sim.errors import QUOTA_BODY, SERVER_ERROR_BODY, InvalidRequest, error_body, missing_api_key
from app.sim.generate import generate_content, unenforced_content
from app.sim.latency import plan_stream
from app.sim.ratelimit import ORGANIZATION, Header, format_duration, retry_headers
from app.sim.reasoning import reasoning_tokens
from app.sim.reply import Reply, completion_body, plan_reply, usage
from app.sim.request import ChatRequest, decode_body, parse_request
from app.sim.state import SimState
from app.sim.streaming import DONE, ChunkEncoder, stream_events

# Completion tokens charged against TPM when the request sets no cap
# (OpenAI reserves the possible output up front; a generous default makes an unset
# max_completion_tokens visibly expensive, as it is against the real API).
DEFAULT_MAX_TOKENS = 4096

_FAULT_COUNTERS = {
    "refuse": "refusals_injected",
    "content_filter": "content_filters_injected",
    "truncate": "truncations_injected",
    "malformed": "malformed_injected",
}

_JSON = (b"content-type", b"application/json")
_SSE = (b"content-type", b"text/event-stream; charset=utf-8")
_COMMON = [(b"openai-organization", ORGANIZATION.encode()), (b"openai-version", b"2020-10-01")]


def charged_tokens(request: ChatRequest) -> int:
    """What the TPM limiter counts for ``request`` at arrival: prompt estimate + completion cap.

    Two readings exist. OpenAI's rate-limit guide says the limit "is calculated as the
    maximum of max_tokens and the estimated number of tokens based on the character count
    of your request"; Azure OpenAI's quota guide says the estimate *adds* the prompt text
    and ``max_tokens`` (and ``best_of``), and field reports on OpenAI's own limiter agree
    with the sum (an input estimate added to max_tokens). We charge the sum: it is the
    stricter reading, so a budget that never sees a 429 here never sees one under either.
    Nothing is given back when the reply is shorter than the cap.
    """
    return request.prompt_tokens + (request.cap or DEFAULT_MAX_TOKENS)


class ChatCompletions:
    """ASGI endpoint; all behaviour comes from the shared ``SimState``."""

    def __init__(self, state: SimState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stats = self.state.stats
        stats.inflight += 1
        try:
            await self._handle(scope, receive, send)
        finally:
            stats.inflight -= 1

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        stats = state.stats
        raw = await _read_body(receive)
        stats.requests_total += 1
        headers: list[Header] = [(b"x-request-id", f"req_{secrets.token_hex(16)}".encode())]
        headers += _COMMON
        try:
            if not _has_bearer_key(scope):
                raise missing_api_key()
            body = decode_body(raw)
            state.capture(body)
            request = parse_request(body)
            content = _content(request, state)
        except InvalidRequest as exc:
            await self._reply(send, exc.status, exc.body(), headers)
            return
        stats.by_kind[request.kind] = stats.by_kind.get(request.kind, 0) + 1
        rejection = self._rejection(request, headers)
        if rejection is not None:
            await self._reply(send, *rejection)
            return
        await self._complete(request, content, headers, receive, send)

    def _rejection(
        self, request: ChatRequest, headers: list[Header]
    ) -> tuple[int, bytes, list[Header]] | None:
        """Quota, forced rejection, rate limit or injected error, in OpenAI's order.

        Appends the rate-limit headers to ``headers`` when the buckets were consulted.
        """
        state = self.state
        stats = state.stats
        config = state.config
        limiter = state.limiter
        if config.quota_exhausted:
            stats.quota_rejected_total += 1
            return 429, QUOTA_BODY, headers + limiter.headers(request.model)
        if state.take_reject(request.kind):
            stats.rate_limited_total += 1
            wait_s = config.reject_retry_after_ms / 1000
            body = _rate_limit_body(
                f"Rate limit reached for {request.model} in organization {ORGANIZATION} on "
                f"requests per min (RPM): Limit {config.rpm}, Used {config.rpm}, Requested 1. "
                f"Please try again in {format_duration(wait_s)}.",
                "requests",
            )
            return 429, body, headers + limiter.headers(request.model) + retry_headers(wait_s)
        cost = charged_tokens(request)
        denial, limit_headers = limiter.acquire(request.model, cost)
        headers += limit_headers
        if denial is not None:
            stats.rate_limited_total += 1
            body = _rate_limit_body(denial.message, denial.limit_type)
            return 429, body, headers + retry_headers(denial.retry_after_s)
        stats.tokens_charged_total += cost  # what the TPM limit counted
        if state.inject_error(request.kind):
            stats.errors_injected_total += 1
            return config.error_status, SERVER_ERROR_BODY, headers
        return None

    async def _complete(
        self,
        request: ChatRequest,
        content: str,
        headers: list[Header],
        receive: Receive,
        send: Send,
    ) -> None:
        """The 200 path: sleep (or stream) the sampled latency, then the reply."""
        state = self.state
        stats = state.stats
        config = state.config
        reply = self._plan(request, content)
        latency = state.latency(request.kind)
        headers.append((b"openai-processing-ms", str(round(latency * 1000)).encode()))
        stats.count_status(200)
        stats.prompt_tokens += request.prompt_tokens
        cached = state.prompt_cache.cached_tokens(request.model, request.prompt_cache_key, request.prefixes)
        stats.cached_tokens += cached
        stats.reasoning_tokens += reply.reasoning
        # Visible tokens are counted as they go out (a cancelled stream sends fewer).
        stats.completion_tokens += reply.reasoning
        completion_id = f"chatcmpl-{secrets.token_urlsafe(21)}"
        created = int(time.time())
        totals = usage(request.prompt_tokens, reply, cached)
        if request.stream:
            encoder = ChunkEncoder(completion_id, created, request.model, request.include_usage, reply.field)
            await stream_events(
                state=state,
                send=send,
                receive=receive,
                headers=[*headers, _SSE, (b"cache-control", b"no-cache")],
                encoder=encoder,
                tokens=reply.tokens,
                tail=_stream_tail(encoder, reply, request.include_usage, totals),
                plan=plan_stream(latency, config.first_token_fraction, len(reply.tokens)),
                stall_s=config.stall_s if state.inject_stall() else None,
            )
            return
        if latency > 0:
            await asyncio.sleep(latency)
        stats.completion_tokens += len(reply.tokens)
        await _send(send, 200, completion_body(completion_id, created, request, reply, totals), headers)

    def _plan(self, request: ChatRequest, content: str) -> Reply:
        """Reasoning, the cap and at most one injected 200-path fault (counted in stats)."""
        state = self.state
        config = state.config
        schema_bound = request.format_type == "json_schema" and bool(request.schema)
        fault = state.take_reply_fault(request.kind, request.stream, schema_bound)
        if fault is not None:
            counter = _FAULT_COUNTERS[fault]
            setattr(state.stats, counter, getattr(state.stats, counter) + 1)
        if fault == "malformed":
            content = unenforced_content(request, config.text_tokens, config.seed)
        drawn = reasoning_tokens(request.digest, request.effort, config.seed, config.reasoning_scale)
        return plan_reply(content, fault, request.cap, drawn)

    async def _reply(self, send: Send, status: int, body: bytes, headers: list[Header]) -> None:
        self.state.stats.count_status(status)
        await _send(send, status, body, headers)


def _content(request: ChatRequest, state: SimState) -> str:
    config = state.config
    try:
        return generate_content(request, config.text_tokens, config.seed)
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
        raise InvalidRequest(
            f"Invalid schema for response_format: {exc}", "response_format", "invalid_value"
        ) from None


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _send(send: Send, status: int, body: bytes, headers: list[Header]) -> None:
    all_headers = [*headers, _JSON, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _rate_limit_body(message: str, limit_type: str) -> bytes:
    return error_body(message, limit_type, None, "rate_limit_exceeded")


def _stream_tail(encoder: ChunkEncoder, reply: Reply, include_usage: bool, totals: dict[str, Any]) -> bytes:
    """Finish chunk, usage chunk (when asked) and ``[DONE]``; nothing for a truncated stream."""
    if reply.finish is None:
        return b""
    tail = encoder.finish(reply.finish)
    if include_usage:
        tail += encoder.usage(totals)
    return tail + DONE


def _has_bearer_key(scope: Scope) -> bool:
    """Any non-empty key will do: the simulator has no accounts, only the header's shape."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, key = value.partition(b" ")
            return scheme.lower() == b"bearer" and bool(key.strip())
    return False
