"""Reading `x-ratelimit-*` headers and learning a shared key's net refill rate from them
(app/limits/rate_headers.py, app/limits/rate_learning.py), alone and through the
`RateBudget` that acts on them. FakeClock: no real sleeping."""

from __future__ import annotations

import pytest

from app.limits.clock import FakeClock
from app.limits.rate_budget import RateBudget
from app.limits.rate_headers import UpstreamSnapshot, lowercase_headers, parse_reset_duration
from app.limits.rate_learning import NetRateLearner, learn_net_rate

# rpm=600 → 10 requests/s, capacity 60; tpm=60_000 → 1000 tokens/s, capacity 6000.
RPM, TPM = 600, 60_000


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def budget(clock: FakeClock) -> RateBudget:
    return RateBudget(rpm=RPM, tpm=TPM, clock=clock, name="gpt-test")


# ----- parsing --------------------------------------------------------------------------


async def test_headers_are_recorded_including_reset_durations(budget: RateBudget, clock: FakeClock) -> None:
    await clock.advance(3)
    budget.observe_headers(
        {
            "x-ratelimit-limit-requests": "600",
            "x-ratelimit-remaining-requests": "599",
            "x-ratelimit-reset-requests": "100ms",
            "x-ratelimit-reset-tokens": "1m30.5s",
        }
    )
    snap = budget.last_upstream
    assert snap is not None
    assert snap.observed_at == 3
    assert (snap.limit_requests, snap.remaining_requests) == (600, 599)
    assert (snap.limit_tokens, snap.remaining_tokens) == (None, None)
    assert snap.reset_requests == pytest.approx(0.1)
    assert snap.reset_tokens == 90.5


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0s", 0.0),
        ("120ms", 0.12),
        ("1s", 1.0),
        ("6m0s", 360.0),
        ("1m30.5s", 90.5),
        ("1h2m3s", 3723.0),
        ("250us", 0.00025),
        ("7.66s", 7.66),
        (" 2s ", 2.0),
        ("1.5", 1.5),  # bare seconds, as in Retry-After
    ],
)
def test_parse_reset_duration_accepts_openai_formats(text: str, seconds: float) -> None:
    assert parse_reset_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "soon", "5x", "1s2", "s", "-1s", "1m-2s", "inf", "nan"])
def test_parse_reset_duration_returns_none_for_garbage(text: str) -> None:
    assert parse_reset_duration(text) is None


def test_snapshot_reads_all_six_headers_and_none_for_each_bad_one() -> None:
    good = UpstreamSnapshot.from_headers(
        {
            "x-ratelimit-limit-requests": "500",
            "x-ratelimit-limit-tokens": "200000",
            "x-ratelimit-remaining-requests": "499",
            "x-ratelimit-remaining-tokens": "199000.0",  # a float count is floored, not refused
            "x-ratelimit-reset-requests": "120ms",
            "x-ratelimit-reset-tokens": "6m0s",
        },
        observed_at=7.0,
    )
    assert good == UpstreamSnapshot(7.0, 500, 200_000, 499, 199_000, 0.12, 360.0)
    bad = UpstreamSnapshot.from_headers(
        {
            "x-ratelimit-limit-requests": "-1",
            "x-ratelimit-limit-tokens": "inf",
            "x-ratelimit-remaining-requests": None,
            "x-ratelimit-reset-requests": 5,
            "x-ratelimit-reset-tokens": "soon",
        },
        observed_at=0.0,
    )
    assert bad == UpstreamSnapshot(0.0, None, None, None, None, None, None)


class _Unreadable(dict[str, str]):
    def items(self) -> object:  # type: ignore[override]
        raise RuntimeError("broken header mapping")


def test_unreadable_header_mapping_is_ignored_whole(budget: RateBudget) -> None:
    assert lowercase_headers({"X-RateLimit-Limit-Tokens": "1"}) == {"x-ratelimit-limit-tokens": "1"}
    assert lowercase_headers(_Unreadable()) is None
    budget.observe_headers(_Unreadable())
    assert budget.last_upstream is None
    assert (budget.effective_rpm, budget.available_tokens) == (RPM, 6000)


# ----- learning a shared key's net refill rate ----------------------------------------


def test_learned_rate_is_an_ewma_of_deficit_over_reset() -> None:
    assert learn_net_rate(None, 600, 300, 60.0) == 300  # 300 missing, full again in 60 s
    assert learn_net_rate(300.0, 600, 0, 60.0) == pytest.approx(300 + 0.2 * (600 - 300))
    assert learn_net_rate(300.0, 600, 300, 0.0) == 300  # zero reset: no rate, keep the estimate
    assert learn_net_rate(300.0, None, 300, 60.0) == 300  # incomplete headers: keep it
    assert learn_net_rate(300.0, 600, 541, 60.0) is None  # <10% missing: no evidence, forget


def test_learner_caps_limits_but_never_below_one() -> None:
    learner = NetRateLearner()
    assert learner.cap(RPM, TPM) == (RPM, TPM)  # nothing learned
    learner.rpm, learner.tpm = 0.4, 30_000.9
    assert learner.cap(RPM, TPM) == (1, 30_000)
    assert learner.cap(RPM, 1000) == (1, 1000)  # the learned rate only ever lowers


def shared_key_headers(remaining: int, reset: str) -> dict[str, str]:
    return {
        "x-ratelimit-limit-requests": str(RPM),
        "x-ratelimit-remaining-requests": str(remaining),
        "x-ratelimit-reset-requests": reset,
    }


async def test_net_refill_rate_is_learned_from_a_drained_shared_key(budget: RateBudget) -> None:
    # The upstream reports the full 600 RPM, but refills 300 missing requests in 60 s:
    # someone else uses half the key. The budget converges to 300 RPM.
    for _ in range(30):
        budget.observe_headers(shared_key_headers(300, "1m0s"))
    assert budget.effective_rpm == pytest.approx(300, abs=2)


async def test_learned_rate_never_exceeds_the_configured_limit(budget: RateBudget) -> None:
    for _ in range(10):
        budget.observe_headers(shared_key_headers(0, "1s"))  # implies 36,000 RPM
    assert budget.effective_rpm == RPM


async def test_learned_rate_is_forgotten_when_the_upstream_is_full_again(budget: RateBudget) -> None:
    for _ in range(10):
        budget.observe_headers(shared_key_headers(300, "1m0s"))
    assert budget.effective_rpm < RPM
    budget.observe_headers(shared_key_headers(RPM - 1, "100ms"))
    assert budget.effective_rpm == RPM


async def test_reset_of_a_tiny_deficit_is_not_evidence(budget: RateBudget) -> None:
    # OpenAI's documented example: 16 tokens missing of 150,000, reset "6m0s".
    budget.observe_headers(
        {
            "x-ratelimit-limit-tokens": "150000",
            "x-ratelimit-remaining-tokens": "149984",
            "x-ratelimit-reset-tokens": "6m0s",
        }
    )
    assert budget.effective_tpm == TPM
