"""The lifespan: the one place that creates every resource and closes it again, in
reverse order. Nothing is created at import time; routes reach these through
`Resources`, handed to them via the ASGI lifespan state.

Embedded defaults: without `DATABASE_URL` an embedded PostgreSQL is started;
without `OPENAI_API_KEY` the OpenAI simulator runs inside this process on a
loopback port. Both are logged loudly, with how to switch to the real thing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg

from app.db.characters import Collections
from app.db.embedded import EmbeddedPostgres
from app.db.migrations import apply_migrations, bundled_migrations
from app.db.pool import create_pool, pool_size, tagged_dsn
from app.db.taxonomy import Taxonomy, load_taxonomy
from app.images.limits import ImageLimits
from app.intake.acceptance import ScanAcceptance
from app.intake.body_reader import BodyBudget, BodyReader
from app.intake.identity import Authenticator
from app.intake.parsing import InputLimits
from app.limits.adaptive import AdaptiveLimit
from app.limits.admission import Admission
from app.limits.charge_learning import KINDS, ChargeLearner
from app.limits.clock import Clock, MonotonicClock
from app.limits.cpu_lane import CpuLane
from app.limits.late_timeouts import LateTimeouts
from app.limits.loop_capacity import LoopCapacity
from app.limits.loop_pacer import LoopPacer
from app.limits.rate_budget import RateBudget
from app.limits.retry import RetryPolicy
from app.limits.route_limits import RouteLimit, RouteSizing
from app.limits.shared_budget import SharedRateBudget, holder_name
from app.limits.shared_user_caps import SharedUserCaps
from app.limits.sizing import (
    ADMISSION_FLOOR,
    GATE_FLOOR,
    INITIAL_GATE_LIMIT,
    PRIOR_LATENCY_S,
    Sizing,
)
from app.limits.stage_gate import StageGate
from app.limits.user_quota import UserQuota, windows
from app.runtime.box import BoxLimits, box_limits
from app.runtime.loop_lag import LoopLateness, probe_loop_lag
from app.runtime.metrics import Metrics
from app.runtime.redaction import redact_url
from app.runtime.redis_link import RedisLink
from app.scans.drain import Drain
from app.scans.followers import FollowerCaps
from app.scans.housekeeping import purge_old_scans, sweep_lost_scans
from app.scans.liveness import Liveness, leased_instances
from app.scans.mirror import FOLLOW_MAX_CONNECTIONS, ScanStreams
from app.scans.pipeline import ScanPipeline
from app.scans.runner import StageRunner
from app.scans.store import ScanStore
from app.settings import Settings, SettingsError
from app.stages.base import BudgetedStage, Stage, StageClass, StageEnv, StageResult
from app.stages.order import STAGES
from app.streaming.access import ScanAccess
from app.upstream.affinity import PrefixAffinity
from app.upstream.breaker import Breaker
from app.upstream.client import Upstream
from app.upstream.deployments import Deployment, DeploymentError, with_key
from app.upstream.endpoint import ChatEndpoint
from app.upstream.hedging import HedgeBudget, HedgePolicy
from app.upstream.negotiation import Negotiation
from app.upstream.probes import Prober
from app.upstream.profiles import DEFAULT_PROFILE, profile_for
from app.upstream.providers import PROVIDERS
from app.upstream.routes import Route, Router
from app.upstream.shared_breaker import SharedBreakers

log = logging.getLogger("app")

UPSTREAM_KEEPALIVE_S = 5.0  # an idle connection is closed after this long

# Each close on the way out (pool, client, listener...) gets this long; the whole exit
# stays well inside the drain's share of a 30 s termination grace.
CLOSE_TIMEOUT_S = 5.0

# How often every process looks for `running` rows of processes that died.
LOST_SCAN_SWEEP_S = 30.0
# How often scans older than SCAN_RETENTION_DAYS are purged (in bounded batches).
PURGE_INTERVAL_S = 3600.0


@dataclass
class Resources:
    settings: Settings
    metrics: Metrics
    pool: asyncpg.Pool[asyncpg.Record]
    taxonomy: Taxonomy
    cpu: CpuLane
    budgets: dict[str, RateBudget]
    gates: dict[str, StageGate]
    admission: Admission
    stages: list[Stage[StageResult]]
    store: ScanStore
    pipeline: ScanPipeline
    drain: Drain
    identity: Authenticator
    access: ScanAccess
    collections: Collections
    acceptance: ScanAcceptance
    input_limits: InputLimits
    upstream_base_url: str
    breakers: dict[str, Breaker]  # by deployment name, for /readyz
    redis: RedisLink | None = None  # REDIS_URL set: what replicas share (app/runtime/redis_link.py)
    simulator: Any = None  # app.sim.server.RunningSimulator when embedded


@asynccontextmanager
async def lifespan_resources(
    settings: Settings, metrics: Metrics | None = None, stages: Sequence[StageClass] = STAGES
) -> AsyncIterator[Resources]:
    metrics = metrics or Metrics()
    clock = MonotonicClock()
    instance_id = uuid.uuid4()
    box = box_limits()
    async with AsyncExitStack() as stack:
        dsn = tagged_dsn(await _database(settings, stack), instance_id)
        pool = await _pool(settings, dsn, stack)
        taxonomy = await _catalogue(pool)
        redis = await _redis_link(settings, stack)
        lateness = LoopLateness()  # the loop-lag probe's, for timeouts that fire late
        upstream, base_url, simulator = await _upstream(settings, metrics, clock, redis, stack, box, lateness)
        env = StageEnv(settings, pool, dsn, taxonomy, upstream, metrics, clock, stack)
        built = [await stage.start(env) for stage in stages]  # in order: each may load what it needs
        runner = StageRunner(built, metrics=metrics, clock=clock)
        user_caps = _shared_user_caps(redis, metrics, stack)
        admission = _admission(settings, _budget_look_ahead(built), runner.calls_per_scan, user_caps)
        cpu_queue = settings.limit("cpu_queue_limit")
        cpu = CpuLane(
            max_workers=settings.cpu_max_workers,
            queue_limit=cpu_queue.fixed if cpu_queue.fixed is not None else settings.cpu_max_workers,
        )
        cpu.observers.append(metrics.observe_cpu_job)
        stack.callback(cpu.shutdown)
        sizing = _sizing(settings, upstream, admission, cpu, metrics, box)
        _background(stack, sizing.run(), "limit-sizing")
        store = await _scan_store(settings, pool, instance_id, redis, metrics, stack)
        streams = _scan_streams(settings, redis, metrics, stack)
        pipeline = ScanPipeline(
            runner,
            store=store,
            metrics=metrics,
            scan_deadline_s=settings.scan_deadline_s,
            clock=clock,
            on_finished=admission.observe_scan_duration,
            disconnect_grace_s=settings.disconnect_grace_s,
            streams=streams,
        )
        # Runs first on the way out: scans the drain left (or all of them, when no
        # drain ran) end with SERVER_SHUTDOWN and record their rows while the pool,
        # the client and the simulator are still open.
        stack.push_async_callback(pipeline.cancel_all)
        _liveness(settings, redis, store, pipeline, streams, admission, metrics, stack)
        _background(stack, probe_loop_lag(metrics, lateness=lateness), "loop-lag-probe")
        _bind_gauges(metrics, upstream.budgets, upstream.gates, cpu, upstream, admission, store)
        _bind_limit_gauges(metrics, sizing, upstream.gates)
        input_limits = _input_limits(settings)
        identity = await _identity(settings, stack)
        acceptance = ScanAcceptance(
            admission=admission,
            cpu=cpu,
            store=store,
            pipeline=pipeline,
            limits=input_limits,
            bodies=_body_reader(settings, input_limits, metrics),
            identity=identity,
            metrics=metrics,
            idempotency_ttl_s=settings.idempotency_ttl_s,
            quota=_user_quota(settings, redis, metrics, stack),
            pacer=_loop_pacer(settings, admission, metrics, stack),
        )
        drain = Drain(pipeline, drain_s=settings.shutdown_drain_s)
        metrics.shutting_down.set_function(lambda: float(drain.draining))
        yield Resources(
            settings=settings,
            metrics=metrics,
            pool=pool,
            taxonomy=taxonomy,
            cpu=cpu,
            budgets=dict(upstream.budgets),
            gates=dict(upstream.gates),
            admission=admission,
            stages=built,
            store=store,
            pipeline=pipeline,
            drain=drain,
            identity=identity,
            access=ScanAccess(pipeline, store, metrics, ping_s=settings.sse_ping_s, streams=streams),
            collections=Collections(pool, timeout_s=settings.db_timeout_s),
            acceptance=acceptance,
            input_limits=input_limits,
            upstream_base_url=base_url,
            breakers={route.name: route.breaker for route in upstream.routes},
            redis=redis,
            simulator=simulator,
        )


async def _pool(settings: Settings, dsn: str, stack: AsyncExitStack) -> asyncpg.Pool[asyncpg.Record]:
    spec = settings.limit("db_pool_max")
    size = spec.fixed
    if size is None:
        size = await pool_size(
            dsn, min_size=settings.db_pool_min, cap=spec.cap, timeout_s=settings.db_timeout_s
        )
        log.info("database pool: up to %d connections (DB_POOL_MAX=auto)", size)
    pool = await create_pool(
        dsn, min_size=settings.db_pool_min, max_size=size, timeout_s=settings.db_timeout_s
    )
    stack.push_async_callback(_bounded_close, "database pool", pool.close, pool.terminate)
    return pool


async def _scan_store(
    settings: Settings,
    pool: asyncpg.Pool[asyncpg.Record],
    instance_id: uuid.UUID,
    redis: RedisLink | None,
    metrics: Metrics,
    stack: AsyncExitStack,
) -> ScanStore:
    """The scans table, and the sweep that records (and counts) scans of dead processes
    (with Redis, but those of instances in the liveness lease set: takeover's)."""
    store = ScanStore(pool, instance_id=instance_id, timeout_s=settings.db_timeout_s)
    stack.push_async_callback(store.close, CLOSE_TIMEOUT_S)
    spared = functools.partial(leased_instances, redis) if redis is not None else None
    sweep = sweep_lost_scans(store, metrics=metrics, interval_s=LOST_SCAN_SWEEP_S, spared=spared)
    _background(stack, sweep, "lost-scan-sweep")
    purge = purge_old_scans(store, retention_days=settings.scan_retention_days, interval_s=PURGE_INTERVAL_S)
    _background(stack, purge, "scan-purge")
    return store


async def _catalogue(pool: asyncpg.Pool[asyncpg.Record]) -> Taxonomy:
    """Migrations, then the taxonomy every stage may read (what one stage alone needs it
    loads in its own `start`)."""
    async with pool.acquire() as conn:
        applied = await apply_migrations(conn, bundled_migrations())
        # Pooled connections are not reset on release (app/db/pool.py): whatever session
        # state a migration's SQL left behind goes here, before scans use the connection.
        await conn.reset()
        if applied:
            log.info("migrations applied: %s", ", ".join(applied))
        return await load_taxonomy(conn)


def _budget(
    settings: Settings,
    key: str,
    limits: tuple[int, int],
    redis: RedisLink | None,
    metrics: Metrics,
    clock: Clock,
    stack: AsyncExitStack,
) -> RateBudget:
    """The budget of one limit group and model (`key`); with REDIS_URL, one for every
    replica (app/limits/shared_budget.py)."""
    rpm, tpm = limits
    fraction = settings.rate_burst_fraction
    if redis is None:
        return RateBudget(rpm=rpm, tpm=tpm, burst_fraction=fraction, clock=clock, name=key)
    shared = SharedRateBudget(
        redis,
        rpm=rpm,
        tpm=tpm,
        burst_fraction=fraction,
        clock=clock,
        name=key,
        on_call=functools.partial(_count_redis_call, metrics, key),
    )
    shared.start()
    stack.push_async_callback(_bounded_close, f"shared budget {key}", shared.aclose)
    metrics.budget_shared.labels(key).set_function(_reader(shared, "shared"))
    metrics.budget_share.labels(key).set_function(_reader(shared, "share"))
    return shared


def _count_redis_call(metrics: Metrics, model: str, op: str, seconds: float) -> None:
    metrics.budget_redis_calls.labels(model, op).inc()
    if op != "error":
        metrics.budget_redis_call_seconds.labels(model).observe(seconds)


async def _upstream(
    settings: Settings,
    metrics: Metrics,
    clock: Clock,
    redis: RedisLink | None,
    stack: AsyncExitStack,
    box: BoxLimits,
    lateness: LoopLateness,
) -> tuple[Upstream, str, Any]:
    """Every model call's path: a route per deployment and stage (app/upstream/routes.py),
    one budget per limit group and model, one breaker and connection pool per deployment,
    one gate per stage, the retry policy. Also the first deployment's URL and the
    simulator, when it runs."""
    deployments, simulator = await _deployments(settings, stack)
    gates = {stage: _gate(settings, stage, box) for stage in ("vision", "answer")}
    budgets: dict[str, RateBudget] = {}
    endpoints: dict[tuple[str, str], ChatEndpoint] = {}
    negotiations: dict[tuple[str, str], Negotiation] = {}
    routes: list[Route] = []
    breakers: dict[str, Breaker] = {}
    for d in deployments:
        provider = PROVIDERS[d.provider]
        credential = provider.credential(d)  # one per deployment: its token, if it has one
        stack.push_async_callback(_bounded_close, f"credential of {d.name}", credential.aclose)
        breaker = breakers[d.health_id()] = Breaker(
            d.name, open_base_s=settings.upstream_open_s, open_max_s=settings.upstream_probe_max_s
        )
        metrics.upstream_state.labels(d.name).set_function(breaker.gauge)
        for stage in ("vision", "answer"):
            model = d.model_for(stage)
            if model is None:
                continue
            key = d.budget_key(model)
            if key not in budgets:
                budgets[key] = _budget(settings, key, (d.rpm, d.tpm), redis, metrics, clock, stack)
                budgets[key].charges = ChargeLearner(
                    settings.charge_learning_config(), headers=provider.rate_headers
                )
            if (d.name, model) not in endpoints:
                endpoint = ChatEndpoint.open(
                    provider.chat_url(d, model),
                    credential,
                    connect_timeout_s=settings.openai_connect_timeout_s,
                    read_timeout_s=settings.openai_read_timeout_s,  # also the longest gap in a stream
                    # One connection per call in progress: as many as the gates of the
                    # stages it serves may ever let through.
                    max_connections=sum(g.ceiling for s, g in gates.items() if d.model_for(s) == model),
                    keepalive_s=UPSTREAM_KEEPALIVE_S,
                )
                stack.push_async_callback(_bounded_close, f"connections to {d.name}", endpoint.aclose)
                endpoints[(d.name, model)] = endpoint
                # A provider we know serving a model its profile describes: what it takes is
                # known; any other (a compatible server, a model we do not know) is found out.
                known = d.provider != "compatible" and profile_for(model) is not DEFAULT_PROFILE
                negotiations[(d.name, model)] = Negotiation(f"{d.name}/{model}", settled=known)
            shape = settings.call_shape(stage, model=model, token_param=d.token_param)
            routes.append(
                Route(
                    d,
                    provider,
                    stage,
                    shape,
                    endpoints[(d.name, model)],
                    budgets[key],
                    breaker,
                    negotiations[(d.name, model)],
                    _route_limit(gates[stage]),
                )
            )
    retry = RetryPolicy(
        max_attempts=settings.retry_max_attempts,
        base_delay_s=settings.retry_base_delay_s,
        max_delay_s=settings.retry_max_delay_s,
    )
    shared = _shared_breakers(breakers, redis, metrics, clock, stack)
    upstream = Upstream(
        Router(
            routes,
            clock,
            spill_after_s=settings.max_budget_wait_s,
            affinity=PrefixAffinity(clock=clock.now) if settings.upstream_cache_affinity else None,
        ),
        gates=gates,
        retry=retry,
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
    # The breakers' probes: the service's own requests, never a user's call.
    prober = Prober(routes, clock, metrics, shared=shared)
    prober.start()
    stack.push_async_callback(_bounded_close, "upstream probes", prober.aclose)
    return upstream, deployments[0].base_url, simulator


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
    stack.push_async_callback(_bounded_close, "shared breakers", shared.aclose)
    metrics.breakers_shared.set_function(lambda: 1 if shared.shared else 0)
    return shared


def _gate(settings: Settings, stage: str, box: BoxLimits) -> StageGate:
    """A stage's gate: fixed at `<STAGE>_CONCURRENCY`, or sized (app/limits/sizing.py)."""
    spec = settings.limit(f"{stage}_concurrency")
    if spec.fixed is not None:
        return StageGate(stage, spec.fixed)
    ceiling = spec.ceiling(box.scans)
    limiter = AdaptiveLimit(
        floor=min(GATE_FLOOR, ceiling),
        ceiling=ceiling,
        prior_latency_s=PRIOR_LATENCY_S,
        initial=INITIAL_GATE_LIMIT,
    )
    gate = StageGate(stage, limiter.limit)
    gate.limiter = limiter
    return gate


def _route_limit(gate: StageGate) -> RouteLimit:
    """A route's own limit (app/limits/route_limits.py): as its stage's gate would be sized
    alone, up to the gate's ceiling (a fixed gate's number)."""
    ceiling = gate.ceiling
    return RouteLimit(
        AdaptiveLimit(
            floor=min(GATE_FLOOR, ceiling),
            ceiling=ceiling,
            prior_latency_s=PRIOR_LATENCY_S,
            initial=INITIAL_GATE_LIMIT,
        )
    )


def _sizing(
    settings: Settings,
    upstream: Upstream,
    admission: Admission,
    cpu: CpuLane,
    metrics: Metrics,
    box: BoxLimits,
) -> Sizing:
    """The automatic limits' loop, set once now so the first scans meet sized limits."""
    gates = upstream.gates
    admission_spec, cpu_queue_spec = settings.limit("max_inflight_scans"), settings.limit("cpu_queue_limit")
    sizing = Sizing(
        gates=gates,
        gate_limits={stage: gate.limiter for stage, gate in gates.items() if gate.limiter is not None},
        routes=RouteSizing(
            upstream.router.by_stage,
            usable=upstream.router.usable,
            rate=upstream.route_rate,
            on_change=lambda route, stage, reason: metrics.upstream_limit_changes.labels(
                route, stage, reason
            ).inc(),
        ),
        stage_requests=lambda stage: upstream.requests.get(stage, 0),
        admission=admission,
        admission_spec=admission_spec,
        admission_ceiling=admission_spec.ceiling(box.scans),
        max_queue_s=settings.max_budget_wait_s,
        cpu=cpu,
        cpu_queue_spec=cpu_queue_spec,
        cpu_queue_ceiling=cpu_queue_spec.ceiling(box.scans),
        on_change=lambda limit, reason: metrics.limit_changes.labels(limit, reason).inc(),
    )
    cpu.observers.append(sizing.observe_cpu_job)
    sizing.step()
    return sizing


async def _deployments(settings: Settings, stack: AsyncExitStack) -> tuple[tuple[Deployment, ...], Any]:
    """UPSTREAMS' deployments with their keys, or the one the OPENAI_* settings describe
    (the built-in simulator's, without OPENAI_API_KEY)."""
    listed = settings.deployments()
    if listed is not None:
        try:
            keyed = tuple(with_key(d, os.environ) for d in listed)
        except DeploymentError as exc:
            raise SettingsError(f"UPSTREAMS: {exc}") from None
        for d in keyed:
            served = ", ".join(f"{s} by {d.model_for(s)}" for s in ("vision", "answer") if d.model_for(s))
            log.info(
                "upstream %s: %s at %s (%s; limit group %s)",
                d.name,
                d.provider,
                d.base_url,
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
        vision_model=settings.vision_model,
        answer_model=settings.answer_model,
        api_key=api_key or None,
    )
    return (implicit,), simulator


async def _redis_link(settings: Settings, stack: AsyncExitStack) -> RedisLink | None:
    """REDIS_URL's link, or None. An unreachable Redis does not stop the start: every
    user of the link falls back to its in-process behaviour until Redis answers."""
    if settings.redis_url is None:
        return None
    link = RedisLink(settings.redis_url, prefix=settings.redis_prefix, timeout_s=settings.redis_timeout_s)
    stack.push_async_callback(_bounded_close, "Redis link", link.close)
    if not await link.ping():
        log.warning("Redis at %s does not answer; starting with in-process fallbacks", redact_url(link.url))
    return link


def _scan_streams(
    settings: Settings, redis: RedisLink | None, metrics: Metrics, stack: AsyncExitStack
) -> ScanStreams | None:
    """Running scans' events mirrored to Redis, for any replica to follow (app/scans/mirror.py).
    Closed after `pipeline.cancel_all` (pushed later), so the last terminal events go out."""
    if redis is None:
        return None
    deadline_s, block_s = settings.scan_deadline_s, settings.sse_ping_s
    caps = FollowerCaps(
        per_user=settings.followers_max_per_user,
        per_scan=settings.followers_max_per_scan,
        total=FOLLOW_MAX_CONNECTIONS,
    )
    streams = ScanStreams(redis, metrics, scan_deadline_s=deadline_s, block_s=block_s, caps=caps)
    stack.push_async_callback(_bounded_close, "scan event streams", streams.close)
    return streams


def _liveness(
    settings: Settings,
    redis: RedisLink | None,
    store: ScanStore,
    pipeline: ScanPipeline,
    streams: ScanStreams | None,
    admission: Admission,
    metrics: Metrics,
    stack: AsyncExitStack,
) -> None:
    """This process's liveness lease and the takeover of dead processes' scans
    (app/scans/liveness.py). Stopped before `pipeline.cancel_all` (pushed earlier), so a
    draining process takes nothing over; its lease is given back on the way out."""
    if redis is None or streams is None:
        return
    liveness = Liveness(
        redis,
        store=store,
        pipeline=pipeline,
        streams=streams,
        admission=admission,
        metrics=metrics,
        ttl_s=settings.liveness_ttl_s,
        renew_s=settings.liveness_renew_s,
        takeover=settings.takeover,
    )
    stack.push_async_callback(_bounded_close, "liveness lease", liveness.close)
    _background(stack, liveness.run(), "liveness-lease")


async def _identity(settings: Settings, stack: AsyncExitStack) -> Authenticator:
    identity = Authenticator(settings)
    stack.push_async_callback(_bounded_close, "JWKS client", identity.aclose)
    await identity.prefetch()  # AUTH_JWKS_URL's keys before the first token (bounded; failures logged)
    return identity


def _budget_look_ahead(stages: Sequence[Stage[StageResult]]) -> Callable[[int], float]:
    """Admission's look at the budget: the first stage that can predict its wait (vision's,
    the call every new scan makes first); none, when no stage calls upstream."""
    for stage in stages:
        if isinstance(stage, BudgetedStage):
            return stage.predicted_budget_wait
    return lambda _owed_calls: 0.0


def _shared_user_caps(
    redis: RedisLink | None, metrics: Metrics, stack: AsyncExitStack
) -> SharedUserCaps | None:
    if redis is None:
        return None
    caps = SharedUserCaps(redis, on_error=metrics.user_caps_redis_errors.inc)
    metrics.user_caps_unreleased.set_function(lambda: float(caps.unreleased))
    caps.start()
    stack.push_async_callback(_bounded_close, "per-user caps", caps.aclose)
    return caps


def _user_quota(
    settings: Settings, redis: RedisLink | None, metrics: Metrics, stack: AsyncExitStack
) -> UserQuota | None:
    """USER_SCAN_RATE_PER_MIN / USER_DAILY_SCAN_QUOTA, shared through Redis when there is one."""
    limits = windows(settings.user_scan_rate_per_min, settings.user_daily_scan_quota)
    if not limits:
        return None
    quota = UserQuota(
        limits,
        link=redis,
        on_error=metrics.user_quota_redis_errors.inc,
        on_refused=lambda code: metrics.admission_rejected.labels(code).inc(),
    )
    stack.push_async_callback(_bounded_close, "per-user rate and quota", quota.aclose)
    return quota


def _admission(
    settings: Settings,
    predicted_budget_wait: Callable[[int], float],
    calls_per_scan: int,
    user_caps: SharedUserCaps | None,
) -> Admission:
    spec = settings.limit("max_inflight_scans")
    return Admission(
        max_inflight=spec.fixed if spec.fixed is not None else ADMISSION_FLOOR,  # sized at once: _sizing
        per_user=settings.max_inflight_per_user,
        wait_s=settings.admission_wait_s,
        max_budget_wait_s=settings.max_budget_wait_s,
        predicted_budget_wait=predicted_budget_wait,
        calls_per_scan=calls_per_scan,
        user_caps=user_caps,
    )


def _loop_pacer(
    settings: Settings, admission: Admission, metrics: Metrics, stack: AsyncExitStack
) -> LoopPacer | None:
    """The loop's capacity measured (not with LOOP_UTILISATION_TARGET=0), and new scans paced
    at the rate it takes with LOOP_PACING (else None)."""
    if not settings.loop_utilisation_target:
        return None
    capacity = LoopCapacity(
        target=settings.loop_utilisation_target,
        admitted=lambda: admission.admitted,
        on_change=lambda limit, reason: metrics.limit_changes.labels(limit, reason).inc(),
    )
    _background(stack, capacity.run(), "loop-capacity")
    metrics.loop_utilisation.set_function(_reader(capacity, "utilisation"))
    metrics.loop_cpu_share.set_function(_reader(capacity, "share"))
    metrics.loop_cpu_per_scan.set_function(_reader(capacity, "cpu_per_scan_s"))
    metrics.loop_saturated.set_function(lambda: float(capacity.saturated))
    if not settings.loop_pacing:
        return None
    metrics.limit.labels("loop_rate").set_function(lambda: float(capacity.limit))
    return LoopPacer(capacity)


def _body_reader(settings: Settings, limits: InputLimits, metrics: Metrics) -> BodyReader:
    reader = BodyReader(
        BodyBudget(settings.body_buffer_max_bytes, per_client=settings.body_buffer_max_bytes_per_client),
        limit=limits.max_body_bytes,
        timeout_s=settings.body_read_timeout_s,
        min_bytes_per_s=settings.body_min_bytes_per_s,
        gap_s=settings.body_gap_timeout_s,
    )
    metrics.body_bytes_buffered.set_function(_reader(reader.budget, "in_use"))
    return reader


def _input_limits(settings: Settings) -> InputLimits:
    image = ImageLimits(
        max_bytes=settings.image_max_bytes,
        max_pixels=settings.image_max_pixels,
        long_side=settings.image_long_side,
        jpeg_quality=settings.image_jpeg_quality,
    )
    return InputLimits(image=image, user_input_max_chars=settings.user_input_max_chars)


async def _database(settings: Settings, stack: AsyncExitStack) -> str:
    if settings.database_url is not None:
        log.info("database: DATABASE_URL (%s)", redact_url(settings.database_url))
        return settings.database_url
    embedded = EmbeddedPostgres(settings.embedded_pg_dir)
    dsn = await embedded.start()
    stack.push_async_callback(embedded.stop)
    log.warning(
        "database: EMBEDDED PostgreSQL in %s (set DATABASE_URL=postgresql://... to use a real server)",
        embedded.data_dir,
    )
    return dsn


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


def _bind_gauges(
    metrics: Metrics,
    budgets: Mapping[str, RateBudget],
    gates: Mapping[str, StageGate],
    cpu: CpuLane,
    upstream: Upstream,
    admission: Admission,
    store: ScanStore,
) -> None:
    """Gauges read live state at scrape time instead of being updated on every change."""
    for model, budget in budgets.items():
        metrics.budget_available.labels(model, "requests").set_function(_reader(budget, "available_requests"))
        metrics.budget_available.labels(model, "tokens").set_function(_reader(budget, "available_tokens"))
        metrics.budget_waiters.labels(model).set_function(_reader(budget, "waiting"))
        metrics.budget_limit.labels(model, "requests").set_function(_reader(budget, "effective_rpm"))
        metrics.budget_limit.labels(model, "tokens").set_function(_reader(budget, "effective_tpm"))
        for kind in KINDS:
            metrics.upstream_charge_ratio.labels(model, kind).set_function(
                functools.partial(budget.charges.ratio, kind)
            )
    for stage, gate in gates.items():
        metrics.semaphore_in_use.labels(stage).set_function(_reader(gate, "in_use"))
    for route in upstream.routes:
        metrics.upstream_limit.labels(route.name, route.stage).set_function(_reader(route.limit, "size"))
        metrics.upstream_in_use.labels(route.name, route.stage).set_function(_reader(route.limit, "active"))
    metrics.cpu_queue_depth.set_function(lambda: cpu.waiting)
    metrics.cpu_busy.set_function(lambda: cpu.busy)
    metrics.cpu_workers.set_function(lambda: cpu.max_workers)
    metrics.reservations_open.set_function(_reader(upstream, "reservations_open"))
    metrics.admission_in_use.set_function(_reader(admission, "in_flight"))
    metrics.admission_waiting.set_function(_reader(admission, "waiting"))
    metrics.scan_rows_deferred.set_function(_reader(store, "deferred"))


def _bind_limit_gauges(metrics: Metrics, sizing: Sizing, gates: Mapping[str, StageGate]) -> None:
    for name in sizing.limits():
        metrics.limit.labels(name).set_function(functools.partial(_limit_of, sizing, name))
    for stage, gate in gates.items():
        metrics.semaphore_waiting.labels(stage).set_function(_reader(gate, "waiting"))
        if (limiter := gate.limiter) is not None:
            for kind in ("latency", "baseline"):
                metrics.limit_latency.labels(stage, kind).set_function(_reader_or_zero(limiter, f"{kind}_s"))


def _limit_of(sizing: Sizing, name: str) -> float:
    return float(sizing.limits()[name])


def _reader_or_zero(obj: object, attribute: str) -> Callable[[], float]:
    return lambda: float(getattr(obj, attribute) or 0.0)


def _background(stack: AsyncExitStack, work: Coroutine[Any, Any, None], name: str) -> None:
    task = asyncio.create_task(work, name=name)
    stack.callback(task.cancel)


async def _bounded_close(
    what: str, close: Callable[[], Awaitable[Any]], force: Callable[[], Any] | None = None
) -> None:
    """Every close on the way out gets `CLOSE_TIMEOUT_S`; a database that hangs must not
    keep the process from exiting."""
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await close()
    except TimeoutError:
        log.warning("shutdown: closing the %s took over %.0f s; abandoned", what, CLOSE_TIMEOUT_S)
        if force is not None:
            force()


def _reader(obj: object, attribute: str) -> Callable[[], float]:
    return lambda: float(getattr(obj, attribute))
