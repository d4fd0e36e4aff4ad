"""One frozen `Settings`, read from the environment once and validated up front.

Nothing imports settings at module level: `create_app(settings)` receives them and
passes the relevant parts down. Every field maps to one environment variable; the
docs/configuration.md's table lists them all (keep the two in step).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from app.limits.charge_learning import ChargeLearning
from app.limits.sizing import LimitSpec
from app.runtime.redaction import redact_url
from app.upstream.deployments import Deployment, DeploymentError, parse_deployments
from app.upstream.profiles import TOKEN_PARAM_CHOICES, CallShape, call_shape
from app.upstream.reply_cache import CacheLimits
from app.upstream.stage_call import DETAILS, StageCall

AUTH_MODES = ("gateway", "jwt")
# RFC 7518 §3.2: an HS256 key at least as long as its hash output.
MIN_SECRET_BYTES = 32
# The gateway's shared secret travels in a header on every request: long enough not to be
# guessed, visible ASCII so that every proxy passes it unchanged.
MIN_GATEWAY_SECRET_CHARS = 16
_LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
# Several items in one photo (MAX_ITEMS): more than this is a list, not a photo of things to
# sort, and each item is prompt and reply tokens on both calls.
MAX_ITEMS_CEILING = 12
# One more item in the vision reply: a category path, a name, up to four tags, a box and
# the JSON around them. The longest the simulator writes is ~105 of its tokens (it counts
# every Hangul syllable as one, stricter than OpenAI's tokenizers).
TOKENS_PER_EXTRA_ITEM = 110
# Settings that hold secrets may instead be read from a file: `<NAME>_FILE` names it (a
# compose or Kubernetes secret), so the value never sits in the process's environment.
FILE_SETTINGS = ("database_url", "openai_api_key", "redis_url", "auth_jwt_secret", "auth_gateway_secret")


class SettingsError(ValueError):
    """A setting has a value that cannot work; the message names the variable."""


def _default_workers() -> int:
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Settings:
    # --- resources -------------------------------------------------------------
    database_url: str | None = field(default=None, repr=False)
    embedded_pg_dir: str = ".ecoscan/pgdata"
    db_pool_min: int = 2
    db_pool_max: str | int = "auto"  # `auto`: app/db/pool.py's pool_size
    db_timeout_s: float = 5.0
    shutdown_drain_s: float = 25.0

    # --- upstream (OpenAI or any compatible server) ------------------------------
    # Several deployments (app/upstream/deployments.py): a JSON array, or a TOML file of
    # [[upstream]] tables. With neither, the OPENAI_* settings are the one deployment.
    upstreams: str | None = field(default=None, repr=False)
    upstreams_file: str | None = None
    openai_api_key: str | None = field(default=None, repr=False)
    openai_base_url: str | None = None
    vision_model: str = "gpt-4o-mini"
    answer_model: str = "gpt-4o-mini"
    vision_detail: str = "low"
    vision_max_tokens: int = 120
    # Items one photo may name (app/stages/items.py); the vision call's cap grows with it.
    max_items: int = 5
    answer_max_tokens: int = 500
    openai_token_param: str = "auto"
    vision_reasoning_effort: str | None = None
    answer_reasoning_effort: str | None = None
    # How long after a deployment's breaker opens the service's first probe of it goes
    # (app/upstream/probes.py); each failed probe doubles it, up to UPSTREAM_PROBE_MAX_S.
    upstream_open_s: float = 1.0
    openai_connect_timeout_s: float = 5.0
    openai_read_timeout_s: float = 20.0
    vision_timeout_s: float = 30.0
    answer_timeout_s: float = 45.0
    # Any other calling stage's call (app/upstream/stage_call.py): a JSON object of stage
    # names to the fields they change, e.g. {"moderation": {"model": "gpt-4o-mini"}}.
    stage_calls: str | None = None

    # --- budgets, concurrency, admission (app/limits) -------------------------------
    openai_rpm: int = 500
    openai_tpm: int = 500_000
    rate_burst_fraction: float = 0.1
    # Limits sized by the process (app/limits/sizing.py): `auto`, `auto:N` (at most N) or N (fixed).
    vision_concurrency: str | int = "auto"
    answer_concurrency: str | int = "auto"
    cpu_max_workers: int = field(default_factory=_default_workers)  # `auto`: one per core
    cpu_queue_limit: str | int = "auto"
    max_inflight_scans: str | int = "auto"
    max_inflight_per_user: int = 4
    # Per-user scan rate and quota (app/limits/user_quota.py): scans a caller may start in a
    # minute and in 24 hours, shared by every replica through REDIS_URL. 0: off.
    user_scan_rate_per_min: int = 0
    user_daily_scan_quota: int = 0
    admission_wait_s: float = 0.5
    # The share of the time the event loop's thread may be busy (app/limits/loop_capacity.py):
    # measured against it always (0: not measured), new scans paced to it with LOOP_PACING.
    # 0.95: on a 2-core box a closed loop of 3,000 users kept the loop at 0.85-0.94 over
    # 30 s with no scan failed, so the ceiling is for a loop pinned for good (docs/benchmarks.md).
    loop_utilisation_target: float = 0.95
    loop_pacing: bool = True
    max_budget_wait_s: float = 10.0
    scan_deadline_s: float = 60.0
    retry_max_attempts: int = 4
    retry_base_delay_s: float = 0.25
    retry_max_delay_s: float = 8.0
    # What each provider's limiter charges, learned from its replies (app/limits/charge_learning.py).
    charge_learning: bool = True
    charge_ratio_min: float = 0.25
    charge_ratio_max: float = 4.0
    charge_step: float = 0.15
    charge_margin: float = 0.02

    # --- upstream health: negotiation in one flight, probes (app/upstream/negotiation.py, probes.py)
    # How long a call waits for the one call finding out whether its deployment takes a
    # parameter it has not answered for yet; then it goes as it is.
    negotiation_wait_s: float = 2.0
    # The longest pause between two probes of a deployment that is down: how late a
    # deployment that came back may be found (app/upstream/probes.py).
    upstream_probe_max_s: float = 3.0
    # The longest a call waits for a deployment's return when every deployment of its stage
    # is down (within its deadline): short outages are ridden out, long ones fail the call.
    upstream_ride_out_s: float = 20.0
    # Hedging (app/upstream/hedging.py): a call whose reply has not begun by its deployment's
    # recent first-byte p99 x HEDGE_FACTOR (within HEDGE_MIN_S..HEDGE_MAX_S) is sent again to
    # another deployment; at most HEDGE_BUDGET of the last minute's calls (0: never).
    hedge_factor: float = 1.5
    hedge_min_s: float = 1.0
    hedge_max_s: float = 10.0
    hedge_budget: float = 0.05
    # Prompt-cache affinity (app/upstream/affinity.py): a call whose prompt's first 1,024
    # tokens were sent to a deployment lately goes there again when it can take it as soon.
    upstream_cache_affinity: bool = True

    # --- many replicas, one key (app/runtime/redis_link.py, app/limits/shared_budget.py) -------
    # Set: the OpenAI budget, per-user caps and running scans' events are shared by every
    # process using the same Redis and prefix. Unset: everything stays in-process.
    redis_url: str | None = field(default=None, repr=False)
    redis_prefix: str = "ecoscan"
    redis_timeout_s: float = 0.5
    # Liveness leases and the takeover of a dead process's scans (app/scans/liveness.py).
    liveness_ttl_s: float = 3.0
    liveness_renew_s: float = 1.0
    takeover: bool = True

    # --- request and image handling ----------------------------------------------
    image_max_bytes: int = 10 * 1024 * 1024
    image_max_pixels: int = 40_000_000
    image_long_side: int = 768
    image_jpeg_quality: int = 85
    user_input_max_chars: int = 500
    body_read_timeout_s: float = 15.0
    body_min_bytes_per_s: float = 8192.0
    body_buffer_max_bytes: int = 256 * 1024 * 1024
    # Uploads nobody can hold (app/intake/body_reader.py): a body with no new bytes for
    # this long is cut off, and one client's bodies hold at most this much at once (and
    # never more than BODY_BUFFER_MAX_BYTES, whichever is smaller).
    body_gap_timeout_s: float = 10.0
    body_buffer_max_bytes_per_client: int = 32 * 1024 * 1024
    # Following scans of other replicas (app/scans/followers.py): each follow holds one of
    # the process's Redis follower connections while the scan runs.
    followers_max_per_user: int = 8
    followers_max_per_scan: int = 4

    # --- streaming and caching ----------------------------------------------------
    sse_ping_s: float = 15.0
    delta_flush_ms: float = 100.0
    rules_cache_ttl_s: float = 300.0
    # Reply caches (app/upstream/reply_cache.py): a 0 in any of a cache's three bounds turns it off.
    vision_cache_entries: int = 10_000
    vision_cache_bytes: int = 8 * 1024 * 1024
    vision_cache_ttl_s: float = 6 * 3600.0
    answer_cache_entries: int = 10_000
    answer_cache_bytes: int = 32 * 1024 * 1024
    answer_cache_ttl_s: float = 3600.0
    disconnect_grace_s: float = 15.0
    idempotency_ttl_s: float = 24 * 3600.0
    scan_retention_days: float = 30.0
    log_level: str = "INFO"
    # The garbage collector (app/runtime/heap.py): start-up objects frozen, a young generation of
    # this many allocations, a full collection every 60 s. 0: Python's own settings.
    gc_young_threshold: int = 20_000

    # --- identity ---
    # Who the caller is (app/intake/identity.py): a gateway's X-User-ID, or a verified bearer JWT.
    auth_mode: str = "gateway"
    auth_allow_anonymous: bool | None = None  # None: the mode's default (gateway yes, jwt no)
    auth_jwt_secret: str | None = field(default=None, repr=False)
    auth_jwks_file: str | None = None
    auth_jwks_url: str | None = None
    auth_jwt_issuer: str | None = None
    auth_jwt_audience: str | None = None
    auth_jwks_ttl_s: float = 300.0
    auth_jwks_refetch_s: float = 30.0
    auth_jwks_timeout_s: float = 5.0
    # AUTH_MODE=gateway: X-User-ID is believed only with this secret in X-Gateway-Secret.
    auth_gateway_secret: str | None = field(default=None, repr=False)

    # --- traces (the OTEL_* environment turns them on: app/runtime/tracing.py) ---
    # Spans carry the caller's user id (`user.id`) only when the operator says so.
    trace_user_id: bool = False

    # --- the built-in simulator (used when OPENAI_API_KEY is unset) ------------------
    # The SIM_* variables as given, one per field of app/sim/config.py's SimConfig; read
    # (and checked) by the lifespan only when it starts the simulator, so the service's
    # own modules never import the simulator's.
    simulator_env: tuple[tuple[str, str], ...] = field(default=(), metadata={"env_prefix": "SIM_"})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                minimum = 0 if f.name in _MAY_BE_ZERO else 1e-9
                if value < minimum:
                    raise SettingsError(
                        f"{env_name(f.name)} must be {'>= 0' if minimum == 0 else '> 0'}, got {value}"
                    )
        for name in SIZED_LIMITS:  # a number is fixed: kept as one
            if (fixed := self.limit(name).fixed) is not None:
                object.__setattr__(self, name, fixed)
        pool_max = self.limit("db_pool_max")
        if self.db_pool_min > (pool_max.fixed or pool_max.cap or self.db_pool_min):
            raise SettingsError("DB_POOL_MIN must not exceed DB_POOL_MAX")
        if self.vision_detail not in DETAILS:
            raise SettingsError(f"VISION_DETAIL must be low, high or auto, got {self.vision_detail!r}")
        if not 0 <= self.loop_utilisation_target <= 1:
            raise SettingsError(
                f"LOOP_UTILISATION_TARGET must be in [0, 1] (0: off), got {self.loop_utilisation_target}"
            )
        if not 0 < self.rate_burst_fraction <= 1:
            raise SettingsError("RATE_BURST_FRACTION must be in (0, 1]")
        if not 1 <= self.image_jpeg_quality <= 95:
            raise SettingsError("IMAGE_JPEG_QUALITY must be between 1 and 95")
        if self.body_buffer_max_bytes < self.image_max_bytes * 4 // 3 + 64 * 1024:
            raise SettingsError(
                "BODY_BUFFER_MAX_BYTES must hold at least one largest body (4/3 x IMAGE_MAX_BYTES + 64 KiB)"
            )
        self._check_upload_caps()
        if self.hedge_max_s < self.hedge_min_s:
            raise SettingsError("HEDGE_MAX_S must be at least HEDGE_MIN_S")
        if self.hedge_budget > 1:
            raise SettingsError("HEDGE_BUDGET must be a fraction of the calls, at most 1")
        if self.upstream_probe_max_s < self.upstream_open_s:
            raise SettingsError("UPSTREAM_PROBE_MAX_S must be at least UPSTREAM_OPEN_S")
        if self.image_long_side < 64:
            raise SettingsError("IMAGE_LONG_SIDE must be at least 64")
        if not 1 <= self.max_items <= MAX_ITEMS_CEILING:
            raise SettingsError(f"MAX_ITEMS must be between 1 and {MAX_ITEMS_CEILING}, got {self.max_items}")
        self._check_charges()
        self._stage_call_overrides()
        self._check_models()
        self._check_redis()
        self._check_identity()
        self.deployments()
        if self.openai_api_key is None and self.openai_base_url is not None:
            # A base URL without a key would silently fall back to the simulator.
            raise SettingsError("OPENAI_BASE_URL is set but OPENAI_API_KEY is not")

    def charge_learning_config(self) -> ChargeLearning:
        """The `CHARGE_*` settings as every budget's learner takes them."""
        return ChargeLearning(
            self.charge_learning,
            self.charge_ratio_min,
            self.charge_ratio_max,
            self.charge_step,
            self.charge_margin,
        )

    def limit(self, name: str) -> LimitSpec:
        """One of the `SIZED_LIMITS` as set: sized (`auto`, `auto:N`) or fixed."""
        value = getattr(self, name)
        try:
            return LimitSpec.parse(env_name(name), str(value), minimum=0 if name in _MAY_BE_ZERO else 1)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None

    def _check_charges(self) -> None:
        if not 0 < self.charge_ratio_min <= 1:
            raise SettingsError(f"CHARGE_RATIO_MIN must be in (0, 1], got {self.charge_ratio_min}")
        if self.charge_ratio_max < 1:
            raise SettingsError(f"CHARGE_RATIO_MAX must be >= 1, got {self.charge_ratio_max}")
        if not 0 < self.charge_step <= 1:
            raise SettingsError(f"CHARGE_STEP must be in (0, 1], got {self.charge_step}")
        if not 0 <= self.charge_margin < 1:
            raise SettingsError(f"CHARGE_MARGIN must be in [0, 1), got {self.charge_margin}")

    def _check_identity(self) -> None:
        """AUTH_*: one mode, one key source, and nothing set that the mode ignores."""
        if self.auth_mode not in AUTH_MODES:
            raise SettingsError(f"AUTH_MODE must be gateway or jwt, got {self.auth_mode!r}")
        sources = {
            "AUTH_JWT_SECRET": self.auth_jwt_secret,
            "AUTH_JWKS_FILE": self.auth_jwks_file,
            "AUTH_JWKS_URL": self.auth_jwks_url,
        }
        given = [name for name, value in sources.items() if value]
        self._check_gateway_secret()
        if self.auth_mode == "gateway":
            claims = {
                "AUTH_JWT_ISSUER": self.auth_jwt_issuer,
                "AUTH_JWT_AUDIENCE": self.auth_jwt_audience,
            }
            stray = given + [name for name, value in claims.items() if value]
            if stray:
                # Set but unused would look like protection that is not there.
                raise SettingsError(
                    f"{', '.join(stray)} only apply with AUTH_MODE=jwt (AUTH_MODE is gateway)"
                )
            return
        if len(given) != 1:
            got = f" (got {', '.join(given)})" if given else ""
            raise SettingsError(f"AUTH_MODE=jwt needs exactly one of {', '.join(sources)}{got}")
        secret = self.auth_jwt_secret
        if secret and len(secret.encode()) < MIN_SECRET_BYTES:
            raise SettingsError(f"AUTH_JWT_SECRET must be at least {MIN_SECRET_BYTES} bytes long")
        if self.auth_jwks_url:
            self._check_jwks_url(self.auth_jwks_url)

    def _check_gateway_secret(self) -> None:
        secret = self.auth_gateway_secret
        if secret is None:
            return
        if self.auth_mode != "gateway":
            raise SettingsError(
                f"AUTH_GATEWAY_SECRET only applies with AUTH_MODE=gateway (AUTH_MODE is {self.auth_mode})"
            )
        if len(secret) < MIN_GATEWAY_SECRET_CHARS:
            raise SettingsError(
                f"AUTH_GATEWAY_SECRET must be at least {MIN_GATEWAY_SECRET_CHARS} characters long"
            )
        if not all("!" <= c <= "~" for c in secret):
            raise SettingsError(
                "AUTH_GATEWAY_SECRET must be visible ASCII without spaces (it is sent as a header)"
            )

    @staticmethod
    def _check_jwks_url(url: str) -> None:
        parts = urlsplit(url)
        if not parts.hostname or parts.scheme not in ("https", "http"):
            raise SettingsError(f"AUTH_JWKS_URL must be an https:// URL, got {display_url(url)!r}")
        if parts.scheme == "http" and parts.hostname not in _LOOPBACK_HOSTS:
            # Whoever can alter the key set can sign tokens for any user.
            raise SettingsError("AUTH_JWKS_URL must use https:// (plain http only to a loopback address)")

    def _check_upload_caps(self) -> None:
        largest = self.image_max_bytes * 4 // 3 + 64 * 1024
        if self.body_buffer_max_bytes_per_client < largest:
            raise SettingsError(
                "BODY_BUFFER_MAX_BYTES_PER_CLIENT must hold at least one largest body "
                "(4/3 x IMAGE_MAX_BYTES + 64 KiB)"
            )

    def _check_redis(self) -> None:
        if self.liveness_renew_s >= self.liveness_ttl_s:
            raise SettingsError(
                f"LIVENESS_RENEW_S ({self.liveness_renew_s:g}) must be shorter than "
                f"LIVENESS_TTL_S ({self.liveness_ttl_s:g}): a lease must be renewed before it lapses"
            )
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError("REDIS_URL must start with redis://, rediss:// or unix://")
        if not self.redis_prefix or any(c.isspace() for c in self.redis_prefix):
            raise SettingsError(f"REDIS_PREFIX must be non-empty without spaces, got {self.redis_prefix!r}")

    def _check_models(self) -> None:
        if self.openai_token_param not in TOKEN_PARAM_CHOICES:
            raise SettingsError(
                f"OPENAI_TOKEN_PARAM must be one of {', '.join(TOKEN_PARAM_CHOICES)}, "
                f"got {self.openai_token_param!r}"
            )
        for stage in ("vision", "answer"):
            try:
                self.call_shape(stage)
            except ValueError as exc:
                names = f"{stage.upper()}_MODEL / {stage.upper()}_REASONING_EFFORT / OPENAI_TOKEN_PARAM"
                raise SettingsError(f"{names}: {exc}") from None

    def stage_call(self, declared: StageCall) -> StageCall:
        """A calling stage's call as set: the vision and answer stages' from their
        `VISION_*` / `ANSWER_*` variables, any other's from its `STAGE_CALLS` entry over
        what it declares."""
        if declared.stage == "vision":
            return dataclasses.replace(
                declared,
                model=self.vision_model,
                max_tokens=self.vision_output_tokens,
                reasoning_effort=self.vision_reasoning_effort,
                detail=self.vision_detail,
                timeout_s=self.vision_timeout_s,
                cache=CacheLimits(
                    self.vision_cache_entries, self.vision_cache_bytes, self.vision_cache_ttl_s
                ),
                concurrency=self.limit("vision_concurrency"),
            )
        if declared.stage == "answer":
            return dataclasses.replace(
                declared,
                model=self.answer_model,
                max_tokens=self.answer_max_tokens,
                reasoning_effort=self.answer_reasoning_effort,
                timeout_s=self.answer_timeout_s,
                cache=CacheLimits(
                    self.answer_cache_entries, self.answer_cache_bytes, self.answer_cache_ttl_s
                ),
                concurrency=self.limit("answer_concurrency"),
            )
        given = self._stage_call_overrides().get(declared.stage)
        try:
            return declared.overridden(given or {})
        except ValueError as exc:
            raise SettingsError(f"STAGE_CALLS {declared.stage}: {exc}") from None

    def stage_calls_named(self) -> list[str]:
        """The stages `STAGE_CALLS` has an entry for (the lifespan checks each is one)."""
        return list(self._stage_call_overrides())

    def _stage_call_overrides(self) -> dict[str, dict[str, Any]]:
        """STAGE_CALLS parsed; each entry checked against a call's defaults."""
        if not self.stage_calls:
            return {}
        try:
            given = json.loads(self.stage_calls)
        except ValueError as exc:
            raise SettingsError(f"STAGE_CALLS is not JSON: {exc}") from None
        if not isinstance(given, dict) or not all(isinstance(v, dict) for v in given.values()):
            raise SettingsError("STAGE_CALLS must be a JSON object of stage names to objects of fields")
        for stage, fields in given.items():
            if stage in ("vision", "answer"):
                raise SettingsError(f"STAGE_CALLS {stage}: set the {stage.upper()}_* variables instead")
            try:
                StageCall(stage).overridden(fields)
            except ValueError as exc:
                raise SettingsError(f"STAGE_CALLS {stage}: {exc}") from None
        return given

    def call_shape(
        self, stage: str, *, model: str | None = None, token_param: str | None = None
    ) -> CallShape:
        """How the `vision` or `answer` stage calls `model` (default: VISION_MODEL or
        ANSWER_MODEL; see app/upstream/profiles.py); a deployment may name its own model
        and token parameter."""
        vision = stage == "vision"
        return call_shape(
            model or (self.vision_model if vision else self.answer_model),
            output_tokens=self.vision_output_tokens if vision else self.answer_max_tokens,
            effort=self.vision_reasoning_effort if vision else self.answer_reasoning_effort,
            token_param=token_param or self.openai_token_param,
            # A classifier should give the same photo the same label; the answer keeps
            # the model's default sampling. Dropped where the model only takes the default.
            temperature=0.0 if vision else None,
        )

    @property
    def vision_output_tokens(self) -> int:
        """The vision reply's cap: `VISION_MAX_TOKENS` for the first item, and room for each
        further item `MAX_ITEMS` allows (a category path, a name, tags and a box each)."""
        return self.vision_max_tokens + TOKENS_PER_EXTRA_ITEM * (self.max_items - 1)

    def deployments(self) -> tuple[Deployment, ...] | None:
        """The deployments UPSTREAMS or UPSTREAMS_FILE lists, keys not yet looked up; None
        when neither is set (the OPENAI_* settings are then the one deployment)."""
        try:
            return parse_deployments(self.upstreams, self.upstreams_file)
        except DeploymentError as exc:
            name = "UPSTREAMS_FILE" if self.upstreams_file and not self.upstreams else "UPSTREAMS"
            raise SettingsError(f"{name}: {exc}") from None

    @property
    def uses_simulator(self) -> bool:
        return self.openai_api_key is None and not (self.upstreams or self.upstreams_file)

    @property
    def uses_embedded_postgres(self) -> bool:
        return self.database_url is None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from environment variables; `overrides` win (tests use them)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if prefix := f.metadata.get("env_prefix"):
                values[f.name] = tuple(sorted((k, v) for k, v in env.items() if k.startswith(prefix)))
                continue
            raw = env.get(env_name(f.name))
            if f.name in FILE_SETTINGS and env.get(env_name(f.name) + "_FILE"):
                if raw:
                    raise SettingsError(f"set {env_name(f.name)} or {env_name(f.name)}_FILE, not both")
                raw = _read_secret_file(env_name(f.name) + "_FILE", env[env_name(f.name) + "_FILE"])
            if raw is None or raw == "" or (f.name in _AUTO_IS_DEFAULT and raw.strip().lower() == "auto"):
                continue
            values[f.name] = _cast(f.name, raw, _field_type(f))
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


