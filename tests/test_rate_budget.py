"""RateBudget behaviour, driven entirely by FakeClock (no real sleeping)."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from app.limits.clock import FakeClock, MonotonicClock
from app.limits.rate_budget import (
    BudgetDeadlineExceeded,
    BudgetError,
    RateBudget,
    Reservation,
)

# rpm=600 → 10 requests/s, capacity 60; tpm=60_000 → 1000 tokens/s, capacity 6000.
RPM, TPM = 600, 60_000

Log = list[tuple[str, float]]
Spawn = Callable[..., Coroutine[Any, Any, "asyncio.Task[Reservation]"]]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def budget(clock: FakeClock) -> RateBudget:
    return RateBudget(rpm=RPM, tpm=TPM, clock=clock, name="gpt-test")


@pytest.fixture
def log() -> Log:
    return []


@pytest.fixture
async def spawn(clock: FakeClock, log: Log) -> AsyncIterator[Spawn]:
    """Start `budget.reserve(...)` in a task, logging (label, admit time); cancel leftovers."""
    tasks: list[asyncio.Task[Reservation]] = []

    async def start(
        budget: RateBudget, tokens: int, label: str, deadline: float | None = None
    ) -> asyncio.Task[Reservation]:
        async def run() -> Reservation:
            reservation = await budget.reserve(tokens, deadline=deadline)
            log.append((label, clock.now()))
            return reservation

        task = asyncio.create_task(run())
        tasks.append(task)
        await clock.advance(0)  # let it reach the queue: arrival order = spawn order
        return task

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def admitted(log: Log) -> Log:
    """The log with admit times rounded to the microsecond (float refill arithmetic)."""
    return [(label, round(t, 6)) for label, t in log]


async def drain_tokens(budget: RateBudget) -> Reservation:
    """Take the whole token bucket (6000) in one reservation, leaving 0 tokens."""
    return await budget.reserve(int(budget.available_tokens))


# ----- construction ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        ({"rpm": 0}, "rpm"),
        ({"rpm": -5}, "rpm"),
        ({"rpm": 1.5}, "rpm"),
        ({"rpm": True}, "rpm"),
        ({"tpm": 0}, "tpm"),
        ({"tpm": "1000"}, "tpm"),
        ({"burst_fraction": 0.0}, "burst_fraction"),
        ({"burst_fraction": -0.1}, "burst_fraction"),
        ({"burst_fraction": 1.5}, "burst_fraction"),
        ({"burst_fraction": math.nan}, "burst_fraction"),
    ],
)
def test_constructor_rejects_bad_argument_by_name(clock: FakeClock, kwargs: dict[str, Any], bad: str) -> None:
    args: dict[str, Any] = {"rpm": RPM, "tpm": TPM, "clock": clock, **kwargs}
    with pytest.raises(ValueError, match=bad):
        RateBudget(**args)


def test_buckets_start_full_at_limit_times_burst_fraction(budget: RateBudget) -> None:
    assert budget.request_capacity == 60
    assert budget.token_capacity == 6000
    assert budget.available_requests == 60
    assert budget.available_tokens == 6000
    assert (budget.effective_rpm, budget.effective_tpm) == (RPM, TPM)
    assert budget.waiting == 0
    assert "gpt-test" in repr(budget)


def test_full_burst_fraction_allows_a_whole_minute(clock: FakeClock) -> None:
    b = RateBudget(rpm=RPM, tpm=TPM, burst_fraction=1.0, clock=clock)
    assert (b.available_requests, b.available_tokens) == (RPM, TPM)


def test_capacity_is_at_least_one_request_and_one_token(clock: FakeClock) -> None:
    b = RateBudget(rpm=5, tpm=3, burst_fraction=0.1, clock=clock)
    assert (b.request_capacity, b.token_capacity) == (1.0, 1.0)


def test_default_clock_is_monotonic() -> None:
    b = RateBudget(rpm=RPM, tpm=TPM)
    assert b.available_requests == 60
    assert MonotonicClock().now() <= MonotonicClock().now()


async def test_reserve_rejects_negative_tokens(budget: RateBudget) -> None:
    with pytest.raises(ValueError, match="tokens"):
        await budget.reserve(-1)


# ----- refill and burst cap -------------------------------------------------------------


async def test_reserve_within_budget_is_admitted_without_waiting(budget: RateBudget) -> None:
    r = await budget.reserve(1000)  # no advance: must not need the clock
    assert r.tokens == 1000
    assert budget.available_tokens == 5000
    assert budget.available_requests == 59


async def test_refill_is_linear_in_time_and_capped_at_capacity(budget: RateBudget, clock: FakeClock) -> None:
    await drain_tokens(budget)
    for _ in range(29):
        await budget.reserve(0)
    assert (budget.available_requests, budget.available_tokens) == (30, 0)
    await clock.advance(2)  # +20 requests, +2000 tokens
    assert budget.available_requests == pytest.approx(50)
    assert budget.available_tokens == pytest.approx(2000)
    await clock.advance(2)  # requests hit the cap (60), tokens keep going
    assert budget.available_requests == pytest.approx(60)
    assert budget.available_tokens == pytest.approx(4000)
    await clock.advance(600)
    assert (budget.available_requests, budget.available_tokens) == (60, 6000)


async def test_request_bucket_limits_admission_at_rpm(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    for _ in range(60):
        await budget.reserve(0)
    await spawn(budget, 0, "61st")
    assert admitted(log) == []
    assert budget.predicted_wait(0) == pytest.approx(0.2)  # behind the 61st: 2 requests
    await clock.advance(0.1)
    assert admitted(log) == [("61st", 0.1)]


# ----- FIFO ------------------------------------------------------------------------------


async def test_fifo_big_head_blocks_later_small_requests_and_order_is_kept(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    await drain_tokens(budget)
    await spawn(budget, 5000, "big")
    await spawn(budget, 100, "small1")
    await spawn(budget, 100, "small2")
    assert budget.waiting == 3
    await clock.advance(1)  # 1000 tokens: both smalls would fit, but the big one is ahead
    assert admitted(log) == []
    await clock.advance(10)
    assert admitted(log) == [
        ("big", 5.0),
        ("small1", 5.1),
        ("small2", 5.2),
    ]
    assert budget.waiting == 0


async def test_new_small_request_queues_behind_waiters_even_if_it_fits(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    await budget.reserve(5000)  # 1000 tokens left
    await spawn(budget, 3000, "big")
    late = await spawn(budget, 10, "late")  # fits in the 1000 available, must not overtake
    assert not late.done()
    assert budget.waiting == 2
    await clock.advance(3)
    # big takes 3000 at t=2 leaving 0; late then waits 0.01s for its 10 tokens.
    assert admitted(log) == [("big", 2.0), ("late", 2.01)]


# ----- settle -------------------------------------------------------------------------


async def test_settle_refunds_unused_tokens(budget: RateBudget) -> None:
    r = await budget.reserve(1000)
    assert r.settle(400) is True
    assert budget.available_tokens == 5600
    assert budget.available_requests == 59  # the request itself was used


async def test_settle_charges_extra_usage(budget: RateBudget) -> None:
    r = await budget.reserve(1000)
    r.settle(2500)
    assert budget.available_tokens == 3500


async def test_settle_extra_charge_can_create_debt(budget: RateBudget) -> None:
    r = await drain_tokens(budget)
    r.settle(8000)
    assert budget.available_tokens == -2000
    assert budget.predicted_wait(100) == pytest.approx(2.1)


async def test_settle_none_refunds_tokens_and_the_request(budget: RateBudget) -> None:
    r = await budget.reserve(1000)
    r.settle(None)
    assert budget.available_tokens == 6000
    assert budget.available_requests == 60


async def test_second_settle_is_ignored(budget: RateBudget) -> None:
    r = await budget.reserve(1000)
    assert r.settle(0) is True
    assert r.settled
    assert r.settle(None) is False
    assert r.settle(5000) is False
    assert budget.available_tokens == 6000
    assert budget.available_requests == 59


async def test_settle_refund_is_capped_at_capacity(budget: RateBudget, clock: FakeClock) -> None:
    r = await budget.reserve(1000)
    await clock.advance(60)  # bucket is full again
    r.settle(0)
    assert budget.available_tokens == 6000


async def test_settle_rejects_negative_usage(budget: RateBudget) -> None:
    r = await budget.reserve(10)
    with pytest.raises(ValueError, match="actual_tokens"):
        r.settle(-1)
    assert not r.settled


async def test_refund_wakes_the_head_early(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    first = await drain_tokens(budget)
    await spawn(budget, 3000, "waiter")  # would be admitted at t=3
    await clock.advance(1)
    first.settle(1000)  # 5000 back
    await clock.advance(0)
    assert admitted(log) == [("waiter", 1.0)]


# ----- headers -------------------------------------------------------------------------


async def test_lower_upstream_remaining_lowers_available(budget: RateBudget) -> None:
    budget.observe_headers({"x-ratelimit-remaining-requests": "12", "x-ratelimit-remaining-tokens": "1500"})
    assert budget.available_requests == 12
    assert budget.available_tokens == 1500


async def test_higher_upstream_remaining_never_raises_available(budget: RateBudget) -> None:
    await budget.reserve(5000)
    budget.observe_headers(
        {"x-ratelimit-remaining-requests": "9999", "x-ratelimit-remaining-tokens": "59000"}
    )
    assert budget.available_requests == 59
    assert budget.available_tokens == 1000


async def test_lower_upstream_limit_lowers_rate_and_capacity(budget: RateBudget, clock: FakeClock) -> None:
    budget.observe_headers({"x-ratelimit-limit-requests": "300", "x-ratelimit-limit-tokens": "30000"})
    assert (budget.effective_rpm, budget.effective_tpm) == (300, 30_000)
    assert (budget.request_capacity, budget.token_capacity) == (30, 3000)
    assert budget.available_tokens == 3000  # clamped to the new capacity
    await drain_tokens(budget)
    await clock.advance(1)
    assert budget.available_tokens == pytest.approx(500)  # 30_000 / 60 per second


async def test_higher_upstream_limit_does_not_raise_configured_limit(budget: RateBudget) -> None:
    budget.observe_headers({"x-ratelimit-limit-requests": "10000", "x-ratelimit-limit-tokens": "2000000"})
    assert (budget.effective_rpm, budget.effective_tpm) == (RPM, TPM)
    assert budget.token_capacity == 6000


async def test_latest_upstream_limit_wins_up_to_configured(budget: RateBudget) -> None:
    budget.observe_headers({"x-ratelimit-limit-tokens": "30000"})
    budget.observe_headers({"x-ratelimit-limit-tokens": "45000"})
    assert budget.effective_tpm == 45_000


async def test_headers_are_case_insensitive(budget: RateBudget) -> None:
    budget.observe_headers({"X-RateLimit-Remaining-Tokens": "100", "X-RATELIMIT-LIMIT-REQUESTS": "60"})
    assert budget.available_tokens == 100
    assert budget.effective_rpm == 60


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"x-ratelimit-remaining-tokens": "lots", "x-ratelimit-limit-requests": "-5"},
        {"x-ratelimit-limit-tokens": "0", "x-ratelimit-remaining-requests": "nan"},
        {"x-ratelimit-reset-tokens": "soon", "x-ratelimit-limit-tokens": ""},
        {"content-type": "application/json"},
    ],
)
async def test_missing_or_garbage_headers_are_ignored(budget: RateBudget, headers: dict[str, str]) -> None:
    budget.observe_headers(headers)
    assert (budget.effective_rpm, budget.effective_tpm) == (RPM, TPM)
    assert (budget.available_requests, budget.available_tokens) == (60, 6000)


async def test_non_string_header_values_are_ignored(budget: RateBudget) -> None:
    budget.observe_headers({"x-ratelimit-remaining-tokens": None})  # type: ignore[dict-item]
    assert budget.available_tokens == 6000


async def test_header_correction_wakes_head_to_wait_longer(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    await budget.reserve(3000)
    await spawn(budget, 6000, "head")  # predicted admission at t=3
    await clock.advance(1)  # 4000 available
    budget.observe_headers({"x-ratelimit-remaining-tokens": "0"})
    await clock.advance(2.5)  # t=3.5: only 2500 now
    assert admitted(log) == []
    await clock.advance(10)
    assert admitted(log) == [("head", 7.0)]


# ----- pause ---------------------------------------------------------------------------


async def test_pause_blocks_admission_until_it_expires(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    budget.pause(5)
    assert budget.paused_until == 5
    await spawn(budget, 10, "a")
    await spawn(budget, 10, "b")
    await clock.advance(4.9)
    assert admitted(log) == []
    await clock.advance(0.1)
    assert admitted(log) == [("a", 5.0), ("b", 5.0)]


async def test_pause_is_extended_but_never_shortened(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    budget.pause(5)
    await spawn(budget, 10, "a")
    await clock.advance(1)
    budget.pause(10)  # until t=11
    budget.pause(1)  # would end at t=2: ignored
    assert budget.paused_until == 11
    await clock.advance(9.9)
    assert admitted(log) == []
    await clock.advance(0.1)
    assert admitted(log) == [("a", 11.0)]


async def test_pause_keeps_buckets_refilling(budget: RateBudget, clock: FakeClock) -> None:
    await drain_tokens(budget)
    budget.pause(3)
    await clock.advance(3)
    assert budget.available_tokens == pytest.approx(3000)


def test_pause_rejects_negative_or_nan(budget: RateBudget) -> None:
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="seconds"):
            budget.pause(bad)


# ----- deadlines ----------------------------------------------------------------------


async def test_reserve_after_its_deadline_is_refused_even_if_it_fits(
    budget: RateBudget, clock: FakeClock
) -> None:
    await clock.advance(5)
    with pytest.raises(BudgetDeadlineExceeded):
        await budget.reserve(10, deadline=4.0)
    assert budget.available_tokens == 6000
    assert (await budget.reserve(10, deadline=5.0)).tokens == 10  # deadline == now is fine


async def test_predictably_late_reserve_is_refused_immediately(budget: RateBudget, clock: FakeClock) -> None:
    await drain_tokens(budget)
    with pytest.raises(BudgetDeadlineExceeded):
        await budget.reserve(3000, deadline=2.0)  # needs 3s
    assert budget.waiting == 0
    assert clock.sleepers == 0
    assert clock.now() == 0
    assert budget.available_tokens == 0


async def test_deadline_counts_the_queue_ahead(budget: RateBudget, spawn: Spawn, clock: FakeClock) -> None:
    await drain_tokens(budget)
    await spawn(budget, 3000, "head")
    with pytest.raises(BudgetError):  # alone it would need 0.1s, behind the head 3.1s
        await budget.reserve(100, deadline=3.0)
    assert budget.waiting == 1


async def test_reserve_within_deadline_is_admitted(
    budget: RateBudget, spawn: Spawn, clock: FakeClock, log: Log
) -> None:
    await drain_tokens(budget)
    await spawn(budget, 3000, "a", deadline=3.0)
    await clock.advance(3)
    assert admitted(log) == [("a", 3.0)]


async def test_deadline_passing_while_queued_raises_and_queue_continues(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    await drain_tokens(budget)
    await spawn(budget, 3000, "head")  # t=3
    middle = await spawn(budget, 100, "middle", deadline=3.5)  # predicted t=3.1: accepted
    await spawn(budget, 100, "tail")
    budget.pause(10)  # head now waits until t=10; middle finds out when its deadline passes
    await clock.advance(3.5)
    assert middle.done()
    with pytest.raises(BudgetDeadlineExceeded):
        middle.result()
    assert budget.waiting == 2
    await clock.advance(10)
    assert admitted(log) == [("head", 10.0), ("tail", 10.0)]


async def test_head_leaving_on_deadline_hands_over_to_the_next_waiter(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    await drain_tokens(budget)
    head = await spawn(budget, 3000, "head", deadline=4.0)
    await spawn(budget, 100, "next")
    budget.observe_headers({"x-ratelimit-limit-tokens": "6000"})  # 100 tokens/s: head needs 30s
    await clock.advance(0)
    assert head.done()
    with pytest.raises(BudgetDeadlineExceeded):
        head.result()
    assert budget.waiting == 1
    await clock.advance(1)  # next needs 100 tokens at 100/s
    assert admitted(log) == [("next", 1.0)]


# ----- cancellation -------------------------------------------------------------------


async def test_cancelled_head_takes_nothing_and_next_waiter_moves_up(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    await drain_tokens(budget)
    head = await spawn(budget, 3000, "head")
    await spawn(budget, 100, "next")
    await clock.advance(1)
    head.cancel()
    await clock.advance(0)
    assert head.cancelled()
    # next (100 tokens) fits in the 1000 refilled: admitted right away
    assert admitted(log) == [("next", 1.0)]
    assert budget.available_tokens == pytest.approx(900)
    assert budget.available_requests == pytest.approx(59)  # only drain + next took requests
    assert budget.waiting == 0


async def test_cancelled_middle_waiter_leaves_queue_consistent(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    await drain_tokens(budget)
    await spawn(budget, 3000, "head")
    middle = await spawn(budget, 2000, "middle")
    await spawn(budget, 100, "tail")
    assert budget.predicted_wait(0) == pytest.approx(5.1)
    middle.cancel()
    await clock.advance(0)
    assert budget.waiting == 2
    assert budget.predicted_wait(0) == pytest.approx(3.1)
    await clock.advance(5)
    assert admitted(log) == [("head", 3.0), ("tail", 3.1)]


async def test_cancelled_sole_waiter_leaves_no_trace(
    budget: RateBudget, clock: FakeClock, spawn: Spawn
) -> None:
    await drain_tokens(budget)
    only = await spawn(budget, 3000, "only")
    only.cancel()
    await clock.advance(0)
    assert budget.waiting == 0
    assert clock.sleepers == 0
    await clock.advance(2)
    assert budget.available_tokens == pytest.approx(2000)
    assert (await budget.reserve(2000)).tokens == 2000  # fast path works again


# ----- predicted_wait -----------------------------------------------------------------


async def test_predicted_wait_is_zero_when_it_fits_now(budget: RateBudget) -> None:
    assert budget.predicted_wait(6000) == 0.0


async def test_predicted_wait_from_refill_rate(budget: RateBudget) -> None:
    await budget.reserve(5000)
    assert budget.predicted_wait(3000) == pytest.approx(2.0)


async def test_predicted_wait_includes_queued_demands(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    await drain_tokens(budget)
    await spawn(budget, 2000, "a")
    await spawn(budget, 1000, "b")
    predicted = budget.predicted_wait(500)
    assert predicted == pytest.approx(3.5)
    await spawn(budget, 500, "c")
    await clock.advance(10)
    assert admitted(log)[-1] == ("c", round(predicted, 6))


async def test_predicted_wait_counts_requests_expected_ahead(budget: RateBudget) -> None:
    await drain_tokens(budget)
    alone = budget.predicted_wait(500)
    # Three more 500-token calls owed by admitted scans will be served first.
    assert budget.predicted_wait(500, ahead=3) == pytest.approx(alone + 3 * 0.5)
    # Many owed calls (thousands of scans in flight) are priced the same way.
    assert budget.predicted_wait(500, ahead=1000) == pytest.approx(alone + 1000 * 0.5)


async def test_predicted_wait_during_pause(budget: RateBudget) -> None:
    budget.pause(4)
    assert budget.predicted_wait(100) == pytest.approx(4.0)


async def test_predicted_wait_during_pause_still_counts_refill(budget: RateBudget) -> None:
    await drain_tokens(budget)
    budget.pause(2)  # the bucket refills during the pause: 2000 tokens by its end
    assert budget.predicted_wait(1000) == pytest.approx(2.0)
    assert budget.predicted_wait(5000) == pytest.approx(5.0)  # refill is the bottleneck


async def test_pause_wakes_the_head_to_wait_longer(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    await drain_tokens(budget)
    await spawn(budget, 1000, "head")  # t=1
    budget.pause(4)
    await clock.advance(3.9)
    assert admitted(log) == []
    await clock.advance(0.1)
    assert admitted(log) == [("head", 4.0)]


# ----- oversize requests (debt) -------------------------------------------------------


async def test_oversize_request_is_admitted_when_bucket_is_full_and_leaves_debt(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    r = await budget.reserve(10_000)  # capacity is 6000
    assert r.tokens == 10_000
    assert budget.available_tokens == -4000
    assert budget.predicted_wait(100) == pytest.approx(4.1)
    await spawn(budget, 100, "after")
    await clock.advance(5)
    assert admitted(log) == [("after", 4.1)]


async def test_oversize_request_waits_for_a_full_bucket(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    await budget.reserve(1000)
    assert budget.predicted_wait(50_000) == pytest.approx(1.0)
    await spawn(budget, 50_000, "huge")
    await clock.advance(1)
    assert admitted(log) == [("huge", 1.0)]
    assert budget.available_tokens == pytest.approx(-44_000)


async def test_oversize_refund_repays_debt(budget: RateBudget) -> None:
    r = await budget.reserve(10_000)
    r.settle(1000)
    assert budget.available_tokens == 5000


# ----- sustained load ----------------------------------------------------------------


async def test_sustained_load_spends_the_limit_exactly_in_fifo_order(
    budget: RateBudget, clock: FakeClock, spawn: Spawn, log: Log
) -> None:
    # 200 × 500 tokens = 100_000: 6000 burst, then 1000/s → the last one at t = 94s.
    for i in range(200):
        await spawn(budget, 500, f"r{i:03d}")
    await clock.advance(100)
    assert [label for label, _ in log] == [f"r{i:03d}" for i in range(200)]
    assert log[-1][1] == pytest.approx(94.0)
    for i, (_, t) in enumerate(log):  # never ahead of burst + rate × t
        assert (i + 1) * 500 <= 6000 + 1000 * t + 1e-6


# ----- FakeClock ----------------------------------------------------------------------


async def test_fake_clock_wakes_sleepers_in_wake_time_order(clock: FakeClock) -> None:
    order: list[tuple[str, float]] = []

    async def sleeper(label: str, seconds: float) -> None:
        await clock.sleep(seconds)
        order.append((label, clock.now()))

    tasks = [asyncio.create_task(sleeper(n, s)) for n, s in [("c", 3), ("a", 1), ("b", 2)]]
    await clock.advance(0)
    assert clock.sleepers == 3
    await clock.advance(1.5)
    assert order == [("a", 1.0)]
    await clock.advance(5)
    assert order == [("a", 1.0), ("b", 2.0), ("c", 3.0)]
    assert clock.now() == 6.5
    await asyncio.gather(*tasks)


async def test_fake_clock_rejects_going_backwards(clock: FakeClock) -> None:
    with pytest.raises(ValueError, match="seconds"):
        await clock.advance(-1)


@pytest.mark.parametrize("seed", range(8))
async def test_random_mix_keeps_fifo_meets_deadlines_and_never_strands_a_waiter(seed: int) -> None:
    rnd = random.Random(seed)
    clock = FakeClock(start=rnd.uniform(0, 1000), yields=20)
    b = RateBudget(rpm=rnd.choice([3, 60, 600]), tpm=rnd.choice([1000, 6000, 60_000]), clock=clock)
    admitted: list[int] = []

    async def run(i: int, tokens: int, deadline: float | None) -> None:
        r = await b.reserve(tokens, deadline=deadline)
        assert deadline is None or clock.now() <= deadline + 1e-6
        admitted.append(i)
        await clock.sleep(rnd.uniform(0, 2))
        r.settle(rnd.choice([None, 0, tokens, tokens + 700, tokens // 2]))

    tasks: list[asyncio.Task[None]] = []
    for i in range(40):
        deadline = clock.now() + rnd.uniform(0, 30) if rnd.random() < 0.3 else None
        tasks.append(asyncio.create_task(run(i, rnd.choice([0, 10, 500, 3000, 20_000]), deadline)))
        await clock.advance(0)
        x = rnd.random()
        if x < 0.1:
            rnd.choice(tasks).cancel()
        elif x < 0.2:
            b.pause(rnd.uniform(0, 5))
        elif x < 0.3:
            remaining, limit = rnd.randint(0, 5000), rnd.randint(1, 1000)
            b.observe_headers(
                {
                    "x-ratelimit-remaining-tokens": str(remaining),
                    "x-ratelimit-limit-requests": str(limit),
                }
            )
        await clock.advance(rnd.uniform(0, 1))
    while not all(t.done() for t in tasks):
        await clock.advance(600)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(r is None or isinstance(r, BudgetDeadlineExceeded | asyncio.CancelledError) for r in results)
    assert admitted == sorted(admitted)  # admitted strictly in arrival order
    assert b.waiting == 0
