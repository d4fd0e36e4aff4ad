"""What a limiter charges, learned from its `remaining` readings (app/limits/charge_learning.py),
alone and through the `RateBudget` that reserves with it. A small limiter model plays the
provider: it charges `factor` x our estimate on arrival and refills continuously, as
OpenAI's does; readings come back in any order."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from app.limits.charge_learning import BURST_S, RELAX_S, ChargeLearner, ChargeLearning, Sent, counted_plus
from app.limits.clock import FakeClock
from app.limits.rate_budget import RateBudget

LIMIT = 60_000  # tokens a minute: 1,000 a second


class Limiter:
    """A provider's token bucket: full at the start, charged on arrival, refilled per second."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.level = float(LIMIT)
        self.at = 0.0

    def arrive(self, at: float, estimate: int) -> int:
        self.level = min(float(LIMIT), self.level + (at - self.at) * LIMIT / 60)
        self.at = at
        self.level -= round(estimate * self.factor)
        return int(self.level)


Replies = list[tuple[Sent, int]]


def send(
    learner: ChargeLearner, limiter: Limiter, calls: int, *, start: float = 0.0, gap: float = 0.05
) -> Replies:
    """`calls` calls `gap` s apart (text and image in turn), as sent and as answered."""
    replies: Replies = []
    for i in range(calls):
        at = start + i * gap
        kind, estimate = ("image", 900) if i % 2 else ("text", 1_400)
        sent = learner.count(kind, estimate, at)
        replies.append((sent, limiter.arrive(at, estimate)))
    return replies


def observe(learner: ChargeLearner, replies: Replies, *, shuffle: bool = False) -> None:
    if shuffle:
        random.Random(7).shuffle(replies)
    for sent, remaining in replies:
        learner.observed(sent, remaining, limit=LIMIT, refill_per_min=LIMIT, charged=True)


@pytest.mark.parametrize("factor", [0.6, 1.5])
def test_the_ratio_converges_on_what_the_limiter_charges_whatever_the_reply_order(factor: float) -> None:
    learner = ChargeLearner()
    observe(learner, send(learner, Limiter(factor), 60), shuffle=True)
    assert learner.ratio("text") == pytest.approx(factor, rel=0.02)
    assert learner.ratio("image") == pytest.approx(factor, rel=0.02)
    assert learner.charge("text", 1_000) == pytest.approx(1_000 * factor * 1.02, abs=2)


def test_a_full_bucket_does_not_hide_the_charge() -> None:
    """Calls far apart find the limiter full again each time: the `min(limit, ...)`."""
    learner = ChargeLearner()
    observe(learner, send(learner, Limiter(0.6), 20, gap=30.0))
    assert learner.ratio("text") == pytest.approx(0.6, rel=0.02)


def test_each_kind_learns_its_own_ratio() -> None:
    learner, limiter = ChargeLearner(), Limiter(1.0)
    replies: Replies = []
    for i in range(40):
        kind, estimate = ("image", 1_000) if i % 2 else ("text", 1_000)
        limiter.factor = 0.5 if kind == "image" else 1.25  # images cost less than estimated
        sent = learner.count(kind, estimate, i * 0.1)
        replies.append((sent, limiter.arrive(sent.at, estimate)))
    observe(learner, replies)
    assert learner.ratio("image") == pytest.approx(0.5, rel=0.03)
    assert learner.ratio("text") == pytest.approx(1.25, rel=0.03)


def test_the_ratio_starts_at_the_estimate_and_moves_a_bounded_step_per_reading() -> None:
    learner = ChargeLearner(ChargeLearning(step=0.1))
    assert learner.ratio("text") == learner.ratio("image") == 1.0
    seen = [1.0]
    for sent, remaining in send(learner, Limiter(0.3), 40):
        learner.observed(sent, remaining, limit=LIMIT, refill_per_min=LIMIT, charged=True)
        seen.append(learner.ratio("text"))
    steps = [b / a for a, b in itertools.pairwise(seen)]
    assert min(steps) >= 1 / 1.1 - 1e-9
    assert learner.ratio("text") == pytest.approx(0.3, rel=0.02)


def test_the_ratio_stays_within_its_bounds() -> None:
    learner = ChargeLearner(ChargeLearning(min_ratio=0.5, max_ratio=2.0))
    observe(learner, send(learner, Limiter(0.2), 80))
    assert learner.ratio("text") == 0.5
    learner = ChargeLearner(ChargeLearning(min_ratio=0.5, max_ratio=2.0))
    observe(learner, send(learner, Limiter(5.0), 80))
    assert learner.ratio("text") == 2.0


def test_a_change_of_the_limiter_is_followed_within_a_minute_of_calls() -> None:
    learner, limiter = ChargeLearner(), Limiter(0.6)
    observe(learner, send(learner, limiter, 60))
    assert learner.ratio("text") == pytest.approx(0.6, rel=0.02)
    limiter.factor = 1.2  # the provider changed its estimator
    # A minute of traffic at one call a second (both kinds together): followed.
    observe(learner, send(learner, limiter, 60, start=limiter.at + 1, gap=1.0))
    assert learner.ratio("text") == pytest.approx(1.2, rel=0.03)
    assert learner.ratio("image") == pytest.approx(1.2, rel=0.03)


