"""Every model call's path, from the list of calling stages and the deployments: a gate per
calling stage, a route per deployment and stage it serves (app/upstream/routes.py), one
budget per limit group and model, one breaker per deployment and one connection pool per
deployment and model, the retry policy, hedging and the probes. Without `OPENAI_API_KEY`
or `UPSTREAMS`, the built-in simulator is started here, the one deployment."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any

from app.assembly import gauges
from app.assembly.closing import bounded_close
from app.limits.adaptive import AdaptiveLimit
from app.limits.charge_learning import ChargeLearner
from app.limits.clock import Clock
from app.limits.late_timeouts import LateTimeouts
from app.limits.rate_budget import RateBudget
from app.limits.retry import RetryPolicy
from app.limits.route_limits import RouteLimit
from app.limits.shared_budget import SharedRateBudget, holder_name
from app.limits.sizing import GATE_FLOOR, INITIAL_GATE_LIMIT, PRIOR_LATENCY_S
from app.limits.stage_gate import StageGate
from app.runtime.box import BoxLimits
from app.runtime.loop_lag import LoopLateness
from app.runtime.metrics import Metrics
from app.runtime.redaction import redact_url
from app.runtime.redis_link import RedisLink
from app.settings import Settings, SettingsError
from app.stages.base import CallingStageClass, StageClass
from app.upstream.affinity import PrefixAffinity
from app.upstream.breaker import Breaker
from app.upstream.client import Upstream
from app.upstream.credentials import Credential
from app.upstream.deployments import Deployment, DeploymentError, check_deployments, with_key
from app.upstream.endpoint import ChatEndpoint
from app.upstream.hedging import HedgeBudget, HedgePolicy
from app.upstream.negotiation import Negotiation
from app.upstream.probes import Prober
from app.upstream.profiles import DEFAULT_PROFILE, profile_for
from app.upstream.providers import PROVIDERS
from app.upstream.routes import Route, Router
from app.upstream.shared_breaker import SharedBreakers
from app.upstream.stage_call import StageCall

log = logging.getLogger("app")

UPSTREAM_KEEPALIVE_S = 5.0  # an idle connection is closed after this long


def stage_calls(settings: Settings, stages: Sequence[StageClass]) -> dict[str, StageCall]:
    """Every calling stage's call as set, in stage order."""
    calls = {
        stage.name: settings.stage_call(stage.call)
        for stage in stages
        if isinstance(stage, CallingStageClass)
    }
    for name in settings.stage_calls_named():  # a typo would leave its stage at its defaults
        if name not in calls:
            raise SettingsError(
                f"STAGE_CALLS {name}: no calling stage of that name (the calling stages: {', '.join(calls)})"
            )
    return calls


async def build_upstream(
    settings: Settings,
    calls: Mapping[str, StageCall],
    metrics: Metrics,
    clock: Clock,
    redis: RedisLink | None,
    stack: AsyncExitStack,
    box: BoxLimits,
    lateness: LoopLateness,
) -> tuple[Upstream, str, Any]:
    """The `Upstream` every stage calls through; also the first deployment's URL and the
    simulator, when it runs."""
    deployments, simulator = await _deployments(settings, calls, stack)
    gates = {stage: _gate(call, box) for stage, call in calls.items()}
    parts = _RouteParts(settings, metrics, clock, redis, stack, gates)
    routes = [route for d in deployments for route in parts.routes(d, calls)]
    shared = _shared_breakers(parts.breakers, redis, metrics, clock, stack)
    upstream = Upstream(
        Router(
            routes,
            clock,
            spill_after_s=settings.max_budget_wait_s,
            affinity=PrefixAffinity(clock=clock.now) if settings.upstream_cache_affinity else None,
        ),
        gates=gates,
        retry=RetryPolicy(
            max_attempts=settings.retry_max_attempts,
            base_delay_s=settings.retry_base_delay_s,
            max_delay_s=settings.retry_max_delay_s,
        ),
        metrics=metrics,
        clock=clock,
        negotiation_wait_s=settings.negotiation_wait_s,
        ride_out_s=settings.upstream_ride_out_s,
        hedging=HedgePolicy(
            settings.hedge_factor,
            settings.hedge_min_s,
            settings.hedge_max_s,
            HedgeBudget(settings.hedge_budget),
        ),
        late_timeouts=LateTimeouts(
            lateness, lambda stage, cause: metrics.upstream_timeouts.labels(stage, cause).inc()
        ),
    )
    gauges.bind_budgets(metrics, upstream.budgets)
    gauges.bind_upstream(metrics, upstream)
    # The breakers' probes: the service's own requests, never a user's call.
    prober = Prober(routes, clock, metrics, shared=shared)
    prober.start()
    stack.push_async_callback(bounded_close, "upstream probes", prober.aclose)
    return upstream, deployments[0].base_url, simulator