# Limits the process sizes itself unless they are given a number (app/limits/sizing.py).
SIZED_LIMITS = (
    "vision_concurrency",
    "answer_concurrency",
    "max_inflight_scans",
    "cpu_queue_limit",
    "db_pool_max",
)
# Settings whose default is derived (from the box): `auto` asks for that default.
_AUTO_IS_DEFAULT = frozenset({"cpu_max_workers"})

# Settings where 0 is meaningful (0 retries, no flush delay, no admission wait...).
_MAY_BE_ZERO = {
    "hedge_budget",
    "db_pool_min",
    "cpu_queue_limit",
    "admission_wait_s",
    "max_budget_wait_s",
    "retry_base_delay_s",
    "retry_max_delay_s",
    "delta_flush_ms",
    "rules_cache_ttl_s",
    "vision_cache_entries",
    "vision_cache_bytes",
    "vision_cache_ttl_s",
    "answer_cache_entries",
    "answer_cache_bytes",
    "answer_cache_ttl_s",
    "disconnect_grace_s",
    "gc_young_threshold",
    "charge_margin",
    "user_scan_rate_per_min",
    "user_daily_scan_quota",
    "loop_utilisation_target",
}


def env_name(field_name: str) -> str:
    return field_name.upper()


def _read_secret_file(variable: str, path: str) -> str:
    """A secret's value from the file `variable` names, surrounding whitespace (the
    trailing newline of `echo ... > file`) dropped; an empty file means unset."""
    try:
        with open(path, encoding="utf-8") as file:
            return file.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise SettingsError(f"{variable}: cannot read {path}: {reason}") from None


def _field_type(f: dataclasses.Field[Any]) -> str:
    return str(f.type).replace(" | None", "")


# The spellings a boolean setting accepts (any case); anything else is refused, so that a
# typo ("ture") cannot quietly mean false.
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


def _cast(name: str, raw: str, type_name: str) -> Any:
    if type_name == "bool":
        return _boolean(name, raw)
    try:
        if type_name == "int":
            return int(raw.replace("_", ""))
        if type_name == "float":
            return float(raw)
        return raw
    except ValueError:
        raise SettingsError(f"{env_name(name)} must be a {type_name}, got {raw!r}") from None


def _boolean(name: str, raw: str) -> bool:
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise SettingsError(f"{env_name(name)} must be true/false, 1/0, yes/no or on/off, got {raw!r}")


# The one URL redactor (app/runtime/redaction.py), under the name app/intake/identity.py uses.
display_url = redact_url
