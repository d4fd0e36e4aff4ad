"""Server-sent ``chat.completion.chunk`` events, paced to a sampled latency."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from app.sim.latency import StreamPlan
from app.sim.ratelimit import Header
from app.sim.state import SimState

Send = Any
Receive = Any

DONE = b"data: [DONE]\n\n"
# Filler text repeats a small vocabulary, so encoded deltas are worth memoising.
_DELTAS: dict[str, bytes] = {}
_DELTA_CACHE_MAX = 50_000


# Azure's content-filter annotations when nothing was filtered (its default filters).
SAFE = {"filtered": False, "severity": "safe"}
AZURE_CONTENT_SAFE = {"hate": SAFE, "self_harm": SAFE, "sexual": SAFE, "violence": SAFE}
AZURE_PROMPT_SAFE = {**AZURE_CONTENT_SAFE, "jailbreak": {"filtered": False, "detected": False}}
# What Azure reports on a completion its filter cut (finish_reason "content_filter").
AZURE_CONTENT_FILTERED = {**AZURE_CONTENT_SAFE, "violence": {"filtered": True, "severity": "medium"}}


def _cached_delta(text: str) -> bytes:
    delta = _DELTAS.get(text)
    if delta is None:
        if len(_DELTAS) >= _DELTA_CACHE_MAX:
            _DELTAS.clear()
        delta = b'{"content":' + json.dumps(text, ensure_ascii=False).encode() + b"}"
        _DELTAS[text] = delta
    return delta


class ChunkEncoder:
    """OpenAI's chunks, pre-serialised so each token costs one ``json.dumps`` of its text.

    ``field`` is ``content``, or ``refusal`` for a refusal, whose deltas carry
    ``refusal`` pieces with a null ``content`` (as OpenAI streams them). The stream is
    ``opening()`` (the role chunk), a ``token()`` per token, then ``tail()``: the finish
    chunk, the usage chunk (empty ``choices``) when asked, and ``[DONE]``.
    """

    def __init__(
        self, completion_id: str, created: int, model: str, include_usage: bool, field: str = "content"
    ) -> None:
        self.head = self._head(completion_id, created, model)
        self.field = field
        self.include_usage = include_usage
        self._usage_null = b',"usage":null' if include_usage else b""
        self._open = self.head + b'[{"index":0,"delta":'
        self._close = b',"logprobs":null,"finish_reason":null}]' + self._usage_null + b"}\n\n"

    def _head(self, completion_id: str, created: int, model: str) -> bytes:
        return (
            f'data: {{"id":"{completion_id}","object":"chat.completion.chunk",'
            f'"created":{created},"model":{json.dumps(model)},"service_tier":"default",'
            '"system_fingerprint":"fp_sim","choices":'
        ).encode()

    def opening(self) -> bytes:
        """What precedes the first token: the assistant role."""
        if self.field == "refusal":
            return self._open + b'{"role":"assistant","content":null,"refusal":""}' + self._close
        return self._open + b'{"role":"assistant","content":"","refusal":null}' + self._close

    def token(self, text: str) -> bytes:
        if self.field != "content":
            piece = json.dumps(text, ensure_ascii=False).encode()
            return self._open + b'{"' + self.field.encode() + b'":' + piece + b"}" + self._close
        return self._open + _cached_delta(text) + self._close

    def finish(self, reason: str) -> bytes:
        return (
            self._open
            + b'{},"logprobs":null,"finish_reason":"'
            + reason.encode()
            + b'"}]'
            + self._usage_null
            + b"}\n\n"
        )

    def usage(self, usage: dict[str, Any]) -> bytes:
        return self.head + b'[],"usage":' + json.dumps(usage).encode() + b"}\n\n"

    def tail(self, finish: str | None, usage: dict[str, Any]) -> bytes:
        """Finish chunk, usage chunk (when asked) and ``[DONE]``; nothing for a cut stream."""
        if finish is None:
            return b""
        out = self.finish(finish)
        if self.include_usage:
            out += self.usage(usage)
        return out + DONE


class AzureChunkEncoder(ChunkEncoder):
    """Azure OpenAI's chunks: first one with empty ``choices`` and only
    ``prompt_filter_results``, then per-choice ``content_filter_results`` on every chunk
    (empty on the role and finish chunks, the filter's verdict when it cut the reply)."""

    def __init__(
        self, completion_id: str, created: int, model: str, include_usage: bool, field: str = "content"
    ) -> None:
        super().__init__(completion_id, created, model, include_usage, field)
        safe = b',"content_filter_results":' + json.dumps(AZURE_CONTENT_SAFE).encode()
        self._close = b',"logprobs":null,"finish_reason":null' + safe + b"}]" + self._usage_null + b"}\n\n"
        self._role_close = (
            b',"logprobs":null,"finish_reason":null,"content_filter_results":{}}]'
            + self._usage_null
            + b"}\n\n"
        )

    def _head(self, completion_id: str, created: int, model: str) -> bytes:
        return (
            f'data: {{"id":"{completion_id}","object":"chat.completion.chunk",'
            f'"created":{created},"model":{json.dumps(model)},'
            '"system_fingerprint":"fp_sim","choices":'
        ).encode()

    def opening(self) -> bytes:
        prompt_filter = {
            "choices": [],
            "created": 0,
            "id": "",
            "model": "",
            "object": "",
            "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": AZURE_PROMPT_SAFE}],
        }
        first = b"data: " + json.dumps(prompt_filter).encode() + b"\n\n"
        if self.field == "refusal":
            role = b'{"role":"assistant","content":null,"refusal":""}'
        else:
            role = b'{"role":"assistant","content":"","refusal":null}'
        return first + self._open + role + self._role_close

    def finish(self, reason: str) -> bytes:
        verdict = AZURE_CONTENT_FILTERED if reason == "content_filter" else {}
        return (
            self._open
            + b'{},"logprobs":null,"finish_reason":"'
            + reason.encode()
            + b'","content_filter_results":'
            + json.dumps(verdict).encode()
            + b"}]"
            + self._usage_null
            + b"}\n\n"
        )