def test_a_gap_in_the_numbers_teaches_nothing_across_it() -> None:
    """A call with no reading (a broken connection) sat between two others: their levels
    differ by its charge too, which must not be read as the second's."""
    learner = ChargeLearner()
    replies = send(learner, Limiter(1.0), 30)
    observe(learner, [r for i, r in enumerate(replies) if i % 3 != 1])  # every third lost
    assert learner.ratio("text") == pytest.approx(1.0, rel=0.02)
    assert learner.ratio("image") == pytest.approx(1.0, rel=0.02)


def test_a_429_pulls_the_ratio_up_at_once_and_forgets_the_readings() -> None:
    learner = ChargeLearner(ChargeLearning(step=0.15))
    observe(learner, send(learner, Limiter(0.6), 60))
    before = learner.ratio("text")
    learner.rate_limited("text", 100.0, reserved=1_000)
    assert learner.ratio("text") == pytest.approx(before * 1.15)
    assert learner.ratio("image") == pytest.approx(0.6, rel=0.02)  # only its kind


def test_a_burst_of_429s_is_one_step_not_one_each() -> None:
    """From review: 20 calls in flight meet one full window together; their 429s must not
    take the ratio to its cap (a quarter of the limit for minutes)."""
    learner = ChargeLearner(ChargeLearning(step=0.15))
    for n in range(20):
        learner.rate_limited("text", 100.0 + n * 0.01, reserved=1_000)
    assert learner.ratio("text") == pytest.approx(1.15)
    learner.rate_limited("text", 100.19 + BURST_S, reserved=1_000)  # a later burst: one more
    assert learner.ratio("text") == pytest.approx(1.15**2)


def test_without_headers_429s_raise_the_ratio_by_what_was_missing_and_it_relaxes_back() -> None:
    learner = ChargeLearner(ChargeLearning(step=0.5), headers=False)
    learner.rate_limited("text", 0.0, reserved=1_000, missing=200)  # lacked 20 %
    assert learner.ratio("text") == pytest.approx(1.2)
    learner.rate_limited("text", 1.0, reserved=1_000, missing=5_000)  # at most one step
    assert learner.ratio("text") == pytest.approx(1.8)
    learner.relax(1.0 + RELAX_S / 2)
    assert learner.ratio("text") == pytest.approx(1.8)  # too soon
    learner.relax(1.0 + RELAX_S)
    assert learner.ratio("text") == pytest.approx(1.2)
    for i in range(2, 6):
        learner.relax(1.0 + i * RELAX_S)
    assert learner.ratio("text") == 1.0  # never below the estimate: nothing says it is lower


def test_learning_off_reserves_the_estimate() -> None:
    learner = ChargeLearner(ChargeLearning(enabled=False))
    observe(learner, send(learner, Limiter(0.5), 40))
    learner.rate_limited("text", 0.0, reserved=1_000)
    assert learner.charge("text", 1_000) == 1_000


@pytest.mark.parametrize(
    "kwargs", [{"min_ratio": 0.0}, {"min_ratio": 1.5}, {"max_ratio": 0.9}, {"step": 0.0}, {"margin": 1.0}]
)
def test_nonsense_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ChargeLearning(**kwargs)


def test_calls_of_other_replicas_in_between_are_counted_not_mistaken_for_ours() -> None:
    """Two replicas on one key, their calls interleaved at random and counted together
    (as Redis counts them): each learns the limiter's ratio from its own replies alone,
    both kinds apart, though no two of its calls are ever next to each other for sure."""
    limiter, rng = Limiter(1.0), random.Random(3)
    learners = [ChargeLearner(), ChargeLearner()]
    counted = (0.0, 0.0)
    replies: list[tuple[ChargeLearner, Sent, int]] = []
    for i in range(400):
        learner = learners[rng.random() < 0.5]
        kind = "image" if rng.random() < 0.5 else "text"
        estimate = rng.randint(600, 1_600)
        limiter.factor = 0.5 if kind == "image" else 0.8
        counted = counted_plus(counted, kind, estimate)
        sent = Sent(learner.next_number(), i * 0.05, kind, estimate, counted)
        replies.append((learner, sent, limiter.arrive(sent.at, estimate)))
    rng.shuffle(replies)
    for learner, sent, remaining in replies:
        learner.observed(sent, remaining, limit=LIMIT, refill_per_min=LIMIT, charged=True)
    for learner in learners:
        assert learner.ratio("image") == pytest.approx(0.5, rel=0.05)
        assert learner.ratio("text") == pytest.approx(0.8, rel=0.05)


# ----- through the budget ---------------------------------------------------------------


async def test_the_budget_learns_from_headers_and_a_429_on_tokens_only() -> None:
    clock = FakeClock()
    budget = RateBudget(rpm=6_000, tpm=LIMIT, clock=clock, name="m")
    limiter = Limiter(0.5)
    for _ in range(30):
        sent = await budget.sent("text", 1_000)
        remaining = limiter.arrive(clock.now(), 1_000)
        budget.observe_headers(
            {"x-ratelimit-limit-tokens": str(LIMIT), "x-ratelimit-remaining-tokens": str(remaining)},
            sent=sent,
        )
        await clock.advance(0.1)
    assert budget.charges.ratio("text") == pytest.approx(0.5, rel=0.02)
    budget.charge_refused("text", 510, 1.0, "requests")  # requests ran out: says nothing of tokens
    assert budget.charges.ratio("text") == pytest.approx(0.5, rel=0.02)
    budget.charge_refused("text", 510, 1.0, "tokens")
    assert budget.charges.ratio("text") > 0.55
