"""The lifespan: the one place that creates every resource and closes it again, in
reverse order. Nothing is created at import time; routes reach these through
`Resources`, handed to them via the ASGI lifespan state.

This module is the order, in four steps: the stores (database, Redis), the model calls
and the stages that make them, the running of scans, and the intake. How each part is
made lives in app/assembly/ (upstream.py: the calls' path from the calling stages;
services.py: every other part; gauges.py: the metrics each reads).

Embedded defaults: without `DATABASE_URL` an embedded PostgreSQL is started;
without `OPENAI_API_KEY` the OpenAI simulator runs inside this process on a
loopback port. Both are logged loudly, with how to switch to the real thing.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg

from app.assembly import gauges, services
from app.assembly.closing import background, bounded_close
from app.assembly.upstream import build_upstream, stage_calls
from app.db.characters import Collections
from app.db.pool import tagged_dsn
from app.db.taxonomy import Taxonomy
from app.intake.acceptance import ScanAcceptance
from app.intake.identity import Authenticator
from app.intake.parsing import InputLimits
from app.limits.admission import Admission
from app.limits.clock import Clock, MonotonicClock
from app.limits.cpu_lane import CpuLane
from app.limits.rate_budget import RateBudget
from app.limits.stage_gate import StageGate
from app.runtime import tracing
from app.runtime.box import BoxLimits, box_limits
from app.runtime.loop_lag import LoopLateness, probe_loop_lag
from app.runtime.metrics import Metrics
from app.runtime.redis_link import RedisLink
from app.scans.drain import Drain
from app.scans.mirror import ScanStreams
from app.scans.pipeline import ScanPipeline
from app.scans.runner import StageRunner
from app.scans.store import ScanStore
from app.settings import Settings
from app.stages.base import BudgetedStage, Stage, StageClass, StageEnv, StageResult
from app.stages.order import STAGES
from app.streaming.access import ScanAccess
from app.upstream.breaker import Breaker
from app.upstream.client import Upstream


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


@dataclass(frozen=True)
class _Stores:
    dsn: str
    pool: asyncpg.Pool[asyncpg.Record]
    taxonomy: Taxonomy
    redis: RedisLink | None
    instance_id: uuid.UUID


@dataclass(frozen=True)
class _Scans:
    """What runs accepted scans: admission, the CPU lane, the store, the pipeline."""

    admission: Admission
    cpu: CpuLane
    store: ScanStore
    streams: ScanStreams | None
    pipeline: ScanPipeline


@asynccontextmanager
async def lifespan_resources(
    settings: Settings, metrics: Metrics | None = None, stages: Sequence[StageClass] = STAGES
) -> AsyncIterator[Resources]:
    metrics = metrics or Metrics()
    clock = MonotonicClock()
    box = box_limits()
    async with AsyncExitStack() as stack:
        stack.push_async_callback(
            bounded_close, "trace export", tracing.start(metrics, user_ids=settings.trace_user_id)
        )
        stores = await _stores(settings, stack)
        lateness = LoopLateness()  # the loop-lag probe's, for timeouts that fire late
        calls = stage_calls(settings, stages)
        upstream, base_url, simulator = await build_upstream(
            settings, calls, metrics, clock, stores.redis, stack, box, lateness
        )
        env = StageEnv(
            settings, stores.pool, stores.dsn, stores.taxonomy, upstream, metrics, clock, stack, calls
        )
        built = [await stage.start(env) for stage in stages]  # in order: each may load what it needs
        scans = await _scans(settings, built, upstream, stores, metrics, clock, box, stack)
        background(stack, probe_loop_lag(metrics, lateness=lateness), "loop-lag-probe")
        input_limits = services.input_limits(settings)
        identity = await services.identity(settings, stack)
        acceptance = ScanAcceptance(
            admission=scans.admission,
            cpu=scans.cpu,
            store=scans.store,
            pipeline=scans.pipeline,
            limits=input_limits,
            bodies=services.body_reader(settings, input_limits, metrics),
            identity=identity,
            metrics=metrics,
            idempotency_ttl_s=settings.idempotency_ttl_s,
            quota=services.user_quota(settings, stores.redis, metrics, stack),
            pacer=services.loop_pacer(settings, scans.admission, metrics, stack),
        )
        drain = Drain(scans.pipeline, drain_s=settings.shutdown_drain_s)
        metrics.shutting_down.set_function(lambda: float(drain.draining))
        yield Resources(
            settings=settings,
            metrics=metrics,
            pool=stores.pool,
            taxonomy=stores.taxonomy,
            cpu=scans.cpu,
            budgets=dict(upstream.budgets),
            gates=dict(upstream.gates),
            admission=scans.admission,
            stages=built,
            store=scans.store,
            pipeline=scans.pipeline,
            drain=drain,
            identity=identity,
            access=ScanAccess(
                scans.pipeline, scans.store, metrics, ping_s=settings.sse_ping_s, streams=scans.streams
            ),
            collections=Collections(stores.pool, timeout_s=settings.db_timeout_s),
            acceptance=acceptance,
            input_limits=input_limits,
            upstream_base_url=base_url,
            breakers={route.name: route.breaker for route in upstream.routes},
            redis=stores.redis,
            simulator=simulator,
        )


async def _stores(settings: Settings, stack: AsyncExitStack) -> _Stores:
    """The database (migrated, its taxonomy loaded) and Redis, before anything uses them."""
    instance_id = uuid.uuid4()
    dsn = tagged_dsn(await services.database(settings, stack), instance_id)
    pool = await services.pool(settings, dsn, stack)
    taxonomy = await services.catalogue(pool)
    redis = await services.redis_link(settings, stack)
    return _Stores(dsn, pool, taxonomy, redis, instance_id)


async def _scans(
    settings: Settings,
    built: list[Stage[StageResult]],
    upstream: Upstream,
    stores: _Stores,
    metrics: Metrics,
    clock: Clock,
    box: BoxLimits,
    stack: AsyncExitStack,
) -> _Scans:
    """The stages' runner, admission (looking ahead at the budget), the CPU lane, the
    limits' sizing, the scans table, the mirror and the pipeline, with takeover."""
    runner = StageRunner(built, metrics=metrics, clock=clock)
    redis = stores.redis
    user_caps = services.shared_user_caps(redis, metrics, stack)
    admission = services.admission(settings, _budget_look_ahead(built), runner.calls_per_scan, user_caps)
    cpu = services.cpu_lane(settings, metrics, stack)
    sizing = services.sizing(settings, upstream, admission, cpu, metrics, box)
    background(stack, sizing.run(), "limit-sizing")
    store = await services.scan_store(settings, stores.pool, stores.instance_id, redis, metrics, stack)
    streams = services.scan_streams(settings, redis, metrics, stack)
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
    # Runs first on the way out: scans the drain left (or all of them, when no drain ran)
    # end with SERVER_SHUTDOWN and record their rows while the pool, the client and the
    # simulator are still open.
    stack.push_async_callback(pipeline.cancel_all)
    services.liveness(settings, redis, store, pipeline, streams, admission, metrics, stack)
    gauges.bind_scans(metrics, cpu, admission, store)
    gauges.bind_limits(metrics, sizing)
    return _Scans(admission, cpu, store, streams, pipeline)


def _budget_look_ahead(stages: Sequence[Stage[StageResult]]) -> Callable[[int], float]:
    """Admission's look at the budget: the first stage that can predict its wait (vision's,
    the call every new scan makes first); none, when no stage calls upstream."""
    for stage in stages:
        if isinstance(stage, BudgetedStage):
            return stage.predicted_budget_wait
    return lambda _owed_calls: 0.0