class _RouteParts:
    """What routes share, made once: a breaker per deployment, a budget per limit group and
    model, a connection pool and a negotiation per deployment and model."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        clock: Clock,
        redis: RedisLink | None,
        stack: AsyncExitStack,
        gates: Mapping[str, StageGate],
    ) -> None:
        self._settings, self._metrics, self._clock = settings, metrics, clock
        self._redis, self._stack, self._gates = redis, stack, gates
        self.budgets: dict[str, RateBudget] = {}
        self.breakers: dict[str, Breaker] = {}
        self._endpoints: dict[tuple[str, str], ChatEndpoint] = {}
        self._negotiations: dict[tuple[str, str], Negotiation] = {}

    def routes(self, d: Deployment, calls: Mapping[str, StageCall]) -> list[Route]:
        """One route per calling stage `d` names a model for."""
        s = self._settings
        provider = PROVIDERS[d.provider]
        credential = provider.credential(d)  # one per deployment: its token, if it has one
        self._stack.push_async_callback(bounded_close, f"credential of {d.name}", credential.aclose)
        breaker = self.breakers[d.health_id()] = Breaker(
            d.name, open_base_s=s.upstream_open_s, open_max_s=s.upstream_probe_max_s
        )
        gauges.bind_breaker(self._metrics, d.name, breaker)
        routes = []
        for stage, call in calls.items():
            model = d.model_for(stage)
            if model is None:
                continue
            key = d.budget_key(model)
            if key not in self.budgets:
                self.budgets[key] = self._budget(key, (d.rpm, d.tpm), provider.rate_headers)
            if (d.name, model) not in self._endpoints:
                self._connect(d, model, credential)
            shape = call.shape(model=model, token_param=d.token_param or s.openai_token_param)
            endpoint, negotiation = self._endpoints[(d.name, model)], self._negotiations[(d.name, model)]
            limit = _route_limit(self._gates[stage])
            routes.append(
                Route(d, provider, stage, shape, endpoint, self.budgets[key], breaker, negotiation, limit)
            )
        return routes

    def _connect(self, d: Deployment, model: str, credential: Credential) -> None:
        s, provider = self._settings, PROVIDERS[d.provider]
        endpoint = ChatEndpoint.open(
            provider.chat_url(d, model),
            credential,
            connect_timeout_s=s.openai_connect_timeout_s,
            read_timeout_s=s.openai_read_timeout_s,  # also the longest gap in a stream
            # One connection per call in progress: as many as the gates of the stages it
            # serves may ever let through.
            max_connections=sum(g.ceiling for st, g in self._gates.items() if d.model_for(st) == model),
            keepalive_s=UPSTREAM_KEEPALIVE_S,
        )
        self._stack.push_async_callback(bounded_close, f"connections to {d.name}", endpoint.aclose)
        self._endpoints[(d.name, model)] = endpoint
        # A provider we know serving a model its profile describes: what it takes is
        # known; any other (a compatible server, a model we do not know) is found out.
        known = d.provider != "compatible" and profile_for(model) is not DEFAULT_PROFILE
        self._negotiations[(d.name, model)] = Negotiation(f"{d.name}/{model}", settled=known)

    def _budget(self, key: str, limits: tuple[int, int], rate_headers: bool) -> RateBudget:
        """The budget of one limit group and model (`key`); with REDIS_URL, one for every
        replica (app/limits/shared_budget.py)."""
        s, metrics, clock = self._settings, self._metrics, self._clock
        (rpm, tpm), fraction = limits, s.rate_burst_fraction
        budget: RateBudget
        if self._redis is None:
            budget = RateBudget(rpm=rpm, tpm=tpm, burst_fraction=fraction, clock=clock, name=key)
        else:
            on_call = functools.partial(_count_redis_call, metrics, key)
            shared = SharedRateBudget(
                self._redis, rpm=rpm, tpm=tpm, burst_fraction=fraction, clock=clock, name=key, on_call=on_call
            )
            shared.start()
            self._stack.push_async_callback(bounded_close, f"shared budget {key}", shared.aclose)
            gauges.bind_shared_budget(metrics, key, shared)
            budget = shared
        budget.charges = ChargeLearner(s.charge_learning_config(), headers=rate_headers)
        return budget


def _count_redis_call(metrics: Metrics, model: str, op: str, seconds: float) -> None:
    metrics.budget_redis_calls.labels(model, op).inc()
    if op != "error":
        metrics.budget_redis_call_seconds.labels(model).observe(seconds)


def _shared_breakers(
    breakers: Mapping[str, Breaker],
    redis: RedisLink | None,
    metrics: Metrics,
    clock: Clock,
    stack: AsyncExitStack,
) -> SharedBreakers | None:
    """With REDIS_URL, every replica's breakers as one (app/upstream/shared_breaker.py)."""
    if redis is None:
        return None
    shared = SharedBreakers(
        redis, breakers, clock, holder=holder_name(), on_error=metrics.breaker_redis_errors.inc
    )
    shared.start()
    stack.push_async_callback(bounded_close, "shared breakers", shared.aclose)
    metrics.breakers_shared.set_function(lambda: 1 if shared.shared else 0)
    return shared


