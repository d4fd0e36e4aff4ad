"""Chat completions as a raw ASGI handler (the hot path: no framework per-chunk cost).

The flavour (app/sim/flavors.py) decides the words: auth, parsing, error bodies, rate
headers, what the limiter counts and the reply's shape; this module decides the order.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import Receive, Scope, Send

from app.sim.errors import InvalidRequest
from app.sim.flavors import Failure, Flavor, Refused, Route, flavor_of, json_headers
from app.sim.generate import generate_content, unenforced_content
from app.sim.latency import plan_stream
from app.sim.ratelimit import Header
from app.sim.reasoning import reasoning_tokens
from app.sim.reply import Reply, plan_reply
from app.sim.request import ChatRequest
from app.sim.state import SimState
from app.sim.streaming import stream_events

_FAULT_COUNTERS = {
    "refuse": "refusals_injected",
    "content_filter": "content_filters_injected",
    "truncate": "truncations_injected",
    "malformed": "malformed_injected",
}

_SSE = (b"content-type", b"text/event-stream; charset=utf-8")


class ChatCompletions:
    """ASGI handler for one routed chat call; all behaviour comes from the shared ``SimState``."""

    def __init__(self, state: SimState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
        stats = self.state.stats
        stats.inflight += 1
        try:
            await self._handle(scope, receive, send, route)
        finally:
            stats.inflight -= 1

    async def _handle(self, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
        state = self.state
        stats = state.stats
        config = state.config
        flavor = flavor_of(config)
        raw = await _read_body(receive)
        stats.requests_total += 1
        headers = flavor.common_headers()
        denied = flavor.check_key(scope["headers"], route, config)
        if denied is not None:
            await self._fail(send, denied, headers)
            return
        try:
            body = flavor.decode(raw, config)
            state.capture(body)
            request = flavor.parse(body, route, config)
        except Refused as exc:
            await self._fail(send, exc.failure, headers)
            return
        try:
            content = _content(request, state)
        except InvalidRequest as exc:
            await self._fail(send, flavor.invalid(exc, config), headers)
            return
        stats.by_kind[request.kind] = stats.by_kind.get(request.kind, 0) + 1
        stats.by_schema[request.schema_name] = stats.by_schema.get(request.schema_name, 0) + 1
        rejection = self._rejection(flavor, request, route, headers)
        if rejection is not None:
            await self._fail(send, rejection, headers)
            return
        if state.inject_hold():
            stats.holds_injected += 1
            if not await _held(state, receive, config.hold_s):
                return  # the client gave up on it (counted by the limiter all the same)
        await self._complete(flavor, request, content, headers, receive, send)

    def _rejection(
        self, flavor: Flavor, request: ChatRequest, route: Route, headers: list[Header]
    ) -> Failure | None:
        """Quota, forced rejection, rate limit or injected error, in OpenAI's order.

        Appends the flavour's rate headers to ``headers`` when the buckets were consulted.
        """
        state = self.state
        stats = state.stats
        config = state.config
        limiter = state.limiter
        key = flavor.limiter_key(request)
        if config.quota_exhausted:
            stats.quota_rejected_total += 1
            headers += limiter.headers(key)
            return flavor.quota(request, route, config)
        if state.take_reject(request.kind):
            stats.rate_limited_total += 1
            headers += limiter.headers(key)
            return flavor.forced_rate_limit(request, route, config, config.reject_retry_after_ms / 1000)
        cost = flavor.charge(request, config)
        denial, limit_headers = limiter.acquire(key, cost)
        headers += limit_headers
        if denial is not None:
            stats.rate_limited_total += 1
            return flavor.rate_limited(request, route, denial, config)
        stats.tokens_charged_total += cost  # what the TPM limit counted
        if state.inject_error(request.kind):
            stats.errors_injected_total += 1
            return Failure(config.error_status, flavor.server_error(config.error_status))
        return None

    async def _complete(
        self,
        flavor: Flavor,
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
        headers += flavor.processing_headers(latency)
        stats.count_status(200)
        stats.prompt_tokens += request.prompt_tokens
        cached = 0
        if flavor.uses_prompt_cache:
            cached = state.prompt_cache.cached_tokens(
                request.model, request.prompt_cache_key, request.prefixes
            )
        stats.cached_tokens += cached
        stats.reasoning_tokens += reply.reasoning
        # Visible tokens are counted as they go out (a cancelled stream sends fewer).
        stats.completion_tokens += reply.reasoning
        completion_id = flavor.completion_id()
        created = int(time.time())
        totals = flavor.usage(request.prompt_tokens, reply, cached)
        if request.stream:
            encoder = flavor.encoder(completion_id, created, request, reply)
            await stream_events(
                state=state,
                send=send,
                receive=receive,
                headers=[*headers, _SSE, (b"cache-control", b"no-cache")],
                encoder=encoder,
                tokens=reply.tokens,
                tail=encoder.tail(reply.finish, totals),
                plan=plan_stream(latency, config.first_token_fraction, len(reply.tokens)),
                stall_s=config.stall_s if state.inject_stall() else None,
            )
            return
        if latency > 0:
            await asyncio.sleep(latency)
        stats.completion_tokens += len(reply.tokens)
        await _send(
            send, 200, flavor.completion_body(completion_id, created, request, reply, totals), headers
        )

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

    async def _fail(self, send: Send, failure: Failure, headers: list[Header]) -> None:
        self.state.stats.count_status(failure.status)
        await _send(send, failure.status, failure.body, [*headers, *failure.headers])


async def _held(state: SimState, receive: Receive, seconds: float) -> bool:
    """Hold a reply before its first byte (``hold_rate``) for ``seconds`` of real time: True
    to answer it then (or at shutdown), False when the client left meanwhile."""
    gone = asyncio.ensure_future(receive())  # the body was read: this is the disconnect
    closing = asyncio.ensure_future(state.closing.wait())
    try:
        done, _ = await asyncio.wait({gone, closing}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        closing.cancel()
    if gone in done:
        return False
    gone.cancel()
    return True


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
    await send({"type": "http.response.start", "status": status, "headers": [*headers, *json_headers(body)]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Send, status: int, body: bytes, headers: list[Header] | None = None) -> None:
    """A whole JSON response (the models listing, 404s, outage 503s)."""
    await _send(send, status, body, headers or [])
