"""Learning the net refill rate of a shared API key from its rate-limit headers.

When the key is shared, the upstream still reports the full `x-ratelimit-limit-*`, but
its bucket refills for us only at (limit - others' use). Lowering `remaining` alone then
corrects the level on every response while our refill keeps running ahead, which becomes
a steady trickle of 429s once the upstream's minute-deep bucket is drained. So the net
refill rate is estimated from the headers, `(limit - remaining) / reset`, smoothed, and
adopted while it is below the configured and reported limits.

Only a substantial deficit (>= 10% of the limit) counts as evidence: a nearly full
upstream bucket says nothing about its refill rate, and OpenAI's reset values for tiny
deficits are unreliable (its own documented example shows `6m0s` for a 16-token
deficit). With no evidence the learned rate is dropped, so the budget recovers when the
other user stops.
"""

from __future__ import annotations

from app.limits.rate_headers import UpstreamSnapshot

__all__ = ["NetRateLearner", "learn_net_rate"]

_LEARN_MIN_DEFICIT = 0.10  # share of the limit missing upstream before reset says anything
_LEARN_WEIGHT = 0.2  # EWMA weight of a new observation


def learn_net_rate(
    previous: float | None, limit: int | None, remaining: int | None, reset_s: float | None
) -> float | None:
    """Smoothed net refill per minute implied by one response's headers (see module doc).

    Incomplete headers or a zero reset keep the previous estimate; a nearly full
    upstream bucket drops it (None)."""
    if limit is None or remaining is None or reset_s is None:
        return previous
    deficit = limit - remaining
    if deficit < _LEARN_MIN_DEFICIT * limit:
        return None  # nearly full upstream: no evidence of a constraint
    if reset_s <= 0:
        return previous
    per_minute = deficit / reset_s * 60.0
    return per_minute if previous is None else previous + _LEARN_WEIGHT * (per_minute - previous)


class NetRateLearner:
    """The learned requests- and tokens-per-minute of one key (None: no evidence)."""

    __slots__ = ("rpm", "tpm")

    def __init__(self) -> None:
        self.rpm: float | None = None
        self.tpm: float | None = None

    def observe(self, snap: UpstreamSnapshot) -> None:
        """Fold one response's headers into both estimates."""
        self.rpm = learn_net_rate(self.rpm, snap.limit_requests, snap.remaining_requests, snap.reset_requests)
        self.tpm = learn_net_rate(self.tpm, snap.limit_tokens, snap.remaining_tokens, snap.reset_tokens)

    def cap(self, rpm: int, tpm: int) -> tuple[int, int]:
        """Limits no higher than what was learned, and never below 1 (a zero rate would
        make every predicted wait infinite)."""
        if self.rpm is not None:
            rpm = max(1, min(rpm, int(self.rpm)))
        if self.tpm is not None:
            tpm = max(1, min(tpm, int(self.tpm)))
        return rpm, tpm