class GeminiChunkEncoder(ChunkEncoder):
    """Gemini's compat chunks: no role-only chunk (the first content delta carries the
    role), no ``service_tier``/``system_fingerprint``/``logprobs``, no ``refusal`` field, and
    ``usage`` on the finish chunk itself, whether or not ``stream_options`` asked for it."""

    def __init__(
        self, completion_id: str, created: int, model: str, include_usage: bool, field: str = "content"
    ) -> None:
        super().__init__(completion_id, created, model, True, "content")
        self._close = b',"finish_reason":null}]}\n\n'
        self._first = True

    def _head(self, completion_id: str, created: int, model: str) -> bytes:
        return (
            f'data: {{"id":"{completion_id}","object":"chat.completion.chunk",'
            f'"created":{created},"model":{json.dumps(model)},"choices":'
        ).encode()

    def opening(self) -> bytes:
        return b""

    def token(self, text: str) -> bytes:
        if self._first:
            self._first = False
            piece = json.dumps(text, ensure_ascii=False).encode()
            return self._open + b'{"content":' + piece + b',"role":"assistant"}' + self._close
        return self._open + _cached_delta(text) + self._close

    def tail(self, finish: str | None, usage: dict[str, Any]) -> bytes:
        if finish is None:
            return b""
        usage_json = json.dumps(usage).encode()
        return (
            self._open
            + b'{},"finish_reason":"'
            + finish.encode()
            + b'"}],"usage":'
            + usage_json
            + b"}\n\n"
            + DONE
        )


async def stream_events(
    *,
    state: SimState,
    send: Send,
    receive: Receive,
    headers: list[Header],
    encoder: ChunkEncoder,
    tokens: list[str],
    tail: bytes,
    plan: StreamPlan,
    stall_s: float | None,
) -> None:
    """Send headers + chunks on schedule; ``tail`` (finish/usage/[DONE]) closes the body.

    An empty ``tail`` ends the body cleanly right after the last token: what a client
    sees when the upstream connection is cut between chunks.

    A client disconnect cancels this coroutine mid-sleep (via a watcher on ``receive``);
    it then returns normally after counting ``streams_cancelled``.
    """
    stats = state.stats
    stats.streams_started += 1
    task = asyncio.current_task()
    assert task is not None
    finished = False
    disconnected = False

    def on_receive(_: asyncio.Future[Any]) -> None:
        nonlocal disconnected
        # The final send also wakes receive(); only an unfinished stream was abandoned.
        if not finished:
            disconnected = True
            task.cancel()

    watcher = asyncio.ensure_future(receive())
    watcher.add_done_callback(on_receive)
    batches = [tokens[i : i + plan.batch] for i in range(0, len(tokens), plan.batch)] or [[]]
    stall_at = len(batches) // 2 if stall_s is not None else -1
    sent = 0
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        if plan.first_delay > 0:
            await asyncio.sleep(plan.first_delay)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        last = len(batches) - 1
        for j, batch in enumerate(batches):
            if j:
                delay = start + plan.first_delay + j * plan.gap - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            if j == stall_at and stall_s is not None:
                stats.stalls_injected += 1
                stalled_from = loop.time()
                await _stall(state, stall_s)
                # Resume the normal pace afterwards instead of bursting the backlog.
                start += loop.time() - stalled_from
            if j == 0:
                body = encoder.opening() + b"".join([encoder.token(t) for t in batch])
            else:
                body = b"".join([encoder.token(t) for t in batch])
            if j == last:
                finished = True
                body += tail
            sent += len(batch)
            await send({"type": "http.response.body", "body": body, "more_body": not finished})
        stats.streams_completed += 1
    except asyncio.CancelledError:
        if not disconnected:
            raise
        task.uncancel()
        stats.streams_cancelled += 1
    finally:
        stats.completion_tokens += sent
        watcher.remove_done_callback(on_receive)
        watcher.cancel()


async def _stall(state: SimState, seconds: float) -> None:
    """Hold the stream ``seconds`` of real time, ending early if the simulator shuts down."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(state.closing.wait(), seconds)
