"""Health from our own probes: while a deployment's breaker is open, the service itself
asks it the cheapest question it answers (a one-token completion with the deployment's
model), on its own schedule, and closes the breaker on the first answer. Users' calls
never probe (`Breaker.ready` is closed only), so a deployment that comes back is found
within one probe interval however long it was down (the breaker's cooldown: `UPSTREAM_OPEN_S`,
doubling per failed probe up to `UPSTREAM_PROBE_MAX_S`), and a call with nowhere else to
go waits for that return (`wait_for_return`) instead of spending its attempts.

A probe is a call like any other to the provider: its reservation comes from the
deployment's budget and settles to what the limiter counted; a budget that cannot take
it soon skips the round. With REDIS_URL one replica at a time probes a deployment (the
claim of app/upstream/shared_breaker.py); a verdict reaches the others through Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Iterable, Mapping, Sequence

import aiohttp
import orjson

from app.limits.clock import Clock
from app.limits.rate_budget import BudgetDeadlineExceeded, Reservation
from app.runtime.metrics import Metrics
from app.upstream.breaker import (
    CLOSED,
    CREDENTIAL_REASON,
    CREDENTIAL_RETRY_S,
    OUT_RETRY_S,
    QUOTA_COOLDOWN_S,
    Breaker,
)
from app.upstream.call import AttemptFailed, ChatRequest, ChatResult
from app.upstream.credentials import CredentialUnavailable
from app.upstream.routes import Route
from app.upstream.shared_breaker import SharedBreakers
from app.upstream.wire import error_body, read_completion

log = logging.getLogger(__name__)

# The longest one probe may take, connect to reply: a deployment that holds it is still down.
PROBE_TIMEOUT_S = 5.0
# How long a probe may wait for its budget; past it, the round is skipped.
PROBE_BUDGET_WAIT_S = 1.0
# With every breaker closed, the prober looks again at least this often (it is woken
# at once when one opens).
IDLE_S = 1.0
# The shortest pause between two looks (a breaker due now is probed now).
MIN_PAUSE_S = 0.01
PROBE_MESSAGES = [{"role": "user", "content": "ping"}]


def _verdict_of_status(
    status: int, body: bytes, route: Route, headers: Mapping[str, str]
) -> tuple[str, float | None]:
    """What a probe's reply says of the deployment: `ok` (it answered, a refusal of the
    request included), `out` (a key, a deployment or a quota), or the failure's reason,
    with the wait it asked for."""
    if 200 <= status < 300:
        return "ok", None
    provider = route.provider
    info = provider.error_info(error_body(body))
    wait_s = provider.wait_hint(headers, info)
    if status == 429:
        return ("quota" if info.code == "insufficient_quota" else "429"), wait_s
    if status in (401, 403, 404):
        return "out", None
    if status >= 500 or status in (408, 409):
        return f"{status // 100}xx", wait_s
    return "ok", None  # a 4xx about the request: the deployment is up and answering


class Prober:
    """Probes every deployment whose breaker is open, one probe at a time each."""

    def __init__(
        self,
        routes: Iterable[Route],
        clock: Clock,
        metrics: Metrics,
        *,
        shared: SharedBreakers | None = None,
        timeout_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        self._routes: dict[Breaker, Route] = {}
        for route in routes:  # one route per deployment: its first model asks
            self._routes.setdefault(route.breaker, route)
        self._clock = clock
        self._metrics = metrics
        self._shared = shared
        self._timeout_s = timeout_s
        self._kick = asyncio.Event()
        self._probes: dict[Breaker, asyncio.Task[None]] = {}
        self._skipped_until: dict[Breaker, float] = {}  # no probe before then: its budget was full
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="upstream-probes")

    async def aclose(self) -> None:
        tasks = [t for t in (self._task, *self._probes.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for breaker in self._routes:
            breaker.unwatch_open(self._kick.set)

    async def _run(self) -> None:
        while True:
            self._kick.clear()
            now = self._clock.now()
            pause = IDLE_S
            for breaker, route in self._routes.items():
                breaker.watch_open(self._kick.set)  # once per opening: set again each look
                if breaker.state == CLOSED or breaker in self._probes:
                    continue
                skipped_until = self._skipped_until.get(breaker, 0.0)
                if skipped_until > now:  # its budget had no room for the last probe
                    pause = min(pause, skipped_until - now)
                    continue
                if breaker.would_probe(now):
                    task = asyncio.create_task(self._probe(route), name=f"probe-{route.name}")
                    self._probes[breaker] = task
                    task.add_done_callback(functools.partial(self._ended, breaker))
                elif breaker.open_until > now:  # its next probe is due then
                    pause = min(pause, breaker.open_until - now)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(MIN_PAUSE_S, pause)):
                    await self._kick.wait()

    def _ended(self, breaker: Breaker, _task: asyncio.Task[None]) -> None:
        self._probes.pop(breaker, None)
        self._kick.set()  # its verdict may have set a new cooldown: look again

    async def _probe(self, route: Route) -> None:
        breaker = route.breaker
        if self._shared is not None:
            wait_s = await self._shared.claim_probe(breaker)
            if wait_s is not None:  # another replica probes it, or Redis knows a longer cooldown
                breaker.probed_elsewhere(self._clock.now(), wait_s)
                return
            if breaker.state == CLOSED:  # closed on another replica's word meanwhile
                self._shared.probe_ended(breaker)
                return
        probe = breaker.begin(self._clock.now())
        if not probe:
            if self._shared is not None:
                self._shared.probe_ended(breaker)
            return
        try:
            outcome = await self._ask(route)
        except Exception:  # a bug must not leave the deployment unprobed for good
            log.exception("upstream %s: the probe failed", route.name)
            outcome = "error"
        finally:
            # No verdict (cancelled, skipped for the budget): the next round probes again.
            breaker.released(probe)
        if outcome == "skipped":
            # The budget refuses at once when its predicted wait is too long: without a pause
            # the next round would ask again at once, and again (a busy loop on the loop).
            self._skipped_until[breaker] = self._clock.now() + PROBE_BUDGET_WAIT_S
        else:
            self._skipped_until.pop(breaker, None)
        self._metrics.upstream_probes.labels(route.name, outcome).inc()

    async def _ask(self, route: Route) -> str:
        """Send one probe and tell the breaker what it found; returns the outcome."""
        breaker, budget = route.breaker, route.budget
        prompt = route.estimate(ChatRequest(route.stage, PROBE_MESSAGES))
        tokens = route.provider.limiter_tokens(prompt, 1)
        try:
            reservation = await budget.reserve(tokens, deadline=self._clock.now() + PROBE_BUDGET_WAIT_S)
        except BudgetDeadlineExceeded:  # no room now: the next try is PROBE_BUDGET_WAIT_S away (_probe)
            return "skipped"
        body = route.adapt({"model": route.model, "messages": PROBE_MESSAGES, route.shape.token_param: 1})
        sent_at = self._clock.now()
        try:
            verdict, wait_s = await self._send(route, orjson.dumps(body), reservation)
        finally:
            reservation.settle(reservation.tokens)  # unless settled already: spent as reserved
        now = self._clock.now()
        if verdict == "ok":
            breaker.succeeded(now, sent_at)
        elif verdict == "out":
            breaker.take_out(now, "probe refused: a key or a deployment", OUT_RETRY_S)
        elif verdict == "quota":
            breaker.take_out(now, "insufficient_quota", QUOTA_COOLDOWN_S)
        elif verdict == "credential":
            breaker.take_out(now, CREDENTIAL_REASON, CREDENTIAL_RETRY_S)
        else:
            breaker.failed(now, verdict, wait_s, sent_at=sent_at)
        return "ok" if verdict == "ok" else "failed"

    async def _send(self, route: Route, body: bytes, reservation: Reservation) -> tuple[str, float | None]:
        response: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await route.endpoint.post(body)
                content = await response.read()
        except TimeoutError:
            return "timeout", None
        except CredentialUnavailable as exc:
            log.error("upstream %s: the probe has no credential: %s", route.name, exc)
            reservation.settle(None)  # never sent
            return "credential", None
        except aiohttp.ClientConnectorError:
            reservation.settle(None)  # never sent: not counted
            return "connection", None
        except aiohttp.ClientError:
            return "connection", None
        finally:
            if response is not None:
                response.release()
        verdict, wait_s = _verdict_of_status(response.status, content, route, response.headers)
        if response.status == 401 and route.endpoint.credential is not None:
            # A token refused at the probe alone (revoked, a skewed clock): the next probe
            # asks for a new one instead of resending it until its planned refresh.
            route.endpoint.credential.refused(response.request_info.headers)
        if response.status == 429:
            reservation.settle(None)  # a 429 is not counted by the limiter
        elif verdict == "ok" and response.status < 300:
            reservation.settle(self._charged(route, reservation, content))
        return verdict, wait_s

    @staticmethod
    def _charged(route: Route, reservation: Reservation, content: bytes) -> int:
        """What the provider's limiter counted for the probe's reply."""
        try:
            usage = read_completion(content, ChatResult())
        except AttemptFailed:
            usage = None
        if usage is None:
            return reservation.tokens
        return route.provider.limiter_settles(reservation.tokens, usage[0], usage[1])


async def wait_for_return(routes: Sequence[Route], timeout_s: float) -> bool:
    """Wait until one of `routes`' breakers closes (True), or `timeout_s` passes (False)."""
    if any(r.breaker.state == CLOSED for r in routes):
        return True
    if timeout_s <= 0 or all(r.breaker.out for r in routes):
        return False
    back = asyncio.Event()
    breakers = {r.breaker for r in routes}
    for breaker in breakers:
        breaker.watch_closed(back.set)
    try:
        async with asyncio.timeout(timeout_s):
            await back.wait()
        return True
    except TimeoutError:
        return False
    finally:
        for breaker in breakers:
            breaker.unwatch_closed(back.set)
