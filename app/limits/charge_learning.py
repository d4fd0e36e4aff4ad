"""What a provider's token limiter really charges a call, learned from its own replies.

Our prompt estimate is a fixed formula (app/upstream/tokens.py); the limiter's is the
provider's own and differs by provider, model and language. A budget that reserves the
estimate where the limiter charges 0.6 of it leaves 40 % of the rate limit idle; one that
reserves it where the limiter charges 1.5 of it meets 429s. So each budget (one key and
model) learns, per kind of call (with an image, without), the ratio of what the limiter
charged to what we estimated, and reserves `ceil(estimate x ratio x (1 + margin))`.

Reading a charge. `x-ratelimit-remaining-tokens` is the limiter's level just after it
charged the call the reply answers (it charges on arrival, which on our side is the
send). Each call is counted as it is sent (`Sent.counted`: the running sums of the
estimates sent on the key so far, per kind, this call's included; kept locally, or in
Redis where the replicas share the key, so that they count each other's calls too). For
two of this process's calls sent one after the other, i and j, what the limiter charged
for everything sent after i up to j is what its level lost between them, refill included:

    charged = min(limit, remaining_i + refill_per_s x (sent_j - sent_i)) - remaining_j

and what we estimated for the same calls is `counted_j - counted_i`. Alone on a key the
interval holds j only: its charge exactly, whether or not the limiter's bucket was full
(the `min`). With other replicas' calls in it, the `min` makes it a lower bound when the
bucket filled up in between (then the key has room to spare, and the error is undone
once the budget spends it). Readings arrive out of order; an interval is read when its
second reading arrives; a call of ours with no reading (a broken connection) leaves a gap
nobody reads across. The ratios per kind are the weighted least-squares fit of
`charged = ratio_text x estimated_text + ratio_image x estimated_image` over about
`LEARN_CALLS` recent intervals, each weighted by 1 / its estimate (alone on a key: the
ratio of the sums of charges and estimates, where one reading's jitter cancels against
its neighbour's), pulled lightly towards the ratios in force where the intervals cannot
tell the kinds apart. Callers we cannot see on the key look like extra charges (the ratio
errs high: safe); the budget's net refill rate (app/limits/rate_learning.py) is the
refill used when it has one.

Keeping it safe. The ratios start at 1 (today's estimate), move at most `step` (a
fraction) per reading, within [`min_ratio`, `max_ratio`]. A 429 on tokens pulls its
kind's ratio up at once by `step` and discards the sums, so a wrong learning cannot last.

Without headers (Gemini) nothing is read; the ratio is learned from 429s alone: each
pulls it up by what the wait it asked for says was missing (`retry_delay x refill`,
bounded by `step`), and it relaxes back towards 1 by `step` per `RELAX_S` without one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["KINDS", "LEARN_CALLS", "ChargeLearner", "ChargeLearning", "Sent"]

KINDS = ("text", "image")
# The sums forget an interval's weight over about this many intervals: at one call a
# second, the ratio follows a change within a minute.
LEARN_CALLS = 10
# Intervals holding a kind before its ratio moves (one reading's jitter must not set it).
MIN_SAMPLES = 3
# How strongly the fit leans on the ratios in force, as a share of the data's weight:
# enough to settle kinds the intervals never separate, too little to bias the others.
PRIOR_WEIGHT = 0.05
# Readings kept while their neighbours are in flight; older ones are dropped.
KEEP_READINGS = 512
# Without headers: how long without a 429 before the ratio relaxes one step towards 1.
RELAX_S = 30.0
# 429s this close to the last one are of the same burst: the ratio steps up once for them.
BURST_S = 1.0

Counted = tuple[float, float]  # running sums of estimates sent, text and image


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
    """One call as sent: this process's number for it (None: not counted, it teaches
    nothing), when (this process's clock), its kind, today's estimate of what the limiter
    counts, and the key's running sums of estimates once it was counted."""

    number: int | None
    at: float
    kind: str
    estimate: int
    counted: Counted = (0.0, 0.0)


def counted_plus(counted: Counted, kind: str, estimate: float) -> Counted:
    text, image = counted
    return (text, image + estimate) if kind == "image" else (text + estimate, image)


@dataclass(slots=True)
class _Reading:
    sent: Sent
    remaining: int
    charged: bool  # False: a 429, the limiter took nothing for it


class _Fit:
    """Decayed weighted least squares of charged = r . estimated (two kinds)."""

    __slots__ = ("a", "b", "samples")

    def __init__(self) -> None:
        self.a = [[0.0, 0.0], [0.0, 0.0]]
        self.b = [0.0, 0.0]
        self.samples = [0, 0]

    def add(self, x: Counted, charged: float) -> None:
        weight = 1.0 / (x[0] + x[1])
        keep = 1.0 - 1.0 / LEARN_CALLS
        for i in range(2):
            self.b[i] = self.b[i] * keep + weight * x[i] * charged
            for j in range(2):
                self.a[i][j] = self.a[i][j] * keep + weight * x[i] * x[j]
            self.samples[i] += x[i] > 0

    def solve(self, prior: tuple[float, float]) -> tuple[float, float]:
        """The fit, leaning on `prior` by `PRIOR_WEIGHT` of the data's weight."""
        (a, h), (_, d) = self.a
        lam = PRIOR_WEIGHT * (a + d) / 2
        a, d = a + lam, d + lam
        b1, b2 = self.b[0] + lam * prior[0], self.b[1] + lam * prior[1]
        det = a * d - h * h
        if det <= 0:
            return prior
        return (d * b1 - h * b2) / det, (a * b2 - h * b1) / det


class ChargeLearner:
    """The learned charge ratios of one budget (one key and model); see the module doc."""

    def __init__(self, config: ChargeLearning | None = None, *, headers: bool = True) -> None:
        self.config = config or ChargeLearning()
        self.headers = headers  # False: learn from 429s only
        self._ratios = [1.0, 1.0]  # text, image
        self._fit = _Fit()
        self._readings: dict[int, _Reading] = {}
        self._number = 0
        self._counted: Counted = (0.0, 0.0)
        self._last_429 = -math.inf
        self._relaxed_at = -math.inf

    def ratio(self, kind: str) -> float:
        return self._ratios[_index(kind)]

    def charge(self, kind: str, estimate: int) -> int:
        """What to reserve for a call `estimate` tokens by today's formula."""
        if not self.config.enabled or estimate <= 0:
            return estimate
        return math.ceil(estimate * self.ratio(kind) * (1.0 + self.config.margin))

    def next_number(self) -> int:
        self._number += 1
        return self._number

    def count(self, kind: str, estimate: int, at: float) -> Sent:
        """A call about to be sent, counted here: this process alone on its key."""
        self._counted = counted_plus(self._counted, kind, estimate)
        return Sent(self.next_number(), at, kind, estimate, self._counted)

    # ----- readings -----------------------------------------------------------------------

    def observed(
        self, sent: Sent, remaining: int, *, limit: int, refill_per_min: float, charged: bool
    ) -> None:
        """One reply's `remaining` tokens for the call `sent`; `limit` bounds the level
        and `refill_per_min` is its refill for us. `charged`: False for a 429 (the limiter
        took nothing, its level is still a neighbour's reading)."""
        if not (self.config.enabled and self.headers) or sent.number is None or limit <= 0:
            return
        reading = _Reading(sent, remaining, charged)
        self._readings[sent.number] = reading
        if len(self._readings) > KEEP_READINGS:
            for number in sorted(self._readings)[: len(self._readings) - KEEP_READINGS // 2]:
                del self._readings[number]
        rate = refill_per_min / 60.0
        before = self._readings.get(sent.number - 1)
        if before is not None:
            self._interval(before, reading, limit, rate)
        after = self._readings.get(sent.number + 1)
        if after is not None:
            self._interval(reading, after, limit, rate)

    def _interval(self, first: _Reading, second: _Reading, limit: int, rate: float) -> None:
        one, two = first.sent, second.sent
        x = (two.counted[0] - one.counted[0], two.counted[1] - one.counted[1])
        if not second.charged:  # counted as sent, charged nothing: not in the interval
            x = counted_plus(x, two.kind, -two.estimate)
        if min(x) < 0 or x[0] + x[1] <= 0:
            return  # counted out of order (concurrent sends of ours): nothing to read
        level = min(float(limit), first.remaining + rate * max(0.0, two.at - one.at))
        self._fit.add(x, level - second.remaining)
        fitted = self._fit.solve((self._ratios[0], self._ratios[1]))
        for i in range(2):
            if self._fit.samples[i] >= MIN_SAMPLES:
                self._ratios[i] = self._stepped(self._ratios[i], fitted[i])

    def _stepped(self, value: float, target: float) -> float:
        """From `value` towards `target`, at most one step, within the bounds."""
        cfg = self.config
        low, high = value / (1.0 + cfg.step), value * (1.0 + cfg.step)
        return min(cfg.max_ratio, max(cfg.min_ratio, min(high, max(low, target))))

    # ----- 429s ---------------------------------------------------------------------------

    def rate_limited(self, kind: str, now: float, *, reserved: int, missing: float | None = None) -> None:
        """A 429 on tokens for a call of `kind` that reserved `reserved`: the ratio was too
        low (or another caller took the room): one step up at once, the sums discarded.
        `missing`: tokens the wait it asked for says the limiter lacked, what bounds the
        step where no headers come (with headers, the readings take over from here)."""
        if not self.config.enabled:
            return
        # A burst of calls in flight meets one full window together: its 429s are one
        # lesson, not one step each (20 of them would otherwise take the ratio to its cap
        # and the budget to a quarter of the limit for minutes).
        burst = now - self._last_429 < BURST_S
        self._last_429 = self._relaxed_at = now
        if burst:
            return
        i = _index(kind)
        value = self._ratios[i]
        target = value * (1.0 + self.config.step)
        if missing is not None and reserved > 0 and not self.headers:
            target = min(target, value * (1.0 + max(0.0, missing) / reserved))
        self._ratios[i] = self._stepped(value, max(target, value))
        self._fit = _Fit()

    def relax(self, now: float) -> None:
        """Without headers: a step back towards 1 per `RELAX_S` without a 429, so a limit
        learned from 429s follows the provider when it loosens again."""
        if self.headers or now - max(self._last_429, self._relaxed_at) < RELAX_S:
            return
        self._relaxed_at = now
        self._ratios = [max(1.0, r / (1.0 + self.config.step)) if r > 1.0 else r for r in self._ratios]


def _index(kind: str) -> int:
    return 1 if kind == "image" else 0
