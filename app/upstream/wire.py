"""Chat Completions on the wire, as OpenAI documents it: the request body we send, and
what we read back — a whole reply, a streamed one (`data:` chunks up to `[DONE]`), an
error body, the `x-ratelimit-*` headers — and whether a reply that came is an answer.

A reply that is not JSON is a bad body, retried (a cut connection can do that). A reply
that is JSON but not of the documented shape (a piece of text that is not a string, a
choice that is not an object, a token count that is not a count) fails the call without
a retry: unlike a cut connection, the same server would answer the same way, and each
attempt is billed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

from app.errors import (
    UpstreamBadResponse,
    UpstreamContentFiltered,
    UpstreamError,
    UpstreamRefused,
    UpstreamTokenLimit,
)
from app.upstream.call import AttemptFailed, ChatCall, ChatResult, OnText, Usage

log = logging.getLogger(__name__)

# Refusal text is logged and shown to the client, but not without bound.
MAX_REFUSAL_CHARS = 300
# No model's context comes near this: a larger count is not a count.
MAX_TOKEN_COUNT = 100_000_000

# Waits up to that long, less if the stream ends first.
Pause = Callable[[float], Awaitable[None]]

# What reading a reply of the wrong shape raises; the reading code inside is small and
# only reads the reply, so these can mean nothing else.
_SHAPE_ERRORS = (AttributeError, TypeError, LookupError, ValueError)


def request_body(call: ChatCall, *, stream: bool) -> dict[str, Any]:
    """The request body, as wire-format JSON. tests/test_real_models.py checks the bodies
    the simulator received against the SDK's own `CompletionCreateParams` types."""
    body: dict[str, Any] = {"model": call.model, "messages": call.messages, **call.shape.params}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if call.response_format is not None:
        body["response_format"] = call.response_format
    if call.safety_identifier is not None:
        body["safety_identifier"] = call.safety_identifier
    return body


def read_completion(content: bytes, result: ChatResult) -> Usage | None:
    """A whole (not streamed) reply: its first choice and its usage."""
    try:
        completion = orjson.loads(content)
    except ValueError:
        raise AttemptFailed(UpstreamBadResponse(), retry=True, reason="bad_body") from None
    try:
        return _read_reply(completion, result)
    except _SHAPE_ERRORS:
        raise _bad_shape() from None


def _read_reply(completion: dict[str, Any], result: ChatResult) -> Usage | None:
    """The first choice's text, refusal and finish reason (into `result`) and the usage."""
    choices = completion.get("choices") or ()
    choice = choices[0] if choices else None
    if isinstance(choice, dict):
        message = choice.get("message") or {}
        text, refusal = message.get("content") or "", message.get("refusal") or ""
        result.text, result.refusal = _string(text), _string(refusal)
        result.finish_reason = _finish_reason(choice)
    usage = completion.get("usage")
    if isinstance(model := completion.get("model"), str):
        result.response_model = model
    return _usage_of(usage) if isinstance(usage, dict) else None


async def read_chunks(
    on_text: OnText, stream: AsyncIterator[bytes], pause: Pause, result: ChatResult
) -> Usage | None:
    """Consume a Chat Completions event stream; returns the usage if it was sent.

    Lines are split from raw bytes here rather than by a line reader (one wake-up per
    read, not per line), and the chunks of one read are parsed by one orjson call. A stream
    that ends without `[DONE]` or without a finish reason was cut off on the way: retried."""
    usage: Usage | None = None
    text = ""  # this attempt's: a retry starts again from nothing
    buffer = b""
    async for data in stream:
        if result.first_chunk_at is None:  # the GenAI metrics' time to first chunk
            result.first_chunk_at = time.perf_counter()
        *lines, buffer = (buffer + data).split(b"\n")
        payloads = [line[5:].strip() for line in lines if line.startswith(b"data:")]
        done = b"[DONE]" in payloads
        if done:
            del payloads[payloads.index(b"[DONE]") :]
        wait_s = 0.0
        if payloads:
            piece, usage = _read_batch(payloads, result, usage)
            if piece:
                text += piece
                result.text = text
                wait_s = await on_text(text)
        if done:
            if result.finish_reason is None:
                break
            return usage
        if wait_s > 0:
            await pause(wait_s)
    raise AttemptFailed(UpstreamError(), retry=True, reason="truncated")


