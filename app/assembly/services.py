"""The service's parts besides the upstream, one builder each, in the lifespan's words:
the database (embedded or not), its pool, migrations and taxonomy, the scans table and
its sweeps, Redis and what replicas share through it, admission and the limits' sizing,
the loop's pacing, identity and the request's limits. Each registers its own close on
the lifespan's stack."""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack

import asyncpg

from app.assembly import gauges
from app.assembly.closing import CLOSE_TIMEOUT_S, background, bounded_close
from app.db.embedded import EmbeddedPostgres
from app.db.migrations import apply_migrations, bundled_migrations
from app.db.pool import create_pool, pool_size
from app.db.taxonomy import Taxonomy, load_taxonomy
from app.images.limits import ImageLimits
from app.intake.body_reader import BodyBudget, BodyReader
from app.intake.identity import Authenticator
from app.intake.parsing import InputLimits
from app.limits.admission import Admission
from app.limits.cpu_lane import CpuLane
from app.limits.loop_capacity import LoopCapacity
from app.limits.loop_pacer import LoopPacer
from app.limits.route_limits import RouteSizing
from app.limits.shared_user_caps import SharedUserCaps
from app.limits.sizing import ADMISSION_FLOOR, Sizing
from app.limits.user_quota import UserQuota, windows
from app.runtime.box import BoxLimits
from app.runtime.metrics import Metrics
from app.runtime.redaction import redact_url
from app.runtime.redis_link import RedisLink
from app.scans.followers import FollowerCaps
from app.scans.housekeeping import purge_old_scans, sweep_lost_scans
from app.scans.liveness import Liveness, leased_instances
from app.scans.mirror import FOLLOW_MAX_CONNECTIONS, ScanStreams
from app.scans.pipeline import ScanPipeline
from app.scans.store import ScanStore
from app.settings import Settings
from app.upstream.client import Upstream

log = logging.getLogger("app")

# How often every process looks for `running` rows of processes that died.
LOST_SCAN_SWEEP_S = 30.0
# How often scans older than SCAN_RETENTION_DAYS are purged (in bounded batches).
PURGE_INTERVAL_S = 3600.0


def cpu_lane(settings: Settings, metrics: Metrics, stack: AsyncExitStack) -> CpuLane:
    """The CPU lane: CPU_MAX_WORKERS threads, its queue fixed or sized (app/limits/sizing.py)."""
    queue = settings.limit("cpu_queue_limit")
    cpu = CpuLane(
        max_workers=settings.cpu_max_workers,
        queue_limit=queue.fixed if queue.fixed is not None else settings.cpu_max_workers,
    )
    cpu.observers.append(metrics.observe_cpu_job)
    stack.callback(cpu.shutdown)
    return cpu


async def database(settings: Settings, stack: AsyncExitStack) -> str:
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


async def pool(settings: Settings, dsn: str, stack: AsyncExitStack) -> asyncpg.Pool[asyncpg.Record]:
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
    stack.push_async_callback(bounded_close, "database pool", pool.close, pool.terminate)
    return pool


async def catalogue(pool: asyncpg.Pool[asyncpg.Record]) -> Taxonomy:
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


async def scan_store(
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
    background(stack, sweep, "lost-scan-sweep")
    purge = purge_old_scans(store, retention_days=settings.scan_retention_days, interval_s=PURGE_INTERVAL_S)
    background(stack, purge, "scan-purge")
    return store


async def redis_link(settings: Settings, stack: AsyncExitStack) -> RedisLink | None:
    """REDIS_URL's link, or None. An unreachable Redis does not stop the start: every
    user of the link falls back to its in-process behaviour until Redis answers."""
    if settings.redis_url is None:
        return None
    link = RedisLink(settings.redis_url, prefix=settings.redis_prefix, timeout_s=settings.redis_timeout_s)
    stack.push_async_callback(bounded_close, "Redis link", link.close)
    if not await link.ping():
        log.warning("Redis at %s does not answer; starting with in-process fallbacks", redact_url(link.url))
    return link


def scan_streams(
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
    stack.push_async_callback(bounded_close, "scan event streams", streams.close)
    return streams


def liveness(
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
    stack.push_async_callback(bounded_close, "liveness lease", liveness.close)
    background(stack, liveness.run(), "liveness-lease")


async def identity(settings: Settings, stack: AsyncExitStack) -> Authenticator:
    identity = Authenticator(settings)
    stack.push_async_callback(bounded_close, "JWKS client", identity.aclose)
    await identity.prefetch()  # AUTH_JWKS_URL's keys before the first token (bounded; failures logged)
    return identity


def shared_user_caps(
    redis: RedisLink | None, metrics: Metrics, stack: AsyncExitStack
) -> SharedUserCaps | None:
    if redis is None:
        return None
    caps = SharedUserCaps(redis, on_error=metrics.user_caps_redis_errors.inc)
    metrics.user_caps_unreleased.set_function(lambda: float(caps.unreleased))
    caps.start()
    stack.push_async_callback(bounded_close, "per-user caps", caps.aclose)
    return caps


def user_quota(
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
    stack.push_async_callback(bounded_close, "per-user rate and quota", quota.aclose)
    return quota


def admission(
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


def loop_pacer(
    settings: Settings, admission: Admission, metrics: Metrics, stack: AsyncExitStack
) -> LoopPacer | None:
    """The loop's capacity measured (not with LOOP_UTILISATION_TARGET=0), and new scans paced
    at the rate it takes with LOOP_PACING (else None)."""
    if not settings.loop_utilisation_target:
        return None
    capacity = LoopCapacity(
        target=settings.loop_utilisation_target,
        admitted=lambda: admission.admitted,
        in_flight=lambda: admission.in_flight,
        max_in_flight=lambda: admission.max_inflight,
        on_change=lambda limit, reason: metrics.limit_changes.labels(limit, reason).inc(),
    )
    background(stack, capacity.run(), "loop-capacity")
    gauges.bind_loop_capacity(metrics, capacity)
    if not settings.loop_pacing:
        return None
    metrics.limit.labels("loop_rate").set_function(lambda: float(capacity.limit))
    metrics.limit.labels("loop_inflight").set_function(lambda: float(capacity.inflight_limit))
    return LoopPacer(capacity)


def body_reader(settings: Settings, limits: InputLimits, metrics: Metrics) -> BodyReader:
    reader = BodyReader(
        BodyBudget(settings.body_buffer_max_bytes, per_client=settings.body_buffer_max_bytes_per_client),
        limit=limits.max_body_bytes,
        timeout_s=settings.body_read_timeout_s,
        min_bytes_per_s=settings.body_min_bytes_per_s,
        gap_s=settings.body_gap_timeout_s,
    )
    gauges.bind_body_budget(metrics, reader.budget)
    return reader


def input_limits(settings: Settings) -> InputLimits:
    image = ImageLimits(
        max_bytes=settings.image_max_bytes,
        max_pixels=settings.image_max_pixels,
        long_side=settings.image_long_side,
        jpeg_quality=settings.image_jpeg_quality,
    )
    return InputLimits(image=image, user_input_max_chars=settings.user_input_max_chars)


def sizing(
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
