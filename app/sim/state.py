"""Live simulator state: current config, rate-limit buckets, the prompt cache, stats, the
fault RNG and the captured request bodies."""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from app.sim.config import REPLY_FAULTS, SimConfig
from app.sim.latency import sample_latency
from app.sim.prompt_cache import PromptCache
from app.sim.ratelimit import HEADER_STYLES, RateLimiter
from app.sim.stats import SimStats

_LIMIT_FIELDS = {"rpm", "tpm", "shared_rpm", "shared_tpm", "flavor"}

# Called when the outage switch moves: (old mode, new mode). The runner that owns the
# listening socket sets it (app/sim/server.py), to stop and resume accepting.
OutageHook = Callable[[str, str], Awaitable[None]]


def _limits(config: SimConfig) -> tuple[int, int, int, int, str]:
    return config.rpm, config.tpm, config.shared_rpm, config.shared_tpm, config.flavor


def _limiter(config: SimConfig) -> RateLimiter:
    return RateLimiter(
        config.rpm,
        config.tpm,
        shared_rpm=config.shared_rpm,
        shared_tpm=config.shared_tpm,
        header_style=HEADER_STYLES[config.flavor],
    )


class SimState:
    """Shared by all requests of one simulator; reconfigurable while it runs."""

    def __init__(self, config: SimConfig) -> None:
        self._config = config
        self.stats = SimStats()
        self.limiter = _limiter(config)
        self.rng = random.Random(config.seed)
        self.prompt_cache = PromptCache()
        # Set on shutdown so injected stalls end instead of holding the server open.
        self.closing = asyncio.Event()
        # The latest request bodies as received (``capture_requests`` of them), oldest first.
        self.captured: deque[dict[str, Any]] = deque(maxlen=config.capture_requests)
        # Set while the outage switch is not ``hang``: held requests wait for it.
        self.not_hanging = asyncio.Event()
        if config.outage != "hang":
            self.not_hanging.set()
        self.on_outage: OutageHook | None = None
        # Where this simulator listens (url, control_url), for GET /sim/info.
        self.endpoints: dict[str, str] = {}

    @property
    def config(self) -> SimConfig:
        return self._config

    @config.setter
    def config(self, config: SimConfig) -> None:
        old = self._config
        self._config = config
        if _limits(config) != _limits(old):
            self.limiter = _limiter(config)
        if config.seed != old.seed:
            self.rng = random.Random(config.seed)
        if config.capture_requests != old.capture_requests:
            self.captured = deque(self.captured, maxlen=config.capture_requests)
        if config.outage == "hang":
            self.not_hanging.clear()
        else:
            self.not_hanging.set()

    def configure(self, changes: Mapping[str, Any]) -> SimConfig:
        """Apply a partial update (validated; ValueError names the bad field).

        Naming ``rpm``/``tpm`` refills the buckets and naming ``seed`` reseeds the fault
        RNG even when the value is unchanged, so tests can start from a known state.
        """
        config = self._config.updated(changes)
        self.config = config
        if _LIMIT_FIELDS & set(changes):
            self.limiter = _limiter(config)
        if "seed" in changes:
            self.rng = random.Random(config.seed)
        return config

    def take_fault(self, fault: str, kind: str) -> bool:
        """Consume one of ``<fault>_next`` if it applies to ``kind`` (e.g. ``reject``)."""
        config = self._config
        left: int = getattr(config, f"{fault}_next")
        if left <= 0 or kind not in getattr(config, f"{fault}_kinds"):
            return False
        self._config = config.updated({f"{fault}_next": left - 1})
        return True

    def take_reject(self, kind: str) -> bool:
        return self.take_fault("reject", kind)

    def take_reply_fault(self, kind: str, stream: bool, schema_bound: bool) -> str | None:
        """At most one 200-path fault per request, taken in ``REPLY_FAULTS`` order.

        ``truncate`` only shapes streams and ``malformed`` only replies bound by a JSON
        schema, so a request they cannot shape leaves them pending.
        """
        applies = {"truncate": stream, "malformed": schema_bound}
        for fault in REPLY_FAULTS:
            if applies.get(fault, True) and self.take_fault(fault, kind):
                return fault
        return None

    def capture(self, body: dict[str, Any]) -> None:
        if self.captured.maxlen:
            self.captured.append(body)

    def inject_error(self, kind: str) -> bool:
        config = self._config
        return config.error_rate > 0 and kind in config.error_kinds and self.rng.random() < config.error_rate

    def inject_hold(self) -> bool:
        rate = self._config.hold_rate
        return rate > 0 and self.rng.random() < rate

    def inject_stall(self) -> bool:
        rate = self._config.stall_rate
        return rate > 0 and self.rng.random() < rate

    def latency(self, kind: str) -> float:
        config = self._config
        median = config.vision_median_s if kind == "vision" else config.text_median_s
        return sample_latency(self.rng, median, config.latency_sigma, config.time_scale)