def _read_batch(payloads: list[bytes], result: ChatResult, usage: Usage | None) -> tuple[str, Usage | None]:
    """Streamed chunks (`data:` payloads) as one JSON array: their text (refusal and finish
    reason go to `result`) and the last usage seen. Not JSON is a bad chunk (retried);
    JSON of another shape is `_bad_shape` (a piece that is not a string fails its `+=`)."""
    try:
        # One parse for all the chunks of a read, not one each.
        chunks = orjson.loads(b"[" + b",".join(payloads) + b"]")
    except ValueError:
        raise AttemptFailed(UpstreamBadResponse(), retry=True, reason="bad_chunk") from None
    text = ""
    try:
        for chunk in chunks:
            if type(chunk) is not dict:
                raise TypeError("a chunk is an object")
            if "error" in chunk:  # OpenAI reports some failures inside a started stream
                raise AttemptFailed(UpstreamError(), retry=True, reason="stream_error")
            if chunk.get("usage"):
                usage = _usage_of(chunk["usage"])
                if isinstance(model := chunk.get("model"), str):  # the usage chunk's: once a reply
                    result.response_model = model
            for choice in chunk.get("choices") or ():
                if choice.get("index", 0) != 0:
                    continue
                if reason := choice.get("finish_reason"):
                    result.finish_reason = _string(reason)
                delta = choice.get("delta") or {}
                if refusal := delta.get("refusal"):
                    result.refusal += refusal
                if piece := delta.get("content"):
                    text += piece
    except _SHAPE_ERRORS:
        raise _bad_shape() from None
    return text, usage


def _usage_of(u: dict[str, Any]) -> Usage:
    details = u.get("completion_tokens_details") or {}
    prompt_details = u.get("prompt_tokens_details") or {}
    prompt = _token_count(u.get("prompt_tokens", 0))
    completion = _token_count(u.get("completion_tokens", 0))
    reasoning = _token_count(details.get("reasoning_tokens") or 0)
    total = u.get("total_tokens")
    if not reasoning and type(total) is int and total > prompt + completion:
        # Gemini's OpenAI layer counts only the visible reply as completion and the
        # thinking in the total alone; both are billed as output, as OpenAI counts them.
        reasoning = _token_count(total - prompt - completion)
        completion += reasoning
    return (prompt, completion, reasoning, _token_count(prompt_details.get("cached_tokens") or 0))


def _bad_shape() -> AttemptFailed:
    return AttemptFailed(UpstreamBadResponse(), retry=False, reason="bad_shape")


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a string was expected, not {type(value).__name__}")
    return value


def _finish_reason(choice: dict[str, Any]) -> str | None:
    reason = choice.get("finish_reason")
    return None if reason is None else _string(reason)


def _token_count(value: object) -> int:
    if type(value) is not int or not 0 <= value <= MAX_TOKEN_COUNT:
        raise ValueError(f"not a token count: {value!r}")
    return value


def check_finish(call: ChatCall, result: ChatResult) -> None:
    """A reply that arrived whole but is not an answer: refused, filtered or cut off."""
    if result.refusal:
        refusal = " ".join(result.refusal.split())[:MAX_REFUSAL_CHARS]
        log.warning("%s call refused by %s: %s", call.stage, call.model, refusal)
        refused = UpstreamRefused(f"The AI model declined to answer: {refusal}")
        raise AttemptFailed(refused, retry=False, reason="refusal")
    if result.finish_reason == "content_filter":
        raise AttemptFailed(UpstreamContentFiltered(), retry=False, reason="content_filter")
    if result.finish_reason == "length":
        cap = call.shape.completion_cap
        reasoning = result.reasoning_tokens or 0
        log.warning(
            "%s call to %s hit its %d-token cap (%d reasoning tokens, %d characters of reply)",
            call.stage,
            call.model,
            cap,
            reasoning,
            len(result.text),
        )
        detail = "no visible reply" if not result.text else "the reply was incomplete"
        cut = UpstreamTokenLimit(f"The AI reply hit its {cap}-token limit ({detail}).")
        raise AttemptFailed(cut, retry=False, reason="length")


def error_body(content: bytes) -> object:
    """An error reply's JSON (`{"error": {...}}`), or None if it is not JSON."""
    try:
        return orjson.loads(content) if content else None
    except ValueError:
        return None


def error_field(body: object, name: str) -> str | None:
    """`name` (code, type, message) of an error body's `error` object, if it has one."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            value = inner.get(name)
            return str(value) if value is not None else None
    return None


def ratelimit_headers(raw_headers: tuple[tuple[bytes, bytes], ...]) -> dict[str, str]:
    """The response's `x-ratelimit-*` headers by lower-case name, read once from the raw
    list rather than by one case-insensitive lookup each."""
    return {
        key.decode("latin-1").lower(): value.decode("latin-1")
        for key, value in raw_headers
        if key[:12].lower() == b"x-ratelimit-"
    }
