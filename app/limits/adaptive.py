"""A concurrency limit that sizes itself: how many calls of one stage may be in progress.

Two rules, the lower wins, inside [floor, ceiling], rising at most `GROWTH`-fold an
interval:

1. **Little's law, the target.** To use a budget of `rate` calls/s when each call takes
   `latency` seconds, `rate x latency` calls must be in progress; `LITTLE_HEADROOM` more
   keeps the budget's queue fed through the latency's spread. While the upstream is
   healthy the limit is this target, used or not yet (a burst then finds the slots
   it needs). Past it, more slots only move the queue from the gate to the budget.
   Without a binding budget (`rate` = inf) this rule says nothing.
2. **A gradient limit, the correction** (the idea of Netflix's concurrency-limits
   "Gradient2"): the ratio of the no-load latency (a slow, downward-quick average) to
   the recent latency. While calls take no longer than `TOLERANCE` x the no-load
   latency and every slot is used, a limit no budget bounds doubles each interval;
   when latency climbs past that (the upstream queues our calls), it shrinks in
   proportion; a 429, a 503 or a timeout cuts it by `BACKOFF` (the multiplicative
   decrease of AIMD). So an upstream that slows down under our load, or says it is
   overloaded, gets fewer calls at once instead of a pile of waiters.

Why a gradient limiter rather than plain AIMD or Vegas: AIMD moves only on errors,
and a provider's latency rises long before it answers 429 (or never does, and we time
out); Vegas needs a queue-size estimate in requests, which a streamed call of varying
length does not give. Gradient2 reacts to latency as a ratio, which is what varies
least between a 1 s vision call and a 30 s answer, and it is the rule Netflix's
library defaults to.

Before the first call completes, the latency is a prior: at least `prior_latency_s`,
and at least as long as the oldest call still in progress (a call running for t s
shows the latency is t or more), so the limit rises while a slow upstream's first
calls are still out.

Pure: no clock of its own; each `update` is one interval, so tests drive it step by step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# How far above the no-load latency calls may take before the limit shrinks.
TOLERANCE = 1.5
# Slots beyond Little's product, as a share of it: the budget's queue stays fed while
# call latencies spread around their mean.
LITTLE_HEADROOM = 0.5
# A 429, 503 or timeout in an interval multiplies the limit by this.
BACKOFF = 0.7
# The lowest latency ratio counted (Gradient2's 0.5); with `SMOOTHING`, one interval cuts
# the limit by at most 15 %.
MIN_GRADIENT = 0.5
# How much of a rise in latency one interval acts on: noise is smoothed, a real rise
# still halves the limit within a few intervals.
SMOOTHING = 0.3
# The most a limit rises in one interval (TCP's slow start doubles too): from a cut or
# from the start it regains thousands of slots in seconds, without a flood.
GROWTH = 2.0
# Slots used (at the busiest moment of an interval) for the limit to count as the
# bottleneck, worth raising.
SATURATED = 0.9
# The no-load latency follows a slower latency upwards this fast per interval (and at
# once downwards): a lasting change of latency becomes the new normal in ~20 intervals.
BASELINE_RISE = 0.05


@dataclass(frozen=True)
class LimitChange:
    """What one update did: the limit after it, and why: `grow` (every slot used,
    latency normal), `steady` (slots to spare), `idle` (no reply this interval: held),
    `little` (the budget's rate x latency bounds it), `gradient` (latency rose),
    `backoff` (the upstream said it has too much), `floor` / `ceiling` (clamped)."""

    after: int
    reason: str


class AdaptiveLimit:
    def __init__(
        self, *, floor: int, ceiling: int, prior_latency_s: float, initial: int | None = None
    ) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError(f"need 1 <= floor <= ceiling, got {floor} and {ceiling}")
        self.floor = floor
        self.ceiling = ceiling
        self._prior_latency_s = prior_latency_s
        self._limit = float(max(floor, min(ceiling, initial if initial is not None else floor)))
        self.reason = "initial"
        # This interval's observations.
        self._latency_sum = 0.0
        self._samples = 0
        self._overloads = 0
        self._most_in_use = 0
        # Latency estimates (seconds): the recent one, and the no-load baseline.
        self.latency_s: float | None = None
        self.baseline_s: float | None = None

    @property
    def limit(self) -> int:
        return max(self.floor, min(self.ceiling, int(self._limit)))

    def observe(self, latency_s: float, *, overloaded: bool = False) -> None:
        """A call finished after `latency_s` in progress; `overloaded`: it was a 429, a 503
        or a timeout, the upstream's word that it has too much."""
        if overloaded:
            self._overloads += 1
            return  # a refusal's latency says nothing about the upstream's queue
        self._latency_sum += latency_s
        self._samples += 1

    def in_use(self, count: int) -> None:
        """The most slots held at once during this interval."""
        self._most_in_use = max(self._most_in_use, count)

    def update(self, *, rate_per_s: float, oldest_in_progress_s: float = 0.0) -> LimitChange:
        """One interval's step. `rate_per_s`: the calls per second the budget lets this stage
        make (inf when no budget binds); `oldest_in_progress_s`: how long the oldest call
        still running has run."""
        self._update_latency(oldest_in_progress_s)
        latency = self.latency_s if self.latency_s is not None else self._prior_latency_s
        little = rate_per_s * latency * (1 + LITTLE_HEADROOM) if math.isfinite(rate_per_s) else math.inf
        new, reason = self._gradient_step()
        if reason in ("grow", "steady") and math.isfinite(little):
            new, reason = little, "little"  # healthy: what the budget needs, used or not yet
        if new > GROWTH * self._limit:
            new, reason = GROWTH * self._limit, "grow"  # after a cut, or from the start: ease in
        elif little < new:
            new, reason = little, "little"
        if new <= self.floor:
            new, reason = float(self.floor), "floor"
        if new >= self.ceiling:
            new, reason = float(self.ceiling), "ceiling"
        self._limit = new
        self.reason = reason
        self._latency_sum, self._samples, self._overloads = 0.0, 0, 0
        self._most_in_use = 0
        return LimitChange(self.limit, reason)

    def follow(self, limit: int, reason: str, *, oldest_in_progress_s: float = 0.0) -> LimitChange:
        """One interval in which the limit is set from outside (a stage's gate, to the sum of
        its routes' limits: app/limits/route_limits.py), clamped into [floor, ceiling]; the
        latency estimates still follow this interval's replies."""
        self._update_latency(oldest_in_progress_s)
        # Strictly outside only: a limit at the floor or the ceiling already says why it is there.
        if limit < self.floor:
            limit, reason = self.floor, "floor"
        if limit > self.ceiling:
            limit, reason = self.ceiling, "ceiling"
        self._limit = float(limit)
        self.reason = reason
        self._latency_sum, self._samples, self._overloads = 0.0, 0, 0
        self._most_in_use = 0
        return LimitChange(self.limit, reason)

    def _gradient_step(self) -> tuple[float, str]:
        """The limit this interval's latency and outcomes call for, before Little's bound."""
        if self._overloads:
            return self._limit * BACKOFF, "backoff"
        if not self._samples:
            # No reply this interval: nothing new to act on. Before the first one, Little's
            # bound from the prior (or the oldest call out) is all there is to go by; after
            # it, the limit stays where the replies left it (only a smaller budget lowers
            # it): raised to Little's target meanwhile, a cut would be undone by every
            # interval that calls slower than the interval leave without a reply.
            return self._limit, "steady" if self.baseline_s is None else "idle"
        if self.latency_s and self.baseline_s:
            gradient = max(MIN_GRADIENT, min(1.0, TOLERANCE * self.baseline_s / self.latency_s))
            if gradient < 1.0:
                return self._limit * (1 - SMOOTHING + SMOOTHING * gradient), "gradient"
        if self.reason in ("backoff", "gradient"):
            # Just cut: the slots held were taken under the old limit and say nothing yet.
            return self._limit, "steady"
        if self._most_in_use >= SATURATED * self.limit:
            # Healthy and every slot used, no budget to say how many are enough: grow; the
            # latency stops it where the upstream has had enough.
            return self._limit * GROWTH, "grow"
        return self._limit, "steady"  # slots to spare: nothing says more would help

    def _update_latency(self, oldest_in_progress_s: float) -> None:
        if self._samples:
            recent = self._latency_sum / self._samples
            self.latency_s = recent if self.latency_s is None else 0.5 * self.latency_s + 0.5 * recent
            if self.baseline_s is None or recent < self.baseline_s:
                self.baseline_s = recent
            else:
                self.baseline_s += BASELINE_RISE * (recent - self.baseline_s)
        elif self.latency_s is None and oldest_in_progress_s > self._prior_latency_s:
            # Nothing finished yet: what is still running says how long calls take at least.
            self.latency_s = oldest_in_progress_s
