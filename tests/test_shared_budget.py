"""SharedRateBudget: several budgets (as in several replicas) sharing one key through a
real Redis. Upper bounds are exact (a slow machine only admits fewer); liveness is
checked with generous deadlines, never with speed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import uvloop

from app.limits.rate_budget import RateBudget
from app.limits.shared_budget import COLD_SHARE, SharedRateBudget
from app.runtime.redis_link import RedisLink
from tests.redis_server import RedisServer

LEASE_S = 0.2  # short leases: dead holders stop counting within 0.6 s


class Calls(list[str]):
    """The lease calls every budget of a test made, by op."""

    def append_op(self, op: str, seconds: float) -> None:
        self.append(op)


calls = Calls()


@asynccontextmanager
async def budgets(
    url: str, prefix: str, count: int, *, rpm: int, tpm: int = 1_000_000, **kwargs: float
) -> AsyncIterator[list[SharedRateBudget]]:
    link = RedisLink(url, prefix=prefix, timeout_s=0.5)
    made = [
        SharedRateBudget(
            link, rpm=rpm, tpm=tpm, name="m", lease_s=kwargs.get("lease_s", LEASE_S), on_call=calls.append_op
        )
        for _ in range(count)
    ]
    for budget in made:
        budget.start()
    try:
        yield made
    finally:
        for budget in made:
            await budget.aclose()
        await link.close()


async def admitted_within(budget: RateBudget, seconds: float, tokens: int, times: list[float]) -> None:
    """Reserve as fast as the budget allows for `seconds`, settling each at once."""
    deadline = time.monotonic() + seconds
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            while time.monotonic() < deadline:
                reservation = await budget.reserve(tokens)
                times.append(time.monotonic())
                reservation.settle(tokens)


async def eventually(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def test_two_replicas_together_stay_within_the_key(redis_server_url: str, redis_prefix: str) -> None:
    rpm, run_s = 120, 3.0  # 2 requests/s, a burst of 12 (10 % of a minute)
    async with budgets(redis_server_url, redis_prefix, 2, rpm=rpm) as (a, b):
        started = time.monotonic()
        times_a: list[float] = []
        times_b: list[float] = []
        await asyncio.gather(
            *(admitted_within(a, run_s, 10, times_a) for _ in range(4)),
            *(admitted_within(b, run_s, 10, times_b) for _ in range(4)),
        )
        elapsed = time.monotonic() - started
    bound = rpm * 0.1 + rpm / 60 * elapsed
    total = len(times_a) + len(times_b)
    # Each alone would admit up to the bound: two separate budgets would admit twice it.
    assert total <= bound + 1e-6, (total, bound)
    assert total >= rpm * 0.1  # at least the burst: the shared bucket serves at all
    assert times_a and times_b  # both replicas are served


async def test_big_requests_are_not_starved_by_another_replicas_small_ones(
    redis_server_url: str, redis_prefix: str
) -> None:
    """Redis serves holders in FIFO order: a replica waiting for a big grant gets it
    even while another keeps asking for small ones."""
    async with budgets(redis_server_url, redis_prefix, 2, rpm=6000, tpm=60_000) as (big, small):
        small_times: list[float] = []
        smalls = asyncio.create_task(admitted_within(small, 25.0, 50, small_times))
        await eventually(lambda: len(small_times) > 5)
        # 6,000 tokens is the whole bucket (10 % of 60k): it needs a full refill (6 s at
        # 1k/s) that the small ones must not eat first. It gets it while they still run.
        reservation = await asyncio.wait_for(big.reserve(6000), timeout=20)
        assert not smalls.done()
        reservation.settle(6000)
        smalls.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await smalls


async def test_a_clean_exit_gives_its_grant_back(redis_server_url: str, redis_prefix: str) -> None:
    async with budgets(redis_server_url, redis_prefix, 1, rpm=60, lease_s=30.0) as (leaving,):
        taken = [await leaving.reserve(0) for _ in range(6)]  # the whole burst (6 requests)
        for reservation in taken:
            reservation.settle(None)  # never sent: refunded to what this process holds
        assert leaving.available_requests >= 5.9
    async with budgets(redis_server_url, redis_prefix, 1, rpm=60, lease_s=30.0) as (staying,):
        # At 1 request/s, six at once are only possible if the grant came back.
        async with asyncio.timeout(2.0):
            for _ in range(6):
                await staying.reserve(0)


async def test_survivors_take_over_a_dead_holders_share(redis_server_url: str, redis_prefix: str) -> None:
    async with budgets(redis_server_url, redis_prefix, 2, rpm=600) as (dying, living):
        (await dying.reserve(1)).settle(1)
        (await living.reserve(1)).settle(1)
        assert await eventually(lambda: living.share == 0.5)
        assert living.effective_rpm == 300
        for task in dying._tasks:  # the process dies: no return, no more calls
            task.cancel()
        # Three leases later it no longer counts: the survivor's share is the whole key.
        async with asyncio.timeout(10):
            while living.share != 1.0:
                (await living.reserve(1)).settle(1)
                await asyncio.sleep(LEASE_S / 2)
        assert living.effective_rpm == 600


async def test_a_grant_ahead_of_time_waits_out_the_debt(redis_server_url: str, redis_prefix: str) -> None:
    """A need the bucket cannot pay yet is granted for later, in one round trip: the
    holder uses it only once the bucket's debt would be paid."""
    async with budgets(redis_server_url, redis_prefix, 1, rpm=600, tpm=6000) as (budget,):
        (await budget.reserve(600)).settle(600)  # the whole token bucket (10 % of 6k)
        calls.clear()
        started = time.monotonic()
        reservation = await asyncio.wait_for(budget.reserve(50), timeout=10)
        waited = time.monotonic() - started
        reservation.settle(50)
    assert waited >= 50 / 100 - 0.05  # 50 tokens at 100 tokens/s: never earlier (a lower bound)
    assert calls.count("grant") == 1  # granted ahead at the first ask, not asked again


