"""Prometheus metrics, all on one registry that the lifespan creates (tests get a
fresh one each). Base units, bounded labels only: stage, model, outcome, reason,
code, kind — never scan ids, user ids or raw paths.

Stage time is split in two: `ecoscan_stage_queue_seconds` is time spent waiting
(for a stage semaphore, the rate budget or the CPU lane) and
`ecoscan_stage_service_seconds` is time spent working. They answer different
questions: the first says a limit is too tight, the second that the work is slow.
With `ecoscan_admission_wait_seconds` (waiting for a slot before the stream starts)
they are every wait a scan can have, and each limit's size and use is a gauge beside
it (`ecoscan_limit`, `ecoscan_cpu_workers`; `*_in_use`/`*_busy_workers`;
`*_waiting`/`*_queue_depth`): k6/sweep reads them to say which limit held the scans.
"""

from __future__ import annotations

import gc

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

# A scan costs fractions of a cent (gpt-4o-mini: ~$0.0006), a reasoning model's more.
COST_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)

# LLM calls take seconds; the library's default buckets stop at 10 s.
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2,
    3,
    4,
    5,
    6,
    8,
    10,
    15,
    20,
    30,
    45,
    60,
    90,
    120,
)
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# The GenAI conventions' advice for their histograms (gen_ai.client.*).
GENAI_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
GENAI_DURATION_BUCKETS = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
GENAI_FIRST_CHUNK_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    2.5,
    5,
    7.5,
    10,
)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = True) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        if process:
            self._declare_process_collectors()
        self._declare_scan_metrics()
        self._declare_scan_stream_metrics()
        self._declare_stage_metrics()
        self._declare_upstream_metrics()
        self._declare_routing_metrics()
        self._declare_route_limit_metrics()
        self._declare_budget_and_gate_metrics()
        self._declare_shared_budget_metrics()
        self._declare_cpu_lane_and_loop_metrics()
        self._declare_admission_and_lifecycle_metrics()
        self._declare_cache_metrics()
        self._declare_loop_capacity_metrics()
        self._declare_cost_metrics()
        self._declare_genai_and_trace_metrics()

    def _declare_process_collectors(self) -> None:
        """The library's process, platform and GC collectors."""
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)

    def _declare_scan_metrics(self) -> None:
        """Whole scans and their SSE streams: outcomes, durations, what is open now."""
        r = self.registry
        self.scans = Counter(
            "ecoscan_scans_total",
            "Scans by outcome (completed, failed, cancelled, rejected) and code/reason.",
            ["outcome", "code"],
            registry=r,
        )
        self.scan_duration = Histogram(
            "ecoscan_scan_duration_seconds",
            "Whole-scan duration from acceptance to the terminal event.",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.first_event = Histogram(
            "ecoscan_scan_first_event_seconds",
            "Time from request arrival to the first SSE event handed to the server.",
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.scans_lost = Counter(
            "ecoscan_scans_lost_total",
            "Scans of dead processes (SIGKILL, OOM, lost host) this process's sweep marked PROCESS_LOST.",
            registry=r,
        )
        self.scans_taken_over = Counter(
            "ecoscan_scans_taken_over_total",
            "Running scans of a dead process (its liveness lease lapsed) this process claimed: "
            "resumed here, or ended at once as PROCESS_LOST (lost).",
            ["outcome"],
            registry=r,
        )
        self.scans_in_flight = Gauge(
            "ecoscan_scans_in_flight", "Accepted scans not yet finished.", registry=r
        )
        self.streams_open = Gauge("ecoscan_sse_streams_open", "Open SSE responses.", registry=r)
        self.prepare_duration = Histogram(
            "ecoscan_request_prepare_seconds",
            "Parsing and image preparation before the stream starts (CPU lane incl. wait, or inline).",
            buckets=FAST_BUCKETS,
            registry=r,
        )

    def _declare_scan_stream_metrics(self) -> None:
        """Running scans' events mirrored to Redis Streams, and followed there from other replicas."""
        r = self.registry
        self.stream_events_mirrored = Counter(
            "ecoscan_scan_stream_events_mirrored_total",
            "Scan events appended to their Redis Stream (REDIS_URL).",
            registry=r,
        )
        self.stream_mirror_failures = Counter(
            "ecoscan_scan_stream_mirror_failures_total",
            "Flushes of scan events to Redis that failed (retried; the scans go on).",
            registry=r,
        )
        self.stream_follows = Counter(
            "ecoscan_scan_stream_follows_total",
            "Event requests for scans running on another replica, by outcome: served (from "
            "Redis), refused (409: no usable stream, or Redis failed), cut (Redis failed mid-stream), "
            "limited (429/503: the user's, the scan's or the process's followers at their cap).",
            ["outcome"],
            registry=r,
        )

    def _declare_stage_metrics(self) -> None:
        """Per-stage wall time, split into queue (waiting for a limit) and service (working)."""
        r = self.registry
        self.stage_duration = Histogram(
            "ecoscan_stage_duration_seconds",
            "Stage wall time (queue + service) by outcome.",
            ["stage", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_queue = Histogram(
            "ecoscan_stage_queue_seconds",
            "Time a stage waited for a limit (semaphore, rate budget, CPU lane).",
            ["stage", "limit"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_service = Histogram(
            "ecoscan_stage_service_seconds",
            "Time a stage spent working (upstream call, query, CPU job), excluding waits.",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def _declare_upstream_metrics(self) -> None:
        """OpenAI calls: status, duration, tokens, retries, 429s and the rate-limit headers."""
        r = self.registry
        self.upstream_calls = Counter(
            "ecoscan_upstream_calls_total",
            "OpenAI calls by model, endpoint and status class (2xx, 4xx, 429, 5xx, error).",
            ["model", "endpoint", "status"],
            registry=r,
        )
        self.upstream_duration = Histogram(
            "ecoscan_upstream_call_seconds",
            "OpenAI call duration (to the last byte for streams).",
            ["model", "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_tokens = Counter(
            "ecoscan_upstream_tokens_total",
            "Tokens by kind: prompt, completion, reasoning, cached (prompt tokens served from "
            "OpenAI's prompt cache), all from usage; estimated (reserved).",
            ["model", "kind"],
            registry=r,
        )
        # Per deployment: each organisation keeps its own prompt cache (app/upstream/affinity.py).
        self.upstream_prompt_tokens = Counter(
            "ecoscan_upstream_prompt_tokens_total",
            "Prompt tokens by deployment and stage, from usage: prompt (all) and cached (served "
            "from that deployment's prompt cache).",
            ["upstream", "stage", "kind"],
            registry=r,
        )
        self.upstream_retries = Counter(
            "ecoscan_upstream_retries_total",
            "Retried OpenAI calls by reason.",
            ["model", "reason"],
            registry=r,
        )
        self.upstream_429 = Counter(
            "ecoscan_upstream_rate_limited_total",
            "429 answers from OpenAI by type.",
            ["model", "type"],
            registry=r,
        )
        # What the provider's limiter charges against our estimate (app/limits/charge_learning.py).
        self.upstream_charge = Histogram(
            "ecoscan_upstream_charge_tokens",
            "Tokens one call reserved as its provider's limiter counts them: estimate x learned ratio.",
            ["model", "kind"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.upstream_charge_ratio = Gauge(
            "ecoscan_upstream_charge_ratio",
            "Learned ratio of what the limiter charges to what we estimate, per budget and call kind.",
            ["budget", "kind"],
            registry=r,
        )
        self.ratelimit_remaining = Gauge(
            "ecoscan_upstream_ratelimit_remaining",
            "Last x-ratelimit-remaining-* seen, by resource (requests, tokens).",
            ["model", "resource"],
            registry=r,
        )

    def _declare_routing_metrics(self) -> None:
        """Routing over deployments (app/upstream/routes.py), by deployment name: where calls
        went, each deployment's breaker, limit and failovers, negotiation, probes, hedges."""
        r = self.registry
        self.upstream_routed = Counter(
            "ecoscan_upstream_routed_total",
            "Attempts sent to each deployment, by stage.",
            ["upstream", "stage"],
            registry=r,
        )
        self.upstream_state = Gauge(
            "ecoscan_upstream_state",
            "Each deployment's breaker: 0 closed, 1 open, 2 half-open (probing), 3 taken out "
            "(a refused key, a missing deployment or an exhausted quota).",
            ["upstream"],
            registry=r,
        )
        self.upstream_failovers = Counter(
            "ecoscan_upstream_failovers_total",
            "Failed attempts followed at once by one on another deployment, by stage and reason.",
            ["stage", "reason"],
            registry=r,
        )
        self.upstream_negotiated = Counter(
            "ecoscan_upstream_negotiated_total",
            "Optional parameters a deployment refused and is sent without from then on.",
            ["upstream", "parameter"],
            registry=r,
        )
        self.upstream_negotiation_waits = Counter(
            "ecoscan_upstream_negotiation_waits_total",
            "Calls that waited for another call to find out whether their deployment takes "
            "their parameters (app/upstream/negotiation.py): answered, or timed_out (went as they were).",
            ["upstream", "outcome"],
            registry=r,
        )
        self.upstream_probes = Counter(
            "ecoscan_upstream_probes_total",
            "The service's own probes of deployments whose breaker is open (app/upstream/probes.py): "
            "ok (closed it), failed, skipped (no budget in time), error.",
            ["upstream", "outcome"],
            registry=r,
        )
        self.upstream_ride_outs = Counter(
            "ecoscan_upstream_ride_outs_total",
            "Calls that waited for a deployment's return, every deployment of their stage being "
            "down: returned, or expired (the deadline came first).",
            ["stage", "outcome"],
            registry=r,
        )
        self.upstream_hedges = Counter(
            "ecoscan_upstream_hedges_total",
            "Calls whose reply was late past their deployment's first-byte p99 x HEDGE_FACTOR "
            "(app/upstream/hedging.py): sent (a hedge went), no_route, no_budget; then won (the "
            "hedge answered first) or lost.",
            ["stage", "outcome"],
            registry=r,
        )

    def _declare_route_limit_metrics(self) -> None:
        """Each route's own concurrency limit (app/limits/route_limits.py), by deployment and
        stage, and restarted streams."""
        r = self.registry
        self.upstream_limit = Gauge(
            "ecoscan_upstream_limit",
            "Each deployment's concurrency limit for a stage (its calls, queued at the stage gate or"
            " the budget, or sent); an automatic stage gate is their sum over usable deployments.",
            ["upstream", "stage"],
            registry=r,
        )
        self.upstream_limit_changes = Counter(
            "ecoscan_upstream_limit_changes_total",
            "Moves of a deployment's concurrency limit, by why: grow, steady, little, gradient, backoff,"
            " floor, ceiling.",
            ["upstream", "stage", "reason"],
            registry=r,
        )
        self.upstream_in_use = Gauge(
            "ecoscan_upstream_in_use",
            "Calls of a stage on each deployment now: queued at the stage gate or the budget, or sent.",
            ["upstream", "stage"],
            registry=r,
        )
        self.upstream_restarts = Counter(
            "ecoscan_upstream_stream_restarts_total",
            "Streamed calls that failed after their first token and started again "
            "(the client got a `discard` event), by stage.",
            ["stage"],
            registry=r,
        )

    def _declare_budget_and_gate_metrics(self) -> None:
        """The RPM/TPM budget (waits, limits, reservations) and the stage semaphores."""
        r = self.registry
        self.budget_wait = Histogram(
            "ecoscan_budget_wait_seconds",
            "Time waiting for the RPM/TPM budget.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.budget_available = Gauge(
            "ecoscan_budget_available", "Budget available now.", ["model", "resource"], registry=r
        )
        self.budget_limit = Gauge(
            "ecoscan_budget_effective_limit_per_minute",
            "Limit the budget enforces now: min(configured, reported, learned from headers).",
            ["model", "resource"],
            registry=r,
        )
        self.budget_waiters = Gauge(
            "ecoscan_budget_waiters", "Calls queued for the budget.", ["model"], registry=r
        )
        self.reservations_open = Gauge(
            "ecoscan_budget_reservations_open",
            "Budget reservations taken by calls in progress and not yet settled.",
            registry=r,
        )
        self.semaphore_in_use = Gauge(
            "ecoscan_stage_semaphore_in_use", "Stage semaphore slots held.", ["stage"], registry=r
        )
        self.semaphore_waiting = Gauge(
            "ecoscan_stage_semaphore_waiting",
            "Calls queued for a stage semaphore slot.",
            ["stage"],
            registry=r,
        )
        self.limit = Gauge(
            "ecoscan_limit",
            "Each limit in force now: <stage>_gate per calling stage (calls in progress), admission (scans in"
            " flight), cpu_queue (CPU-lane jobs waiting), loop_rate (scans a second the event loop takes).",
            ["limit"],
            registry=r,
        )
        self.limit_changes = Counter(
            "ecoscan_limit_changes_total",
            "Moves of an automatic limit, by why: grow, steady, little, gradient, backoff, floor, ceiling;"
            " routes (a gate whose deployments came or went); loop_rate: cpu, saturated, floor.",
            ["limit", "reason"],
            registry=r,
        )
        self.limit_latency = Gauge(
            "ecoscan_limit_latency_seconds",
            "A stage's call latency as its automatic gate sees it (every reply, whichever deployment):"
            " recent, and baseline (no load).",
            ["stage", "kind"],
            registry=r,
        )

    def _declare_shared_budget_metrics(self) -> None:
        """The budget shared through Redis (REDIS_URL): whether it is, this process's share
        of the key, and the round trips it costs."""
        r = self.registry
        self.budget_shared = Gauge(
            "ecoscan_budget_shared",
            "1 while the budget is shared through Redis, 0 while it falls back to a local share.",
            ["model"],
            registry=r,
        )
        self.budget_share = Gauge(
            "ecoscan_budget_share",
            "This process's share of the key: 1 / live replicas (its fallback rate while Redis is away).",
            ["model"],
            registry=r,
        )
        self.budget_redis_calls = Counter(
            "ecoscan_budget_redis_calls_total",
            "Budget calls to Redis: grant (a waiting call needed more), return, heartbeat, probe, "
            "sent (a call counted), error.",
            ["model", "op"],
            registry=r,
        )
        self.budget_redis_call_seconds = Histogram(
            "ecoscan_budget_redis_call_seconds",
            "Round trip of one lease call to Redis (what sharing the budget adds to a wait).",
            ["model"],
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.user_caps_redis_errors = Counter(
            "ecoscan_user_caps_redis_errors_total",
            "Per-user cap checks that fell back to this process's count because Redis failed.",
            registry=r,
        )
        self.user_caps_unreleased = Gauge(
            "ecoscan_user_caps_unreleased_slots",
            "Per-user slots whose removal from Redis failed, removed when Redis answers again.",
            registry=r,
        )
        self.user_quota_redis_errors = Counter(
            "ecoscan_user_quota_redis_errors_total",
            "Per-user rate and quota reservations counted by this process alone because Redis failed.",
            registry=r,
        )
        self.breaker_redis_errors = Counter(
            "ecoscan_upstream_breaker_redis_errors_total",
            "Breaker syncs and probe claims that failed because Redis did (each replica's "
            "breakers then go on alone).",
            registry=r,
        )
        self.breakers_shared = Gauge(
            "ecoscan_upstream_breakers_shared",
            "1 while the deployments' breakers are shared through Redis, 0 while this replica's go on alone.",
            registry=r,
        )

    def _declare_cpu_lane_and_loop_metrics(self) -> None:
        """The CPU lane's queue, workers and jobs, and the event loop's lag."""
        r = self.registry
        self.cpu_queue_depth = Gauge(
            "ecoscan_cpu_queue_depth", "CPU-lane jobs waiting for a worker.", registry=r
        )
        self.cpu_busy = Gauge("ecoscan_cpu_busy_workers", "CPU-lane workers busy.", registry=r)
        self.cpu_workers = Gauge(
            "ecoscan_cpu_workers", "CPU-lane worker threads (CPU_MAX_WORKERS as in effect).", registry=r
        )
        self.cpu_job = Histogram(
            "ecoscan_cpu_job_seconds",
            "CPU-lane jobs: phase=queue (waiting for a worker) or run.",
            ["phase"],
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.loop_lag = Histogram(
            "ecoscan_event_loop_lag_seconds",
            "How late the loop-lag probe's timer fired: time callbacks held the loop.",
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.gc_pause = Histogram(
            "ecoscan_gc_pause_seconds",
            "Garbage collections and how long each held the loop, by generation (2: a full one).",
            ["generation"],
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.gc_young_threshold = Gauge(
            "ecoscan_gc_young_threshold",
            "Allocations between young collections: GC_YOUNG_THRESHOLD, less while a large heap slows them.",
            registry=r,
        )
        self.loop_lag_max = Gauge(
            "ecoscan_event_loop_lag_max_seconds", "Largest loop lag seen since start.", registry=r
        )

    def _declare_admission_and_lifecycle_metrics(self) -> None:
        """Admission slots and refusals, shutdown, and the database's deferred rows and LISTEN link."""
        r = self.registry
        self.admission_in_use = Gauge(
            "ecoscan_admission_slots_in_use", "Admission slots held by scans (global cap).", registry=r
        )
        self.admission_waiting = Gauge(
            "ecoscan_admission_waiting", "Scans waiting for an admission slot.", registry=r
        )
        self.admission_wait = Histogram(
            "ecoscan_admission_wait_seconds",
            "Time an admitted scan waited for an admission slot (0 when one was free).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.scan_rows_deferred = Gauge(
            "ecoscan_scan_rows_deferred",
            "Terminal scan rows the database did not take yet; retried until it does.",
            registry=r,
        )
        self.body_bytes_buffered = Gauge(
            "ecoscan_request_body_bytes_buffered",
            "Bytes of scan request bodies held in memory right now (cap: BODY_BUFFER_MAX_BYTES).",
            registry=r,
        )
        self.shutting_down = Gauge(
            "ecoscan_shutting_down", "1 once the shutdown drain has begun (readiness is 503).", registry=r
        )
        self.admission_rejected = Counter(
            "ecoscan_admission_rejected_total",
            "Scans refused before streaming.",
            ["reason"],
            registry=r,
        )
        self.rules_listener_up = Gauge(
            "ecoscan_rules_listener_up",
            "1 while the rule cache's LISTEN connection is up; 0 while it reconnects (short cache TTL).",
            registry=r,
        )

    def _declare_loop_capacity_metrics(self) -> None:
        """The event loop's capacity and the arrivals it shed (app/limits/loop_capacity.py,
        app/limits/loop_pacer.py), and the upstream timeouts our own lateness caused
        (app/limits/late_timeouts.py)."""
        r = self.registry
        self.loop_utilisation = Gauge(
            "ecoscan_loop_utilisation",
            "Share of wall time the event loop's thread wanted the CPU (running or waiting for a core).",
            registry=r,
        )
        self.loop_cpu_share = Gauge(
            "ecoscan_loop_cpu_share",
            "Of the time the event loop's thread wanted the CPU, the share it got.",
            registry=r,
        )
        self.loop_cpu_per_scan = Gauge(
            "ecoscan_loop_cpu_per_scan_seconds",
            "The event loop's CPU time per admitted scan (running mean).",
            registry=r,
        )
        self.loop_saturated = Gauge(
            "ecoscan_loop_saturated",
            "1 while the event loop is at or over LOOP_UTILISATION_TARGET (until 0.1 under it).",
            registry=r,
        )
        self.loop_shed = Counter(
            "ecoscan_loop_shed_total",
            "Scans refused SERVER_BUSY before their body was read, by why: saturated (the loop is over"
            " its target) or wave (more arrived at once than the pacer's queue holds at the rate).",
            ["reason"],
            registry=r,
        )
        self.loop_shed_cpu = Counter(
            "ecoscan_loop_shed_cpu_seconds_total",
            "The event loop's CPU time spent refusing the scans it shed: in the HTTP protocol from the"
            " pacer's question to the 503's write, in acceptance from its start to the refusal.",
            registry=r,
        )
        self.upstream_timeouts = Counter(
            "ecoscan_upstream_timeouts_total",
            "Connect and first-byte timeouts of upstream calls, by cause: upstream (counted against"
            " the deployment) or loop_late (our loop was late; retried at once, not counted).",
            ["stage", "cause"],
            registry=r,
        )

    def _declare_cache_metrics(self) -> None:
        """The vision and answer reply caches (app/upstream/reply_cache.py): lookups, size."""
        r = self.registry
        self.cache_requests = Counter(
            "ecoscan_cache_requests_total",
            "Reply-cache lookups by cache (vision, answer) and outcome (hit, miss, coalesced).",
            ["cache", "outcome"],
            registry=r,
        )
        self.cache_entries = Gauge(
            "ecoscan_cache_entries", "Replies held by the cache.", ["cache"], registry=r
        )
        self.cache_bytes = Gauge(
            "ecoscan_cache_bytes",
            "Bytes of keys and replies held by the cache (UTF-8).",
            ["cache"],
            registry=r,
        )

    def _declare_cost_metrics(self) -> None:
        """What the upstream calls cost, priced from their usage (app/upstream/prices.py)."""
        r = self.registry
        self.upstream_cost = Counter(
            "ecoscan_upstream_cost_usd_total",
            "USD the upstream calls cost, priced from the usage each reply reported (retries and "
            "hedges included), by deployment and model.",
            ["deployment", "model"],
            registry=r,
        )
        self.upstream_unpriced = Counter(
            "ecoscan_upstream_unpriced_calls_total",
            "Replies with usage from a model with no price (its scans' cost is unknown), by deployment"
            " and model.",
            ["deployment", "model"],
            registry=r,
        )
        self.scan_cost = Histogram(
            "ecoscan_scan_cost_usd",
            "What one ended scan's upstream calls cost, USD (scans with an unpriced call not included).",
            buckets=COST_BUCKETS,
            registry=r,
        )

    def observe_gc_pause(self, generation: int, seconds: float) -> None:
        self.gc_pause.labels(str(generation)).observe(seconds)
        self.gc_young_threshold.set(gc.get_threshold()[0])  # app/runtime/heap.py resizes it

    def observe_cpu_job(self, queue_s: float, run_s: float) -> None:
        self.cpu_job.labels("queue").observe(queue_s)
        self.cpu_job.labels("run").observe(run_s)
        # The lane's only job today is preparing the request (parse, decode, resize), so
        # it is also the "prepare" stage's queue/service split (a body prepared on the
        # loop has only the service part: app/intake/acceptance.py).
        self.stage_queue.labels("prepare", "cpu").observe(queue_s)
        self.stage_service.labels("prepare").observe(run_s)

    def render(self, *, openmetrics: bool = False) -> bytes:
        """The text format; OpenMetrics (with the scan histogram's exemplars: trace ids) when
        the scraper asks for it."""
        if openmetrics:
            rendered: bytes = openmetrics_latest(self.registry)  # type: ignore[no-untyped-call]
            return rendered
        return generate_latest(self.registry)

    def _declare_genai_and_trace_metrics(self) -> None:
        """The OpenTelemetry GenAI client metrics, named as its conventions name them (dots as
        underscores, the unit a suffix), recorded per upstream attempt (app/upstream/genai.py);
        and what trace export could not send (app/runtime/tracing.py)."""
        r = self.registry
        where = ["gen_ai_operation_name", "gen_ai_provider_name", "deployment", "gen_ai_request_model"]
        self.genai_token_usage = Histogram(
            "gen_ai_client_token_usage",
            "Tokens an upstream call used, by gen_ai_token_type: input, output (the reply's usage).",
            [*where, "gen_ai_token_type"],
            buckets=GENAI_TOKEN_BUCKETS,
            registry=r,
        )
        self.genai_duration = Histogram(
            "gen_ai_client_operation_duration_seconds",
            "Each upstream attempt from its send to its end (error_type empty when it succeeded).",
            [*where, "error_type"],
            buckets=GENAI_DURATION_BUCKETS,
            registry=r,
        )
        self.genai_first_chunk = Histogram(
            "gen_ai_client_operation_time_to_first_chunk_seconds",
            "A streamed upstream attempt from its send to the first chunk of its reply.",
            where,
            buckets=GENAI_FIRST_CHUNK_BUCKETS,
            registry=r,
        )
        self.trace_spans_dropped = Counter(
            "ecoscan_trace_spans_dropped_total",
            "Spans not exported: ended while OTEL_BSP_MAX_QUEUE_SIZE were waiting, or in a batch the"
            " trace endpoint did not take.",
            registry=r,
        )
