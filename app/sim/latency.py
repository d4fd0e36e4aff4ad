"""Latency sampling (lognormal) and the send schedule of a streamed response."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Below this per-send gap, sleeping per token costs more event-loop work than it
# buys realism, so tokens are batched into one write.
MIN_GAP_S = 0.002


def sample_latency(rng: random.Random, median_s: float, sigma: float, time_scale: float) -> float:
    """Lognormal with the given median and sigma, times ``time_scale``; in seconds."""
    if median_s <= 0 or time_scale <= 0:
        return 0.0
    return median_s * math.exp(rng.gauss(0.0, sigma) if sigma > 0 else 0.0) * time_scale


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """Send ``batch`` tokens per write; write ``j`` goes out ``first_delay + j * gap`` in."""

    first_delay: float
    batch: int
    gap: float


def plan_stream(latency_s: float, first_token_fraction: float, n_tokens: int) -> StreamPlan:
    """First token after ``first_token_fraction`` of the latency, the last one at its end."""
    first = latency_s * first_token_fraction
    if n_tokens <= 1:
        return StreamPlan(first, max(1, n_tokens), 0.0)
    token_gap = (latency_s - first) / (n_tokens - 1)
    if token_gap >= MIN_GAP_S:
        return StreamPlan(first, 1, token_gap)
    if token_gap <= 0:
        return StreamPlan(first, n_tokens, 0.0)
    batch = min(n_tokens, math.ceil(MIN_GAP_S / token_gap))
    return StreamPlan(first, batch, token_gap * batch)