async def test_a_429_on_one_replica_pauses_the_other(redis_server_url: str, redis_prefix: str) -> None:
    """Announced on the pause channel: with 30 s leases no lease call would carry it."""
    async with budgets(redis_server_url, redis_prefix, 2, rpm=6000, lease_s=30.0) as (seeing, other):
        (await other.reserve(1)).settle(1)
        (await seeing.reserve(1)).settle(1)
        link = RedisLink(redis_server_url, prefix=redis_prefix, timeout_s=0.5)
        channel = link.key("budget", "m", "pause")
        try:
            for _ in range(500):  # both listeners subscribed (within 10 s)
                if (await link.client.pubsub_numsub(channel))[0][1] >= 2:
                    break
                await asyncio.sleep(0.02)
        finally:
            await link.close()
        seeing.pause(5.0)
        assert await eventually(lambda: other.paused_until > time.monotonic() + 3.0, timeout_s=2.0)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.0):
                await other.reserve(1)


async def test_redis_down_falls_back_to_the_last_share_and_recovers(own_redis: RedisServer) -> None:
    rpm = 600
    async with budgets(own_redis.url, "fallback", 2, rpm=rpm) as (a, b):
        (await a.reserve(1)).settle(1)
        (await b.reserve(1)).settle(1)
        assert await eventually(lambda: a.share == 0.5 and b.share == 0.5)
        assert a.effective_rpm == rpm // 2
        own_redis.stop()
        # Whatever a holds runs out; then it needs Redis, fails, and budgets locally.
        async with asyncio.timeout(10):
            while a.shared:
                (await a.reserve(1)).settle(1)
        assert a.effective_rpm == rpm // 2  # its last known share, never the whole key
        for _ in range(5):  # and it keeps serving
            (await asyncio.wait_for(a.reserve(1), timeout=5)).settle(1)
        own_redis.start()
        assert await eventually(lambda: a.shared, timeout_s=10)
        (await asyncio.wait_for(a.reserve(1), timeout=5)).settle(1)


async def test_never_reached_redis_takes_the_cold_share(own_redis: RedisServer) -> None:
    own_redis.stop()
    async with budgets(own_redis.url, "cold", 1, rpm=600) as (budget,):
        (await asyncio.wait_for(budget.reserve(1), timeout=10)).settle(1)
        assert not budget.shared
        assert budget.effective_rpm == int(600 * COLD_SHARE)


async def test_a_hung_redis_is_redis_away(own_redis: RedisServer) -> None:
    """SIGSTOP: connections open, nothing answers. REDIS_TIMEOUT_S bounds every call."""
    async with budgets(own_redis.url, "hung", 1, rpm=600) as (budget,):
        (await budget.reserve(1)).settle(1)
        own_redis.freeze()
        try:
            async with asyncio.timeout(10):
                while budget.shared:
                    (await budget.reserve(1)).settle(1)
            (await asyncio.wait_for(budget.reserve(1), timeout=5)).settle(1)  # still serving
        finally:
            own_redis.thaw()
        assert await eventually(lambda: budget.shared, timeout_s=10)


def test_a_grant_due_within_a_millisecond_matures_under_uvloop(
    redis_server_url: str, redis_prefix: str
) -> None:
    """uvloop answers a `call_later` under a millisecond with a plain Handle (no `when()`):
    the grant it carries must still mature (it once raised there, and the budget starved)."""

    async def main() -> None:
        async with budgets(redis_server_url, redis_prefix, 1, rpm=60) as (budget,):
            held = budget.available_requests
            budget._grant_at((1.0, 10.0), 0.0002)
            budget._grant_at((1.0, 10.0), 0.05)
            await asyncio.sleep(0.2)
            assert budget._pending == (0.0, 0.0) and not budget._maturing
            assert budget.available_requests >= held + 2 - 1e-9

    uvloop.run(main())
