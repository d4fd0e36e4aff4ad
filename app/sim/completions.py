"""``POST /v1/chat/completions`` as a raw ASGI app (the hot path: no framework per-chunk cost)."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

from starlette.types import Receive, Scope, Send

from app.sim.errors import QUOTA_BODY, SERVER_ERROR_BODY, InvalidRequest, error_body
from app.sim.generate import generate_content
from app.sim.latency import plan_stream
from app.sim.ratelimit import ORGANIZATION, Header, format_duration, retry_headers
from app.sim.request import ChatRequest, parse_request
from app.sim.state import SimState
from app.sim.streaming import DONE, ChunkEncoder, stream_events
from app.sim.tokens import split_tokens

# Completion tokens charged against TPM when the request sets no max_tokens
# (OpenAI reserves the possible output up front; a generous default makes unset
# max_tokens visibly expensive, as it is against the real API).
DEFAULT_MAX_TOKENS = 4096

_JSON = (b"content-type", b"application/json")
_SSE = (b"content-type", b"text/event-stream; charset=utf-8")
_COMMON = [(b"openai-organization", ORGANIZATION.encode()), (b"openai-version", b"2020-10-01")]


class ChatCompletions:
    """ASGI endpoint; all behaviour comes from the shared ``SimState``."""

    def __init__(self, state: SimState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stats = self.state.stats
        stats.inflight += 1
        try:
            await self._handle(receive, send)
        finally:
            stats.inflight -= 1

    async def _handle(self, receive: Receive, send: Send) -> None:
        state = self.state
        stats = state.stats
        raw = await _read_body(receive)
        stats.requests_total += 1
        headers: list[Header] = [(b"x-request-id", f"req_{secrets.token_hex(16)}".encode())]
        headers += _COMMON
        try:
            request = parse_request(raw)
            content = _content(request, state)
        except InvalidRequest as exc:
            await self._reply(send, 400, exc.body(), headers)
            return
        stats.by_kind[request.kind] = stats.by_kind.get(request.kind, 0) + 1
        refusal = self._refusal(request, headers)
        if refusal is not None:
            await self._reply(send, *refusal)
            return
        await self._complete(request, content, headers, receive, send)

    def _refusal(self, request: ChatRequest, headers: list[Header]) -> tuple[int, bytes, list[Header]] | None:
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
        # OpenAI: "your rate limit is calculated as the maximum of max_tokens and the
        # estimated number of tokens based on the character count of your request".
        cost = max(request.prompt_tokens, request.max_tokens or DEFAULT_MAX_TOKENS)
        denial, limit_headers = limiter.acquire(request.model, cost)
        headers += limit_headers
        if denial is not None:
            stats.rate_limited_total += 1
            body = _rate_limit_body(denial.message, denial.limit_type)
            return 429, body, headers + retry_headers(denial.retry_after_s)
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
        """The 200 path: sleep (or stream) the sampled latency, then the content."""
        state = self.state
        stats = state.stats
        config = state.config
        tokens = split_tokens(content)
        finish = "stop"
        if request.max_tokens is not None and len(tokens) > request.max_tokens:
            tokens = tokens[: request.max_tokens]
            content = "".join(tokens)
            finish = "length"
        latency = state.latency(request.kind)
        headers.append((b"openai-processing-ms", str(round(latency * 1000)).encode()))
        stats.count_status(200)
        stats.prompt_tokens += request.prompt_tokens
        completion_id = f"chatcmpl-{secrets.token_urlsafe(21)}"
        created = int(time.time())
        usage = _usage(request.prompt_tokens, len(tokens))
        if request.stream:
            encoder = ChunkEncoder(completion_id, created, request.model, request.include_usage)
            tail = encoder.finish(finish)
            if request.include_usage:
                tail += encoder.usage(usage)
            await stream_events(
                state=state,
                send=send,
                receive=receive,
                headers=[*headers, _SSE, (b"cache-control", b"no-cache")],
                encoder=encoder,
                tokens=tokens,
                tail=tail + DONE,
                plan=plan_stream(latency, config.first_token_fraction, len(tokens)),
                stall_s=config.stall_s if state.inject_stall() else None,
            )
            return
        if latency > 0:
            await asyncio.sleep(latency)
        stats.completion_tokens += len(tokens)
        body = _completion_body(completion_id, created, request, content, finish, usage)
        await _send(send, 200, body, headers)

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


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _completion_body(
    completion_id: str,
    created: int,
    request: ChatRequest,
    content: str,
    finish: str,
    usage: dict[str, Any],
) -> bytes:
    payload = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": request.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": usage,
        "system_fingerprint": "fp_sim",
    }
    return json.dumps(payload, ensure_ascii=False).encode()
