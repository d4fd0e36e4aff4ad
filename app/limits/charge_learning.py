"""What a provider's token limiter really charges a call, learned from its own replies.

Our prompt estimate is a fixed formula (app/upstream/tokens.py); the limiter's is the
provider's own and differs by provider, model and language. A budget that reserves the
estimate where the limiter charges 0.6 of it leaves 40 % of the rate limit idle; one that
reserves it where the limiter charges 1.5 of it meets 429s. So each budget (one key and
model) learns, per kind of call (with an image, without), the ratio of what the limiter
charged to what we estimated, and reserves `ceil(estimate x ratio x (1 + margin))`.

Reading a charge. `x-ratelimit-remaining-tokens` is the limiter's level just after it
charged the call the reply answers (it charges on arrival, which on our side is the
send). Every call sent on the key gets a number in order (`Sent.seq`: a local counter,
or one counter in Redis shared by every replica using the key, so another replica's
calls are not mistaken for ours). For two calls with consecutive numbers, the second's
charge is what the level lost between them, refill included:

    charge_j = min(limit, remaining_i + refill_per_s x (sent_j - sent_i)) - remaining_j

exact whatever the other calls in flight do (nothing else of ours was sent in between),
and whether or not the limiter's bucket was full (the `min`). Readings arrive out of
order; a pair is read when its second reading arrives. A call with no reading (a broken
connection) leaves a gap: its neighbours learn nothing from each other. Callers we cannot
see on the key look like extra charges (the ratio errs high: safe); the budget's net
refill rate (app/limits/rate_learning.py) is the refill used when it has one.

Keeping it safe. The ratio starts at 1 (today's estimate); it follows the charged /
estimated sums over about `LEARN_CALLS` recent calls of its kind (ratio of sums: the
jitter of one reading cancels against its neighbour's) and moves at most `step` (a
fraction) per reading, within [`min_ratio`, `max_ratio`]. A 429 on tokens pulls the
ratio up at once by `step` and discards the sums, so a wrong learning cannot last.

Without headers (Gemini) nothing is read; the ratio is learned from 429s alone: each
pulls it up by what the wait it asked for says was missing (`retry_delay x refill`,
bounded by `step`), and it relaxes back towards 1 by `step` per `RELAX_S` without one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["KINDS", "LEARN_CALLS", "ChargeLearner", "ChargeLearning", "Sent"]

KINDS = ("text", "image")
# The sums forget a reading's weight over about this many calls of its kind: at one call
# a second, the ratio follows a change within a minute.
LEARN_CALLS = 20
# Readings before the sums say anything (one pair's jitter must not set the ratio).
MIN_SAMPLES = 3
# Readings kept while their neighbours are in flight; older ones are dropped.
KEEP_READINGS = 512
# Without headers: how long without a 429 before the ratio relaxes one step towards 1.
RELAX_S = 30.0


@dataclass(frozen=True)
class ChargeLearning:
    """The settings of every learner (`CHARGE_*`); `enabled=False` reserves the estimate."""

    enabled: bool = True
    min_ratio: float = 0.25
    max_ratio: float = 4.0
    step: float = 0.15
    margin: float = 0.02

    def __post_init__(self) -> None:
        if not 0 < self.min_ratio <= 1 <= self.max_ratio:
            raise ValueError("charge ratios must satisfy 0 < min_ratio <= 1 <= max_ratio")
        if not 0 < self.step <= 1:
            raise ValueError(f"step must be in (0, 1], got {self.step!r}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin!r}")


@dataclass(frozen=True, slots=True)
class Sent:
    """One call as sent: its number on the key (None: unknown, it teaches nothing), when
    (this process's clock), its kind and today's estimate of what the limiter counts."""

    seq: int | None
    at: float
    kind: str
    estimate: int


@dataclass(slots=True)
class _Reading:
    at: float
    remaining: int
    estimate: int  # 0: not charged (a 429): a neighbour, never a sample
    kind: str


class _Ratio:
    """One kind's learned ratio and the decayed sums it follows."""

    __slots__ = ("charged", "estimated", "samples", "value")

    def __init__(self) -> None:
        self.value = 1.0
        self.charged = self.estimated = 0.0
        self.samples = 0


class ChargeLearner:
    """The learned charge ratios of one budget (one key and model); see the module doc."""

    def __init__(self, config: ChargeLearning | None = None, *, headers: bool = True) -> None:
        self.config = config or ChargeLearning()
        self.headers = headers  # False: learn from 429s only
        self._ratios = {kind: _Ratio() for kind in KINDS}
        self._readings: dict[int, _Reading] = {}
        self._seq = 0
        self._last_429 = -math.inf
        self._relaxed_at = -math.inf
        self.charged_total = 0.0  # what the readings say the limiter charged
        self.samples_total = 0

    def ratio(self, kind: str) -> float:
        return self._ratios[kind].value if kind in self._ratios else 1.0

    def charge(self, kind: str, estimate: int) -> int:
        """What to reserve for a call `estimate` tokens by today's formula."""
        if not self.config.enabled or estimate <= 0:
            return estimate
        return math.ceil(estimate * self.ratio(kind) * (1.0 + self.config.margin))

    def next_seq(self) -> int:
        """The next number on this key, when this process alone numbers its calls."""
        self._seq += 1
        return self._seq

    # ----- readings -----------------------------------------------------------------------

    def observed(
        self, sent: Sent, remaining: int, *, limit: int, refill_per_min: float, charged: bool
    ) -> None:
        """One reply's `remaining` tokens for the call `sent`; `limit` bounds the level
        and `refill_per_min` is its refill for us. `charged`: False for a 429 (the limiter
        took nothing, its level is still a neighbour's reading)."""
        if not (self.config.enabled and self.headers) or sent.seq is None or limit <= 0:
            return
        reading = _Reading(sent.at, remaining, sent.estimate if charged else 0, sent.kind)
        self._readings[sent.seq] = reading
        if len(self._readings) > KEEP_READINGS:
            for seq in sorted(self._readings)[: len(self._readings) - KEEP_READINGS // 2]:
                del self._readings[seq]
        rate = refill_per_min / 60.0
        before = self._readings.get(sent.seq - 1)
        if before is not None:
            self._pair(before, reading, limit, rate)
        after = self._readings.get(sent.seq + 1)
        if after is not None:
            self._pair(reading, after, limit, rate)

    def _pair(self, first: _Reading, second: _Reading, limit: int, rate: float) -> None:
        if second.estimate <= 0:
            return
        level = min(float(limit), first.remaining + rate * max(0.0, second.at - first.at))
        self._learn(second.kind, level - second.remaining, second.estimate)

    def _learn(self, kind: str, charged: float, estimate: int) -> None:
        ratio = self._ratios[kind]
        keep = 1.0 - 1.0 / LEARN_CALLS
        ratio.charged = ratio.charged * keep + charged
        ratio.estimated = ratio.estimated * keep + estimate
        ratio.samples += 1
        self.charged_total += max(0.0, charged)
        self.samples_total += 1
        if ratio.samples < MIN_SAMPLES or ratio.estimated <= 0:
            return
        self._move(ratio, ratio.charged / ratio.estimated)

    def _move(self, ratio: _Ratio, target: float) -> None:
        """Towards `target`, at most one step, within the bounds."""
        cfg = self.config
        low, high = ratio.value / (1.0 + cfg.step), ratio.value * (1.0 + cfg.step)
        ratio.value = min(cfg.max_ratio, max(cfg.min_ratio, min(high, max(low, target))))

    # ----- 429s ---------------------------------------------------------------------------

    def rate_limited(self, kind: str, now: float, *, reserved: int, missing: float | None = None) -> None:
        """A 429 on tokens for a call of `kind` that reserved `reserved`: the ratio was too
        low (or another caller took the room): one step up at once, the sums discarded.
        `missing`: tokens the wait it asked for says the limiter lacked (no headers)."""
        if not self.config.enabled:
            return
        self._last_429 = self._relaxed_at = now
        ratio = self._ratios.get(kind)
        if ratio is None:
            return
        target = ratio.value * (1.0 + self.config.step)
        if missing is not None and reserved > 0:
            target = min(target, ratio.value * (1.0 + max(0.0, missing) / reserved))
        self._move(ratio, max(target, ratio.value))
        ratio.charged = ratio.estimated = 0.0
        ratio.samples = 0

    def relax(self, now: float) -> None:
        """Without headers: a step back towards 1 per `RELAX_S` without a 429, so a limit
        learned from 429s follows the provider when it loosens again."""
        if self.headers or now - max(self._last_429, self._relaxed_at) < RELAX_S:
            return
        self._relaxed_at = now
        for ratio in self._ratios.values():
            if ratio.value > 1.0:
                ratio.value = max(1.0, ratio.value / (1.0 + self.config.step))
