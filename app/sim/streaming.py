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


class ChunkEncoder:
    """Pre-serialised chunk framing so each token costs one ``json.dumps`` of its text.

    ``field`` is ``content``, or ``refusal`` for a refusal, whose deltas carry
    ``refusal`` pieces with a null ``content`` (as OpenAI streams them).
    """

    def __init__(
        self, completion_id: str, created: int, model: str, include_usage: bool, field: str = "content"
    ) -> None:
        self.head = (
            f'data: {{"id":"{completion_id}","object":"chat.completion.chunk",'
            f'"created":{created},"model":{json.dumps(model)},"service_tier":"default",'
            '"system_fingerprint":"fp_sim","choices":'
        ).encode()
        self.field = field
        self._usage_null = b',"usage":null' if include_usage else b""
        self._open = self.head + b'[{"index":0,"delta":'
        self._close = b',"logprobs":null,"finish_reason":null}]' + self._usage_null + b"}\n\n"

    def role(self) -> bytes:
        if self.field == "refusal":
            return self._open + b'{"role":"assistant","content":null,"refusal":""}' + self._close
        return self._open + b'{"role":"assistant","content":"","refusal":null}' + self._close

    def token(self, text: str) -> bytes:
        if self.field != "content":
            piece = json.dumps(text, ensure_ascii=False).encode()
            return self._open + b'{"' + self.field.encode() + b'":' + piece + b"}" + self._close
        delta = _DELTAS.get(text)
        if delta is None:
            if len(_DELTAS) >= _DELTA_CACHE_MAX:
                _DELTAS.clear()
            delta = b'{"content":' + json.dumps(text, ensure_ascii=False).encode() + b"}"
            _DELTAS[text] = delta
        return self._open + delta + self._close

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
            body = b"".join([encoder.token(t) for t in batch])
            if j == 0:
                body = encoder.role() + body
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
