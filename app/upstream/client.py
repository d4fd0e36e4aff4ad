"""Every model call goes through `Upstream`: route -> stage gate -> the route's budget ->
call -> reconcile, inside the one retry loop.

Order matters. The stage gate comes first so a call waiting for budget counts against
its stage's concurrency (the gate bounds calls in progress, waiting or not), and the
budget is reserved last so tokens are never held by a call still queued behind the gate.
After every answer, 2xx or not, the `x-ratelimit-*` headers (where the provider sends
them) correct the budget; a 429 pauses that budget for the wait it asked for, so the
other waiters do not hammer it meanwhile.

`_with_retries` is the only retry loop: `ChatEndpoint` (app/upstream/endpoint.py) sends
each attempt once. Each attempt picks its route (app/upstream/routes.py): a failed one
goes on at once to another deployment that can take it, and only backs off when the one
it would go to is the one that failed. A stream that fails after its first token starts
again from the beginning (the consumer is told to drop what it showed: `on_restart`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import NoReturn

import aiohttp
import orjson

from app.errors import (
    ScanFailed,
    UpstreamError,
    UpstreamQuotaExhausted,
    UpstreamRateLimited,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from app.limits.clock import Clock
from app.limits.late_timeouts import LOOP_LATE, MAX_FORGIVEN, LateTimeouts
from app.limits.rate_budget import BudgetDeadlineExceeded, RateBudget, Reservation
from app.limits.retry import RetryPolicy
from app.limits.stage_gate import StageGate
from app.limits.timeouts import Deadline, ElasticDeadline, deadline_of
from app.runtime import tracing
from app.runtime.metrics import Metrics
from app.upstream import genai
from app.upstream.breaker import CLOSED, CREDENTIAL_REASON, CREDENTIAL_RETRY_S, OUT_RETRY_S, QUOTA_COOLDOWN_S
from app.upstream.call import AttemptFailed, ChatCall, ChatRequest, ChatResult, OnRestart, OnText, Usage
from app.upstream.credentials import CredentialUnavailable
from app.upstream.endpoint import StallWatch, until_eof
from app.upstream.hedging import HedgePolicy, claim, race, sending, take_over
from app.upstream.negotiation import NEGOTIATION_WAIT_S, NO_WAIT, Trial
from app.upstream.prices import Pricing
from app.upstream.probes import wait_for_return
from app.upstream.routes import NoRoute, Route, Router
from app.upstream.wire import (
    Pause,
    check_finish,
    error_body,
    ratelimit_headers,
    read_chunks,
    read_completion,
    request_body,
)

log = logging.getLogger(__name__)

ENDPOINT = "chat.completions"

# A rejection's message (or its body, if it is not JSON) is logged this far.
MAX_ERROR_BODY_CHARS = 300
# After a stream's [DONE], how long its body's end may take to follow: a connection released
# before it is closed rather than pooled (with a TLS provider, a handshake for the next call).
STREAM_END_WAIT_S = 0.1
# A deployment that refuses a key or has no such deployment answers these.
OUT_STATUSES = (401, 403, 404)
QUOTA_REASON = "insufficient_quota"
# A call taken off a deployment whose breaker opened before the call was sent.
REROUTED = "rerouted"
# An attempt whose hedge (or first attempt) answered first: cancelled, never retried.
HEDGE_LOST = "hedge_lost"
# How many times one call waits for a deployment's return, every one of its stage's being
# down: a deployment whose probes pass but whose calls fail must not hold a call forever.
MAX_RIDES = 2
# The longest one such wait lasts (UPSTREAM_RIDE_OUT_S), within the call's deadline.
RIDE_OUT_S = 20.0
REJECTED_KEY_MESSAGE = (
    "The AI service refused this service's credentials, or the deployment does not exist; "
    "the operator must fix the configuration."
)
BUDGET_SPENT_MESSAGE = (
    "No AI service's rate budget can take the call before the scan's deadline; retry later."
)
# Failures that say the upstream has more than it can take: its route's automatic
# limit backs off, and the stage gate with it (app/limits/route_limits.py).
OVERLOAD_REASONS = frozenset({"429", "5xx", "timeout"})
# Replies that broke on the way (a cut stream, a body that is not JSON): the deployment's
# failure, where a refusal, a filter or a token cap is an answer.
BROKEN_REPLIES = frozenset({"truncated", "bad_body", "bad_chunk", "stream_error"})
# Failures that spend none of the call's attempts: sent again without what was refused, or
# timed out while our own loop was late (app/limits/late_timeouts.py).
UNCOUNTED = frozenset({"negotiated", LOOP_LATE})

# Reads a streamed reply's bytes into the result; returns its usage, if it came.
ReadStream = Callable[[AsyncIterator[bytes], Pause, ChatResult], Awaitable[Usage | None]]


class Upstream:
    def __init__(
        self,
        router: Router,
        *,
        gates: Mapping[str, StageGate],
        retry: RetryPolicy,
        metrics: Metrics,
        clock: Clock,
        negotiation_wait_s: float = NEGOTIATION_WAIT_S,
        ride_out_s: float = RIDE_OUT_S,
        hedging: HedgePolicy | None = None,
        late_timeouts: LateTimeouts | None = None,
    ) -> None:
        self.router = router
        self._hedging = hedging  # None: calls are never hedged
        self._negotiation_wait_s = negotiation_wait_s
        self._ride_out_s = ride_out_s
        self._late_timeouts = late_timeouts
        self.gates = gates
        self._retry = retry
        self._metrics = metrics
        self._clock = clock
        # What each call cost (app/upstream/prices.py).
        self._pricing = Pricing(((r.name, r.model, r.deployment.prices) for r in router.routes), metrics)
        # Every budget, by its key (limit group and model), once each.
        self.budgets: dict[str, RateBudget] = {}
        for route in router.routes:
            self.budgets.setdefault(route.deployment.budget_key(route.model), route.budget)
        # Reservations taken and not yet settled: zero whenever no call is in progress.
        self.reservations_open = 0
        # Per stage, a running mean of the tokens one call reserves: what a budget's TPM
        # means in calls per second.
        self._tokens_per_call: dict[str, float] = {}
        # Requests made per stage (one each, however many attempts): how many scans call it.
        self.requests: dict[str, int] = {}

    @property
    def routes(self) -> Sequence[Route]:
        return self.router.routes

    def models(self, stage: str) -> list[str]:
        """The models that may serve `stage`, whichever deployment they are on."""
        return sorted({route.model for route in self.router.by_stage.get(stage, [])})

    def routes_for(self, stage: str) -> list[Route]:
        return list(self.router.by_stage.get(stage, []))

    def predicted_wait(self, stage: str, tokens: Callable[[Route], int], *, ahead: int) -> float:
        """How long a `stage` call reserving `tokens(route)` would wait for a budget behind
        `ahead` calls (plus those queued at the stage gates, not at a budget yet)."""
        queued_at_gates = sum(g.waiting for g in self.gates.values())
        return self.router.predicted_wait(stage, tokens, ahead=ahead + queued_at_gates)

    def route_rate(self, route: Route) -> float:
        """Calls per second `route`'s budget would let it make if it had the budget to itself
        (0 while taken out): what its limit may need slots for (app/limits/route_limits.py).
        Not split between the stages, nor the deployments of a limit group, that share a
        budget: how they share it depends on the scans (a vision reply from the cache makes
        no call) and the routing, and a limit sized for the whole budget costs nothing
        while the budget, not the limit, holds the calls back."""
        if route.breaker.out:
            return 0.0
        budget = route.budget
        calls = budget.effective_rpm / 60
        tokens = self._tokens_per_call.get(route.stage)
        if tokens:
            calls = min(calls, budget.effective_tpm / 60 / tokens)
        return calls

    async def complete(self, request: ChatRequest, *, deadline: Deadline) -> ChatResult:
        return await self._with_retries(request, deadline, None, None)

    async def stream(
        self,
        request: ChatRequest,
        *,
        deadline: Deadline,
        on_text: OnText,
        on_restart: OnRestart | None = None,
    ) -> ChatResult:
        """A streamed call; `on_text` gets the text so far after each read of the stream, and
        says how long it can wait for more: the tokens arriving meanwhile wait in the
        socket buffer and are parsed in one go (one wake-up, one `on_text`, instead of one
        per token), for a consumer that shows text at its own pace anyway. `on_restart`:
        the call failed after some text and starts again (on another route if one can take
        it): what the consumer showed of it is void."""
        return await self._with_retries(
            request, deadline, functools.partial(read_chunks, on_text), on_restart
        )

    async def _with_retries(
        self,
        request: ChatRequest,
        deadline: Deadline,
        read_stream: ReadStream | None,
        on_restart: OnRestart | None,
    ) -> ChatResult:
        self.requests[request.stage] = self.requests.get(request.stage, 0) + 1
        # A stage's deadline may move later while the call runs (app/limits/timeouts.py):
        # each attempt, budget wait and retry reads it anew.
        until = deadline_of(deadline)
        result = ChatResult()
        failed_on: dict[str, str] = {}  # deployment -> why it failed this call
        failures = 0
        detours = 0  # calls taken off a deployment that went down while they queued
        rides = 0  # waits for a deployment's return, every one of the stage's being down
        chosen: Route | None = None
        while True:
            route = chosen or await self._pick(request, failed_on, until)
            call = route.shaped(request)
            tracing.event("route", {"ecoscan.deployment": route.name, "ecoscan.attempt": result.attempts + 1})
            trial = await self._negotiated(route, call, read_stream is not None, until())
            try:
                result.attempts += 1
                served = await self._hedged(route, call, request, until(), read_stream, result)
                result.upstream = served.name
                return result
            except AttemptFailed as exc:
                failed = exc
            finally:
                if trial is not None:  # answered or not: calls waiting for it look again
                    route.negotiation.end(trial)
            if failed.reason == REROUTED and detours < len(self.routes):
                # Its deployment went down while the call queued: elsewhere, at once.
                detours, chosen = detours + 1, None
                failed_on.setdefault(route.name, failed.reason)
                self._metrics.upstream_failovers.labels(request.stage, REROUTED).inc()
                continue
            if failed.reason not in UNCOUNTED:
                failures += 1
                failed_on[route.name] = failed.reason
            shown = bool(result.text)
            try:
                chosen = await self._before_next(request, route, failed, failures, failed_on, until())
            except NoRoute:
                # Every deployment of the stage is down, none taken out: the call waits for
                # one's return (a probe's success) instead of spending its attempts now.
                if rides >= MAX_RIDES or not await self._ride_out(request.stage, until()):
                    self._give_up(request, failed, failures)
                rides, chosen = rides + 1, None
            if shown and on_restart is not None:  # it starts again: what was shown is void
                self._metrics.upstream_restarts.labels(request.stage).inc()
                tracing.event("stream_restart", {"ecoscan.deployment": route.name})
                await on_restart()

    async def _hedged(
        self,
        route: Route,
        call: ChatCall,
        request: ChatRequest,
        deadline: float,
        read_stream: ReadStream | None,
        result: ChatResult,
    ) -> Route:
        """One attempt on `route`, hedged on another deployment when its reply is late
        (app/upstream/hedging.py); returns the route that served it."""
        policy = self._hedging
        # Counted on its route at once, before its task runs: the next call's pick sees it.
        first = genai.traced(
            self._attempt(route, call, deadline, read_stream, result, route.limit.enter()), route, call
        )
        if policy is None or len(self.router.by_stage.get(route.stage, ())) < 2:
            await first
            return route
        policy.budget.call(self._clock.now())
        hedged_on: list[Route] = []
        hedge_result = ChatResult()  # its own: it must not touch what the first attempt reads

        def hedge() -> Awaitable[None] | None:
            spare = self.router.spare(route, lambda r: r.limiter_tokens(r.estimate(request), request.kind))
            outcome = "no_route" if spare is None else "sent"
            if spare is not None and not policy.budget.take(self._clock.now()):
                spare, outcome = None, "no_budget"
            self._metrics.upstream_hedges.labels(route.stage, outcome).inc()
            if spare is None:
                return None
            hedged_on.append(spare)
            result.attempts += 1
            tracing.event("hedge", {"ecoscan.deployment": spare.name})
            shaped = spare.shaped(request)
            attempt = self._attempt(spare, shaped, deadline, read_stream, hedge_result, spare.limit.enter())
            return genai.traced(attempt, spare, shaped)

        after_s = policy.after(route.first_byte)
        started = self._clock.now()
        try:
            winner = await race(first, hedge, after_s)
        except AttemptFailed as failed:
            if failed.reason == "timeout":  # no first byte at all: late
                route.first_byte.mark(late=True, now=self._clock.now())
            if hedge_result.text and not result.text:
                # The hedge streamed text to the consumer before it failed: the next attempt
                # must void it (on_restart: a `discard`), as after the first attempt's own.
                result.text = hedge_result.text
            raise
        if not hedged_on:
            return route
        self._metrics.upstream_hedges.labels(route.stage, "won" if winner == 2 else "lost").inc()
        if winner == 1:
            return route
        # Its reply was late past its own p99: its limit backs off, the router sends it less.
        route.limit.observe(self._clock.now() - started, overloaded=True)
        route.first_byte.mark(late=True, now=self._clock.now())
        take_over(result, hedge_result)
        return hedged_on[0]

    async def _negotiated(self, route: Route, call: ChatCall, stream: bool, deadline: float) -> Trial | None:
        """Wait, if another call is finding out whether `route` takes parameters this call
        carries, for its answer (app/upstream/negotiation.py); a `Trial` when this call is
        the one to find out. Before the gate and the budget: a waiting call holds neither."""
        negotiation = route.negotiation
        if negotiation.settled:
            return None
        names = route.sent_names(request_body(call, stream=stream))
        wait_s = min(self._negotiation_wait_s, max(0.0, deadline - self._clock.now()))
        trial, waited = await negotiation.turn(names, wait_s)
        if waited != NO_WAIT:
            self._metrics.upstream_negotiation_waits.labels(route.name, waited).inc()
            tracing.event("negotiation_wait", {"ecoscan.deployment": route.name, "ecoscan.outcome": waited})
        return trial

    async def _pick(
        self, request: ChatRequest, failed_on: Mapping[str, str], until: Callable[[], float]
    ) -> Route:
        """The first attempt's route; with every deployment of the stage down (none taken
        out), once one is back, within the deadline."""
        while True:
            try:
                return self.router.pick(
                    request.stage,
                    lambda r: r.limiter_tokens(r.estimate(request), request.kind),
                    avoid=failed_on,
                    within_s=until() - self._clock.now(),
                    prefix=self.router.prefix_of(request),
                )
            except NoRoute as none:
                if none.returning and await self._ride_out(request.stage, until()):
                    continue
                log.warning("%s call: no deployment can take it for %.1f s", request.stage, none.wait_s)
                raise self._none_left(request.stage, none.wait_s) from None

    async def _ride_out(self, stage: str, deadline: float) -> bool:
        """Wait for one of `stage`'s deployments to come back (its probe succeeded), until
        `deadline` or for `UPSTREAM_RIDE_OUT_S`: True when one did."""
        wait_s = min(self._ride_out_s, deadline - self._clock.now())
        back = await wait_for_return(self.router.by_stage.get(stage, []), wait_s)
        self._metrics.upstream_ride_outs.labels(stage, "returned" if back else "expired").inc()
        return back

    def _none_left(self, stage: str, wait_s: float) -> ScanFailed:
        """Every deployment serving `stage` is out: the error says why. Refused keys or
        missing deployments are the operator's to fix, not a wait's (`UPSTREAM_REJECTED`);
        exhausted quotas likewise (`UPSTREAM_QUOTA_EXHAUSTED`); else a retryable
        `UPSTREAM_UNAVAILABLE` with when the first comes back."""
        routes = self.router.by_stage.get(stage, [])
        if routes and all(r.breaker.out for r in routes):
            if all(r.breaker.reason == QUOTA_REASON for r in routes):
                return UpstreamQuotaExhausted()
            if not any(r.breaker.reason == QUOTA_REASON for r in routes):
                return UpstreamRejected(REJECTED_KEY_MESSAGE)
        return UpstreamUnavailable(retry_after_s=max(1.0, wait_s))

    async def _before_next(
        self,
        request: ChatRequest,
        route: Route,
        failed: AttemptFailed,
        failures: int,
        failed_on: Mapping[str, str],
        deadline: float,
    ) -> Route | None:
        """Raise when this was the last attempt; otherwise wait as long as the next one must
        and say where it goes (None: wherever the router picks). `NoRoute` when every
        deployment of the stage is down and one may come back."""
        if failed.reason == "negotiated" or (failed.reason == LOOP_LATE and deadline > self._clock.now()):
            return route  # the same route again, at once: without what it refused, or on time
        left = deadline - self._clock.now()
        if not failed.retry or left <= 0:
            self._give_up(request, failed, failures)
        try:
            following = self.router.pick(
                request.stage,
                lambda r: r.limiter_tokens(r.estimate(request), request.kind),
                avoid=failed_on,
                within_s=left,
            )
        except NoRoute as none:
            if none.returning:  # every one down, some coming back: the caller waits for it
                raise
            # Every deployment taken out (a key, a deployment, a quota): that is the answer.
            self._give_up(request, failed, failures)
        if failures >= self._retry.max_attempts:
            self._give_up(request, failed, failures)
        self._metrics.upstream_retries.labels(route.model, failed.reason).inc()
        if following.name not in failed_on:  # another deployment can take it: go at once
            self._metrics.upstream_failovers.labels(request.stage, failed.reason).inc()
            tracing.event(
                "failover",
                {"ecoscan.from": route.name, "ecoscan.to": following.name, "error.type": failed.reason},
            )
            log.info(
                "%s call: %s failed (%s); on to %s", request.stage, route.name, failed.reason, following.name
            )
            return following
        delay = self._retry.delay(failures, failed.wait_s)
        if delay >= left:
            self._give_up(request, failed, failures)
        log.info("%s call: retry %d in %.2fs (%s)", request.stage, failures, delay, failed.reason)
        tracing.event("retry", {"ecoscan.delay_s": round(delay, 3), "error.type": failed.reason})
        await self._clock.sleep(delay)
        return following

    def _give_up(self, request: ChatRequest, failed: AttemptFailed, failures: int) -> NoReturn:
        """Raise the last attempt's error; a retryable one says when capacity may return:
        the soonest any of the stage's deployments takes calls again, or the wait asked for."""
        log.warning("%s call failed for good after %d attempt(s): %s", request.stage, failures, failed.reason)
        error = failed.error
        if isinstance(error, ScanFailed) and error.retryable and error.retry_after_s is None:
            now = self._clock.now()
            reopen = [r.breaker.open_until - now for r in self.router.by_stage.get(request.stage, [])]
            error.retry_after_s = max(1.0, failed.wait_s or 0.0, min(reopen, default=0.0))
        raise error from None

    async def _attempt(
        self,
        route: Route,
        call: ChatCall,
        deadline: float,
        read_stream: ReadStream | None,
        result: ChatResult,
        entered: int | None = None,
    ) -> None:
        """One attempt on `route`; `entered`: its token in the route's limit, when the
        caller counted it there already (an attempt that runs as a task of its own)."""
        budget = route.budget
        gate = self.gates[call.stage]
        m = self._metrics
        breaker = route.breaker
        if entered is None:
            entered = route.limit.enter()  # the route's from now: `Router.pick` counts it there
        try:
            async with gate.hold() as gate_wait:
                m.stage_queue.labels(call.stage, "semaphore").observe(gate_wait)
                budget_started = time.perf_counter()
                try:
                    reservation = await self._reserve(route, call, deadline)
                except BudgetDeadlineExceeded:
                    # Not this deployment's fault: another one's budget may take the call in time.
                    wait_s = budget.predicted_wait(call.reservation_tokens)
                    raise AttemptFailed(
                        UpstreamRateLimited(BUDGET_SPENT_MESSAGE), retry=True, reason="budget", wait_s=wait_s
                    ) from None
                budget_wait = time.perf_counter() - budget_started
                m.budget_wait.labels(call.model).observe(budget_wait)
                m.stage_queue.labels(call.stage, "budget").observe(budget_wait)
                result.queue_s += gate_wait + budget_wait
                genai.waited(gate_wait, budget_wait)
                m.upstream_tokens.labels(call.model, "estimated").inc(reservation.tokens)
                mean = self._tokens_per_call.get(call.stage, float(reservation.tokens))
                self._tokens_per_call[call.stage] = mean + 0.05 * (reservation.tokens - mean)
                m.upstream_routed.labels(route.name, call.stage).inc()
                verdicts = breaker.verdicts
                started, sent_at = time.perf_counter(), self._clock.now()
                self.reservations_open += 1
                overloaded: bool | None = None  # None: the call said nothing (cancelled)
                error_type = "_OTHER"  # the GenAI metrics' word for how it ended ("": well)
                try:
                    await self._call(route, call, reservation, read_stream, result, sent_at)
                    breaker.succeeded(self._clock.now(), sent_at)
                    overloaded, error_type = False, ""
                except asyncio.CancelledError:
                    error_type = "cancelled"
                    raise
                except AttemptFailed as failed:
                    error_type = failed.reason
                    # Our lateness says nothing of the deployment: no verdict, no latency sample.
                    overloaded = None if failed.reason == LOOP_LATE else failed.reason in OVERLOAD_REASONS
                    if breaker.verdicts == verdicts and overloaded is not None:  # not told the breaker yet
                        if failed.reason in BROKEN_REPLIES:
                            breaker.failed(self._clock.now(), failed.reason, sent_at=sent_at)
                        else:  # it answered (a refusal, a filter, a cap, a 400): it is up
                            breaker.succeeded(self._clock.now(), sent_at)
                    raise
                finally:
                    self.reservations_open -= 1
                    # Whatever happened (success, error, cancellation), the reservation is
                    # settled exactly once; an unsettled one here means "spent as reserved".
                    reservation.settle(reservation.tokens)
                    elapsed = time.perf_counter() - started
                    if overloaded is not None:
                        gate.observe(elapsed, overloaded=overloaded)
                        route.limit.observe(elapsed, overloaded=overloaded)
                    result.service_s += elapsed
                    m.upstream_duration.labels(call.model, ENDPOINT).observe(elapsed)
                    genai.ended(m, route, elapsed, error_type, result, started)
        finally:
            route.limit.leave(entered)

    async def _reserve(self, route: Route, call: ChatCall, deadline: float) -> Reservation:
        """The call's reservation on `route`'s budget. A call does not go to a deployment
        whose breaker opened before it was sent (while it queued for the budget, say): it
        leaves the queue at once, `REROUTED`, for another deployment or its return."""
        budget, breaker = route.budget, route.breaker
        if breaker.state != CLOSED:
            raise AttemptFailed(UpstreamUnavailable(), retry=True, reason=REROUTED)
        opened = False
        try:
            async with asyncio.timeout(None) as waiting:

                def on_open() -> None:
                    nonlocal opened
                    opened = True
                    waiting.reschedule(asyncio.get_running_loop().time())  # leave the queue now

                breaker.watch_open(on_open)
                try:
                    return await budget.reserve(call.reservation_tokens, deadline=deadline)
                finally:
                    breaker.unwatch_open(on_open)
        except TimeoutError:
            if not opened:
                raise
            raise AttemptFailed(UpstreamUnavailable(), retry=True, reason=REROUTED) from None

    async def _call(
        self,
        route: Route,
        call: ChatCall,
        reservation: Reservation,
        read_stream: ReadStream | None,
        result: ChatResult,
        sent_at: float,
    ) -> None:
        # What this attempt reads; a failed attempt's text, refusal or finish reason must
        # not pass for the retry's.
        result.text, result.refusal, result.finish_reason = "", "", None
        result.first_chunk_at = None
        sent_version = route.negotiation.version
        built = request_body(call, stream=read_stream is not None)
        body = route.adapt(built)
        # Numbered as sent: its reply's headers then say what the limiter charged it.
        reservation.sent = await route.budget.sent(call.kind, call.limiter_estimate)
        try:
            response, content = await self._reply(route, orjson.dumps(body), whole=read_stream is None)
            watch: StallWatch | None = None
            try:
                if not 200 <= response.status < 300:  # a 3xx too, when it was not followed
                    raise self._status_failure(
                        route, call, reservation, response, content, sent_version, sent_at
                    )
                if not route.negotiation.settled:  # what it carried is taken: waiting calls go
                    route.negotiation.accept(route.sent_names(built))
                self._observe(route, call, response, "2xx", reservation)
                if read_stream is None:
                    usage = read_completion(content, result)
                else:
                    watch = route.endpoint.watch_stream(response)
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
            raise self._transport_failure(route, call, reservation, exc, result, sent_at) from exc
        except CredentialUnavailable as exc:
            raise self._credential_failure(route, reservation, exc) from None
        if usage is not None:
            self._settle(route, call, reservation, usage, result)
        check_finish(call, result)

    async def _reply(self, route: Route, body: bytes, *, whole: bool) -> tuple[aiohttp.ClientResponse, bytes]:
        """The reply's head, and its body when it is not 2xx or `whole` (not streamed; b""
        for a streamed one),
        waited for at least the configured read timeout, longer when this route's replies
        have lately taken longer (app/limits/timeouts.py): a slow model is not a hung one.
        The response is released here only if this fails."""
        endpoint = route.endpoint
        configured = endpoint.read_timeout_s
        sent = time.monotonic()
        if configured is None:
            waiting: ElasticDeadline | contextlib.nullcontext[None] = contextlib.nullcontext()
        else:
            waiting = ElasticDeadline(
                lambda: sent + route.reply_took.timeout(configured, time.monotonic()), time.monotonic
            )
        response: aiohttp.ClientResponse | None = None
        try:
            async with waiting:
                sending()
                response = await endpoint.post(body)
                seen_after = time.monotonic() - sent
                route.first_byte.observe(seen_after)
                if self._hedging is not None:  # on time, or late: the route's late share
                    self._hedging.judge(route.first_byte, seen_after, self._clock.now())
                ok = 200 <= response.status < 300
                if ok and not claim():  # a hedged call's other attempt answered first
                    raise AttemptFailed(UpstreamError(), retry=False, reason=HEDGE_LOST)
                content = await response.read() if whole or not ok else b""
        except BaseException as exc:
            if response is not None:
                response.release()
            if isinstance(exc, TimeoutError) and isinstance(waiting, ElasticDeadline) and waiting.expired():
                # As aiohttp's own read timeout says it, a timeout like any other. (Expired
                # while cancelled from outside too, the scope lets CancelledError through.)
                raise aiohttp.SocketTimeoutError("Timeout on reading data from socket") from exc
            raise
        if ok:
            now = time.monotonic()
            route.reply_took.observe(now - sent, now)
        return response, content

    def _settle(
        self, route: Route, call: ChatCall, reservation: Reservation, usage: Usage, result: ChatResult
    ) -> None:
        """The budget spends what the provider's limiter counted (nothing back, for OpenAI
        and Azure); what the call really used is counted apart, in the token metrics."""
        result.prompt_tokens, result.completion_tokens, result.reasoning_tokens, result.cached_tokens = usage
        reservation.settle(route.settled_tokens(call, reservation.tokens, usage[0], usage[1]))
        self._metrics.upstream_charge.labels(call.model, call.kind).observe(reservation.tokens)
        tokens = self._metrics.upstream_tokens
        tokens.labels(call.model, "prompt").inc(usage[0])
        tokens.labels(call.model, "completion").inc(usage[1])
        tokens.labels(call.model, "reasoning").inc(usage[2])
        tokens.labels(call.model, "cached").inc(usage[3])
        by_deployment = self._metrics.upstream_prompt_tokens  # a provider's prompt cache is its own
        by_deployment.labels(route.name, call.stage, "prompt").inc(usage[0])
        by_deployment.labels(route.name, call.stage, "cached").inc(usage[3])
        self._pricing.charge(route.name, call.model, usage)
        genai.used(self._metrics, route, usage, result)

    def _transport_failure(
        self,
        route: Route,
        call: ChatCall,
        reservation: Reservation,
        exc: Exception,
        result: ChatResult,
        sent_at: float,
    ) -> AttemptFailed:
        """Refused or unreachable is a connection failure, a connect or read that took too
        long a timeout; a request that never left gets its reservation back."""
        self._count(call, "error")
        never_sent = isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)
        if never_sent and not result.text:
            reservation.settle(None)
        timeout = isinstance(exc, TimeoutError)
        late = self._late_timeouts
        forgivable = result.late_timeouts < MAX_FORGIVEN
        if timeout and not result.text and late is not None and late.ours(call.stage, forgivable=forgivable):
            result.late_timeouts += 1
            return AttemptFailed(UpstreamTimeout(), retry=True, reason=LOOP_LATE)
        route.breaker.failed(self._clock.now(), "timeout" if timeout else "connection", sent_at=sent_at)
        if timeout:
            return AttemptFailed(UpstreamTimeout(), retry=True, reason="timeout")
        return AttemptFailed(UpstreamError(), retry=True, reason="connection")

    def _credential_failure(
        self, route: Route, reservation: Reservation, exc: CredentialUnavailable
    ) -> AttemptFailed:
        """No token to send (app/upstream/credentials.py): the request never left; the
        deployment is out as for a refused key, until its probe gets a token."""
        reservation.settle(None)
        log.error("upstream %s: %s", route.name, exc)
        route.breaker.take_out(self._clock.now(), CREDENTIAL_REASON, CREDENTIAL_RETRY_S)
        return AttemptFailed(UpstreamRejected(REJECTED_KEY_MESSAGE), retry=True, reason="credential")

    def _status_failure(
        self,
        route: Route,
        call: ChatCall,
        reservation: Reservation,
        response: aiohttp.ClientResponse,
        content: bytes,
        sent_version: int,
        sent_at: float,
    ) -> AttemptFailed:
        status = response.status
        provider = route.provider
        info = provider.error_info(error_body(content))
        wait_s = provider.wait_hint(response.headers, info)
        now = self._clock.now()
        if status == 429:
            self._observe(route, call, response, "429", reservation)
            self._metrics.upstream_429.labels(call.model, str(info.code or info.kind or "unknown")).inc()
            # A 429 is not counted by the upstream: give the reservation back.
            reservation.settle(None)
            route.budget.charge_refused(call.kind, reservation.tokens, wait_s, info.limit)
            if info.code == "insufficient_quota":
                route.breaker.take_out(now, QUOTA_REASON, QUOTA_COOLDOWN_S)
                return AttemptFailed(UpstreamQuotaExhausted(), retry=True, reason=QUOTA_REASON)
            route.budget.pause(wait_s if wait_s is not None else 1.0)
            route.breaker.failed(now, "429", wait_s, sent_at=sent_at)
            return AttemptFailed(UpstreamRateLimited(), retry=True, reason="429", wait_s=wait_s)
        status_class = f"{status // 100}xx"
        self._observe(route, call, response, status_class, reservation)
        if status >= 500 or status in (408, 409):
            route.breaker.failed(now, status_class, wait_s, sent_at=sent_at)
            return AttemptFailed(UpstreamError(), retry=True, reason=status_class, wait_s=wait_s)
        message = (info.message or content.decode("utf-8", "replace"))[:MAX_ERROR_BODY_CHARS]
        if status in OUT_STATUSES:
            # The provider's words go to the log only: the breaker's reason is shown by
            # /readyz and shared through Redis, so it is a code (`refused 401`).
            log.error("upstream %s refused the %s call with %d: %s", route.name, call.stage, status, message)
            if status == 401 and route.endpoint.credential is not None:
                # Its probe sends a new token (unless this 401 was to one already replaced).
                route.endpoint.credential.refused(response.request_info.headers)
            route.breaker.take_out(now, f"refused {status}", OUT_RETRY_S)
            # Another deployment may take the call; with none left, the scan ends here.
            return AttemptFailed(UpstreamRejected(REJECTED_KEY_MESSAGE), retry=True, reason=status_class)
        parameter = provider.refused_parameter(status, info)
        negotiation = route.negotiation
        if parameter is not None and (negotiation.learn(parameter) or negotiation.version != sent_version):
            # Learned now, or by another call since this body was built: again without it.
            reservation.settle(None)  # refused before any work: not counted
            self._metrics.upstream_negotiated.labels(route.name, parameter.rsplit(".", 1)[-1]).inc()
            tracing.event("negotiated", {"ecoscan.parameter": parameter})
            return AttemptFailed(UpstreamRejected(), retry=True, reason="negotiated")
        log.error("upstream %s rejected %s call with %d: %s", route.name, call.stage, status, message)
        return AttemptFailed(UpstreamRejected(), retry=False, reason=status_class)

    def _observe(
        self,
        route: Route,
        call: ChatCall,
        response: aiohttp.ClientResponse,
        status: str,
        reservation: Reservation,
    ) -> None:
        self._count(call, status)
        if not route.provider.rate_headers:
            return
        limits = ratelimit_headers(response.raw_headers)
        route.budget.observe_headers(limits, sent=reservation.sent, charged=status != "429")
        for resource in ("requests", "tokens"):
            raw = limits.get(f"x-ratelimit-remaining-{resource}")
            if raw is not None and raw.isdigit():
                self._metrics.ratelimit_remaining.labels(call.model, resource).set(int(raw))

    def _count(self, call: ChatCall, status: str) -> None:
        self._metrics.upstream_calls.labels(call.model, ENDPOINT, status).inc()
