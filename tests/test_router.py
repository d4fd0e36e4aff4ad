"""`Router` on a clock the test sets, with real budgets and routes: which priority a call
goes to when the first one's budget is slow, which route within a priority when their own
concurrency limits fill, and what admission's look-ahead predicts when the capacity of
every route is spent in that order."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from app.limits.adaptive import AdaptiveLimit
from app.limits.clock import FakeClock
from app.limits.rate_budget import RateBudget
from app.limits.route_limits import RouteLimit
from app.settings import Settings
from app.upstream.breaker import Breaker
from app.upstream.credentials import Credential
from app.upstream.deployments import Deployment
from app.upstream.endpoint import ChatEndpoint
from app.upstream.negotiation import Negotiation
from app.upstream.providers import PROVIDERS
from app.upstream.routes import Route, Router

SPILL_AFTER_S = 10.0
TOKENS = 100  # every call's reservation; the token buckets never bind here


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as stack:
        yield stack


def route(
    stack: AsyncExitStack, clock: FakeClock, name: str, *, rpm: int, priority: int, limit: int = 64
) -> Route:
    """A vision route; `limit`: its own concurrency limit (no sizing here: it stays put)."""
    d = Deployment(
        name=name,
        provider="openai",
        base_url="http://127.0.0.1:9/v1",  # never called: routing only
        rpm=rpm,
        tpm=100_000_000,
        vision_model="gpt-4o-mini",
        priority=priority,
    )
    endpoint = ChatEndpoint.open(
        d.base_url + "/chat/completions",
        Credential(),
        connect_timeout_s=1.0,
        read_timeout_s=1.0,
        max_connections=1,
        keepalive_s=1.0,
    )
    stack.push_async_callback(endpoint.aclose)
    return Route(
        d,
        PROVIDERS["openai"],
        "vision",
        Settings().call_shape("vision", model="gpt-4o-mini"),
        endpoint,
        RateBudget(rpm=rpm, tpm=d.tpm, clock=clock, name=name),
        Breaker(name),
        Negotiation(name),
        RouteLimit(AdaptiveLimit(floor=1, ceiling=limit, prior_latency_s=1.0, initial=limit)),
    )


def tokens(_: Route) -> int:
    return TOKENS


async def test_a_priority_whose_budget_is_too_slow_is_passed_over(stack: AsyncExitStack) -> None:
    clock = FakeClock()
    primary = route(stack, clock, "primary", rpm=60, priority=0)
    standby = route(stack, clock, "standby", rpm=600, priority=1)
    router = Router([primary, standby], clock, spill_after_s=SPILL_AFTER_S)
    primary.budget.pause(5.0)  # slower than the standby, within what a call waits for it
    assert router.pick("vision", tokens, within_s=30.0) is primary
    # Not by the deadline: the call goes where it can finish.
    assert router.pick("vision", tokens, within_s=3.0) is standby
    primary.budget.pause(20.0)  # longer than a call waits for a priority
    assert router.pick("vision", tokens, within_s=30.0) is standby
    standby.budget.pause(40.0)  # nothing in time anywhere: the soonest
    assert router.pick("vision", tokens, within_s=30.0) is primary


async def test_the_look_ahead_spends_the_first_priority_before_the_next(stack: AsyncExitStack) -> None:
    clock = FakeClock()
    primary = route(stack, clock, "primary", rpm=60, priority=0)  # 1 a second, 6 at once
    standby = route(stack, clock, "standby", rpm=600, priority=1)  # 10 a second, 60 at once
    router = Router([primary, standby], clock, spill_after_s=SPILL_AFTER_S)
    assert router.predicted_wait("vision", tokens, ahead=0) == 0.0
    # Ten calls ahead all go to the primary (its wait is acceptable): the new call waits
    # there behind them, ~5 s, although the standby is idle. Sharing the calls by rate
    # over both, as if priorities did not exist, would predict no wait at all.
    assert router.predicted_wait("vision", tokens, ahead=10) == pytest.approx(5.0, abs=0.2)
    # A hundred: the primary takes what it can within 10 s (6 + 10), the standby the
    # other 84 (60 at once, then 10 a second): the new call is the 85th there, ~2.5 s.
    assert router.predicted_wait("vision", tokens, ahead=100) == pytest.approx(2.5, abs=0.2)
    # More than both can take within 10 s: the wait says how far past it.
    assert router.predicted_wait("vision", tokens, ahead=300) > SPILL_AFTER_S


async def test_routes_taken_out_lend_no_capacity_to_the_look_ahead(stack: AsyncExitStack) -> None:
    clock = FakeClock()
    primary = route(stack, clock, "primary", rpm=60, priority=0)
    standby = route(stack, clock, "standby", rpm=600, priority=1)
    router = Router([primary, standby], clock, spill_after_s=SPILL_AFTER_S)
    standby.breaker.take_out(clock.now(), "401: invalid key", 300.0)
    assert router.predicted_wait("vision", tokens, ahead=100) > SPILL_AFTER_S


def hold(route: Route, calls: int) -> None:
    """`calls` attempts on `route` in progress (never left: the test ends with them)."""
    for _ in range(calls):
        route.limit.enter()


async def test_within_a_priority_a_route_at_its_limit_passes_calls_to_one_with_room(
    stack: AsyncExitStack,
) -> None:
    clock = FakeClock()
    slow = route(stack, clock, "slow", rpm=600, priority=0, limit=4)
    fast = route(stack, clock, "fast", rpm=600, priority=0, limit=40)
    router = Router([slow, fast], clock, spill_after_s=SPILL_AFTER_S)
    # Both idle: the share of its limit each would hold with the call, 1/4 against 1/40.
    assert router.pick("vision", tokens) is fast
    hold(fast, 9)  # 10/40 = 1/4: a tie goes to the first listed
    assert router.pick("vision", tokens) is slow
    hold(fast, 1)  # 11/40 > 1/4
    assert router.pick("vision", tokens) is slow
    hold(slow, 1)  # 2/4 > 11/40
    assert router.pick("vision", tokens) is fast
    hold(slow, 3)  # at its limit (4/4) while the other has room, whatever its share
    hold(fast, 28)  # 38/40
    assert router.pick("vision", tokens) is fast
    hold(fast, 2)  # every one at its limit: as before, the smaller share with the call, 41/40 < 5/4
    assert router.pick("vision", tokens) is fast
    hold(fast, 10)  # 51/40 > 5/4
    assert router.pick("vision", tokens) is slow


async def test_a_route_with_room_whose_budget_is_too_slow_loses_to_one_at_its_limit(
    stack: AsyncExitStack,
) -> None:
    for paused_s, chosen in ((20.0, "full"), (5.0, "roomy")):
        clock = FakeClock()
        full = route(stack, clock, "full", rpm=600, priority=0, limit=4)
        roomy = route(stack, clock, "roomy", rpm=600, priority=0, limit=40)
        router = Router([full, roomy], clock, spill_after_s=SPILL_AFTER_S)
        hold(full, 4)
        # Past what a call waits for a budget, the room does not count; within it, it does.
        roomy.budget.pause(paused_s)
        assert router.pick("vision", tokens, within_s=30.0).name == chosen


async def test_a_route_limit_does_not_pass_a_priority_over(stack: AsyncExitStack) -> None:
    clock = FakeClock()
    primary = route(stack, clock, "primary", rpm=600, priority=0, limit=4)
    standby = route(stack, clock, "standby", rpm=600, priority=1, limit=40)
    router = Router([primary, standby], clock, spill_after_s=SPILL_AFTER_S)
    hold(primary, 10)  # far past its limit: the calls wait at the stage gate, for the primary
    assert router.pick("vision", tokens, within_s=30.0) is primary
