"""Every OpenAI call goes through `Upstream`: stage gate -> rate budget -> call ->
reconcile, inside the one retry loop.

Order matters. The stage gate comes first so a call waiting for budget counts
against its stage's concurrency (the gate bounds calls in progress, waiting or
not), and the budget is reserved last so tokens are never held by a call that is
still queued behind the gate. After every answer, 2xx or not, the `x-ratelimit-*`
headers correct the budget; a 429 pauses the whole budget for `retry-after` so the
other waiters do not hammer the upstream in the meantime.

`_with_retries` is the only retry loop: `ChatEndpoint` (app/upstream/endpoint.py) sends
each attempt once, so no retry below it bypasses the budget.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import aiohttp
import orjson

from app.errors import (
    ScanDeadlineExceeded,
    UpstreamError,
    UpstreamQuotaExhausted,
    UpstreamRateLimited,
    UpstreamRejected,
    UpstreamTimeout,
)
from app.limits.clock import Clock
from app.limits.rate_budget import BudgetDeadlineExceeded, RateBudget, Reservation
from app.limits.retry import RetryPolicy, retry_after_from_headers
from app.limits.stage_gate import StageGate
from app.runtime.metrics import Metrics
from app.upstream.call import AttemptFailed, ChatCall, ChatResult, OnText, Usage
from app.upstream.endpoint import ChatEndpoint, StallWatch, until_eof
from app.upstream.wire import (
    Pause,
    check_finish,
    error_body,
    error_field,
    ratelimit_headers,
    read_chunks,
    read_completion,
    request_body,
)

log = logging.getLogger(__name__)

ENDPOINT = "chat.completions"

# A rejection's message (or its body, if it is not OpenAI's JSON error) is logged this far.
MAX_ERROR_BODY_CHARS = 300
# After a stream's [DONE], how long its body's end may take to follow: a connection released
# before it is closed rather than pooled (with OpenAI, a TLS handshake for the next call).
STREAM_END_WAIT_S = 0.1

# Reads a streamed reply's bytes into the result; returns its usage, if it came.
ReadStream = Callable[[AsyncIterator[bytes], Pause, ChatResult], Awaitable[Usage | None]]


class Upstream:
    def __init__(
        self,
        chat: ChatEndpoint,
        *,
        budgets: Mapping[str, RateBudget],
        gates: Mapping[str, StageGate],
        retry: RetryPolicy,
        metrics: Metrics,
        clock: Clock,
    ) -> None:
        self._chat = chat
        self.budgets = budgets
        self.gates = gates
        self._retry = retry
        self._metrics = metrics
        self._clock = clock
        # Reservations taken and not yet settled: zero whenever no call is in progress.
        self.reservations_open = 0

    def predicted_wait(self, model: str, tokens: int, *, ahead: int) -> float:
        """How long a call of `tokens` would wait for `model`'s budget behind `ahead` calls
        (plus those queued at the stage gates, which have not reached the budget yet)."""
        queued_at_gates = sum(g.waiting for g in self.gates.values())
        return self.budgets[model].predicted_wait(tokens, ahead=ahead + queued_at_gates)

    async def complete(self, call: ChatCall, *, deadline: float) -> ChatResult:
        return await self._with_retries(call, deadline, None)

    async def stream(self, call: ChatCall, *, deadline: float, on_text: OnText) -> ChatResult:
        """A streamed call; `on_text` gets the text so far after each read of the stream, and
        says how long it can wait for more: the tokens arriving meanwhile wait in the
        socket buffer and are parsed in one go (one wake-up, one `on_text`, instead of one
        per token), for a consumer that shows text at its own pace anyway."""
        return await self._with_retries(call, deadline, functools.partial(read_chunks, on_text))

    async def _with_retries(
        self, call: ChatCall, deadline: float, read_stream: ReadStream | None
    ) -> ChatResult:
        result = ChatResult()
        while True:
            result.attempts += 1
            try:
                await self._attempt(call, deadline, read_stream, result)
                return result
            except AttemptFailed as failed:
                delay = self._retry.delay(result.attempts, failed.wait_s)
                left = deadline - self._clock.now()
                if not failed.retry or result.attempts >= self._retry.max_attempts or delay >= left:
                    log.warning(
                        "%s call failed for good after %d attempt(s): %s",
                        call.stage,
                        result.attempts,
                        failed.reason,
                    )
                    raise failed.error from None
                self._metrics.upstream_retries.labels(call.model, failed.reason).inc()
                log.info(
                    "%s call: retry %d in %.2fs (%s)",
                    call.stage,
                    result.attempts,
                    delay,
                    failed.reason,
                )
                await self._clock.sleep(delay)

    async def _attempt(
        self, call: ChatCall, deadline: float, read_stream: ReadStream | None, result: ChatResult
    ) -> None:
        budget = self.budgets[call.model]
        gate = self.gates[call.stage]
        m = self._metrics
        async with gate.hold() as gate_wait:
            m.stage_queue.labels(call.stage, "semaphore").observe(gate_wait)
            budget_started = time.perf_counter()
            try:
                reservation = await budget.reserve(call.reservation_tokens, deadline=deadline)
            except BudgetDeadlineExceeded:
                raise ScanDeadlineExceeded(
                    "The OpenAI rate budget could not be had before the deadline."
                ) from None
            budget_wait = time.perf_counter() - budget_started
            m.budget_wait.labels(call.model).observe(budget_wait)
            m.stage_queue.labels(call.stage, "budget").observe(budget_wait)
            result.queue_s += gate_wait + budget_wait
            m.upstream_tokens.labels(call.model, "estimated").inc(reservation.tokens)
            started = time.perf_counter()
            self.reservations_open += 1
            try:
                await self._call(call, budget, reservation, read_stream, result)
            finally:
                self.reservations_open -= 1
                elapsed = time.perf_counter() - started
                result.service_s += elapsed
                m.upstream_duration.labels(call.model, ENDPOINT).observe(elapsed)
                # Whatever happened (success, error, cancellation), the reservation is
                # settled exactly once; an unsettled one here means "spent as reserved".
                reservation.settle(reservation.tokens)

    async def _call(
        self,
        call: ChatCall,
        budget: RateBudget,
        reservation: Reservation,
        read_stream: ReadStream | None,
        result: ChatResult,
    ) -> None:
        # What this attempt reads; a failed attempt's text, refusal or finish reason must
        # not pass for the retry's.
        result.text, result.refusal, result.finish_reason = "", "", None
        try:
            response = await self._chat.post(orjson.dumps(request_body(call, stream=read_stream is not None)))
            watch: StallWatch | None = None
            try:
                if not 200 <= response.status < 300:  # a 3xx too, when it was not followed
                    raise self._status_failure(call, budget, reservation, response, await response.read())
                self._observe(call, budget, response, "2xx")
                if read_stream is None:
                    usage = read_completion(await response.read(), result)
                else:
                    watch = self._chat.watch_stream(response)
                    pause = functools.partial(until_eof, response.content)
                    usage = await read_stream(response.content.iter_any(), pause, result)
                    # [DONE] is in; the body's end may be a moment behind it.
                    await pause(STREAM_END_WAIT_S)
            finally:
                if watch is not None:
                    watch.stop()
                # Leaving before the end (an error, or cancellation: the client is gone)
                # closes the connection: that is how the upstream learns to stop generating.
                # After the end, the connection goes back to the pool.
                response.release()
        except aiohttp.ClientError as exc:  # its timeouts (connect, pool, read) included
            raise self._transport_failure(call, reservation, exc, result) from exc
        if usage is not None:
            self._settle(call, reservation, usage, result)
        check_finish(call, result)

    def _settle(self, call: ChatCall, reservation: Reservation, usage: Usage, result: ChatResult) -> None:
        result.prompt_tokens, result.completion_tokens, result.reasoning_tokens, result.cached_tokens = usage
        # Cached prompt tokens are cheaper, but count against TPM like any other.
        reservation.settle(usage[0] + usage[1])
        tokens = self._metrics.upstream_tokens
        tokens.labels(call.model, "prompt").inc(usage[0])
        tokens.labels(call.model, "completion").inc(usage[1])
        tokens.labels(call.model, "reasoning").inc(usage[2])
        tokens.labels(call.model, "cached").inc(usage[3])

    def _transport_failure(
        self, call: ChatCall, reservation: Reservation, exc: Exception, result: ChatResult
    ) -> AttemptFailed:
        """Refused or unreachable is a connection failure, a connect or read that took too
        long a timeout; a request that never left gets its reservation back."""
        self._count(call, "error")
        never_sent = isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)
        if never_sent and not result.text:
            reservation.settle(None)
        if isinstance(exc, TimeoutError):
            return AttemptFailed(UpstreamTimeout(), retry=True, reason="timeout")
        return AttemptFailed(UpstreamError(), retry=True, reason="connection")

    def _status_failure(
        self,
        call: ChatCall,
        budget: RateBudget,
        reservation: Reservation,
        response: aiohttp.ClientResponse,
        content: bytes,
    ) -> AttemptFailed:
        headers = response.headers
        status = response.status
        body = error_body(content)
        if status == 429:
            self._observe(call, budget, response, "429")
            code = error_field(body, "code")
            kind = error_field(body, "type") or "unknown"
            self._metrics.upstream_429.labels(call.model, str(code or kind)).inc()
            # A 429 is not counted by the upstream: give the reservation back.
            reservation.settle(None)
            if code == "insufficient_quota":
                return AttemptFailed(UpstreamQuotaExhausted(), retry=False, reason="insufficient_quota")
            wait_s = retry_after_from_headers(headers)
            budget.pause(wait_s if wait_s is not None else 1.0)
            return AttemptFailed(UpstreamRateLimited(), retry=True, reason="429", wait_s=wait_s)
        status_class = f"{status // 100}xx"
        self._observe(call, budget, response, status_class)
        if status >= 500 or status in (408, 409):
            return AttemptFailed(
                UpstreamError(),
                retry=True,
                reason=status_class,
                wait_s=retry_after_from_headers(headers),
            )
        message = (error_field(body, "message") or content.decode("utf-8", "replace"))[:MAX_ERROR_BODY_CHARS]
        log.error("upstream rejected %s call with %d: %s", call.stage, status, message)
        return AttemptFailed(UpstreamRejected(), retry=False, reason=status_class)

    def _observe(
        self, call: ChatCall, budget: RateBudget, response: aiohttp.ClientResponse, status: str
    ) -> None:
        self._count(call, status)
        limits = ratelimit_headers(response.raw_headers)
        budget.observe_headers(limits)
        for resource in ("requests", "tokens"):
            raw = limits.get(f"x-ratelimit-remaining-{resource}")
            if raw is not None and raw.isdigit():
                self._metrics.ratelimit_remaining.labels(call.model, resource).set(int(raw))

    def _count(self, call: ChatCall, status: str) -> None:
        self._metrics.upstream_calls.labels(call.model, ENDPOINT, status).inc()