def _gate(call: StageCall, box: BoxLimits) -> StageGate:
    """A stage's gate: fixed at its call's concurrency (`<STAGE>_CONCURRENCY`), or sized
    (app/limits/sizing.py)."""
    stage, spec = call.stage, call.concurrency
    if spec.fixed is not None:
        return StageGate(stage, spec.fixed)
    limiter = _sized_limit(spec.ceiling(box.scans))
    gate = StageGate(stage, limiter.limit)
    gate.limiter = limiter
    return gate


def _route_limit(gate: StageGate) -> RouteLimit:
    """A route's own limit (app/limits/route_limits.py): as its stage's gate would be sized
    alone, up to the gate's ceiling (a fixed gate's number)."""
    return RouteLimit(_sized_limit(gate.ceiling))


def _sized_limit(ceiling: int) -> AdaptiveLimit:
    """A limit sized by the latency it sees, from `INITIAL_GATE_LIMIT` up to `ceiling`."""
    return AdaptiveLimit(
        floor=min(GATE_FLOOR, ceiling),
        ceiling=ceiling,
        prior_latency_s=PRIOR_LATENCY_S,
        initial=INITIAL_GATE_LIMIT,
    )


async def _deployments(
    settings: Settings, calls: Mapping[str, StageCall], stack: AsyncExitStack
) -> tuple[tuple[Deployment, ...], Any]:
    """UPSTREAMS' deployments with their keys (every calling stage served by one), or the
    one the OPENAI_* settings describe (the built-in simulator's, without OPENAI_API_KEY),
    running each calling stage's own model."""
    listed = settings.deployments()
    if listed is not None:
        try:
            keyed = tuple(with_key(d, os.environ) for d in listed)
            check_deployments(keyed, tuple(calls))
        except DeploymentError as exc:
            raise SettingsError(f"UPSTREAMS: {exc}") from None
        for d in keyed:  # a typo in `models` would otherwise serve less than written, silently
            for stage in (s for s, _ in d.models if s not in calls):
                raise SettingsError(
                    f"UPSTREAMS: deployment {d.name!r}: models: {stage!r} is not a calling stage "
                    f"(the calling stages: {', '.join(calls)})"
                )
        for d in keyed:
            served = ", ".join(f"{s} by {m}" for s, m in d.models)
            log.info(
                "upstream %s: %s at %s (%s; limit group %s)",
                d.name,
                d.provider,
                redact_url(d.base_url),
                served,
                d.limit_group,
            )
        return keyed, None
    base_url, api_key, simulator = await _upstream_endpoint(settings, stack)
    implicit = Deployment(
        name="simulator" if simulator is not None else "openai",
        provider="openai",
        base_url=base_url,
        rpm=settings.openai_rpm,
        tpm=settings.openai_tpm,
        models=tuple((stage, call.model) for stage, call in calls.items()),
        api_key=api_key or None,
    )
    return (implicit,), simulator


async def _upstream_endpoint(settings: Settings, stack: AsyncExitStack) -> tuple[str, str, Any]:
    if not settings.uses_simulator:
        url = settings.openai_base_url or "https://api.openai.com/v1"
        log.info("upstream: OpenAI-compatible API at %s", redact_url(url))
        return url, settings.openai_api_key or "", None
    # The simulator is a development stand-in: imported only when it runs.
    from app.sim.config import SimConfig
    from app.sim.server import run_simulator

    try:
        config = SimConfig.from_env(dict(settings.simulator_env))
    except ValueError as exc:
        raise SettingsError(f"SIM_* variables: {exc}") from None
    simulator = await stack.enter_async_context(run_simulator(config))
    log.warning(
        "upstream: built-in OpenAI SIMULATOR at %s (set OPENAI_API_KEY, and OPENAI_BASE_URL for a "
        "compatible server, to use a real one; SIM_* variables tune the simulator)",
        simulator.base_url,
    )
    return simulator.base_url, "sim-key", simulator
