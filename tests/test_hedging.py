"""Tails cut by hedging (app/upstream/hedging.py): a late reply is raced on another
deployment, within a budget; over real HTTP, one of two deployments holds every reply
60 s before its first byte and the scans end normally."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from app.sim.config import SimConfig
from app.sim.server import RunningSimulator, run_simulator
from app.upstream.hedging import BURST, FirstByteTimes, HedgeBudget, claim, race, sending

from .conftest import sim_stats
from .test_routing import deployment, routed_service, scans, simulators


def test_the_hedge_waits_for_the_deployments_p99_times_the_factor_within_floor_and_ceiling() -> None:
    times = FirstByteTimes()
    assert times.hedge_after(1.5, 0.5, 10.0) == 10.0  # nothing learned yet: the ceiling
    for i in range(100):
        times.observe(1.0 + i / 100)  # 1.00 .. 1.99 s
    assert times.p99() == pytest.approx(1.99)
    assert times.hedge_after(1.5, 0.5, 10.0) == pytest.approx(2.985)
    assert times.hedge_after(10.0, 0.5, 10.0) == 10.0
    assert times.hedge_after(0.1, 0.5, 10.0) == 0.5


def test_the_budget_allows_a_fraction_of_the_last_minutes_calls_and_forgets_older_ones() -> None:
    budget = HedgeBudget(0.05)
    for _ in range(100):
        budget.call(10.0)
    taken = sum(budget.take(10.5) for _ in range(20))
    assert taken == 5 + BURST
    assert not budget.take(69.0)  # the same minute
    assert budget.take(71.0)  # a minute on: those calls and hedges are forgotten (the burst is back)
    assert not HedgeBudget(0.0).take(0.0)  # 0: never


async def test_a_late_first_attempt_loses_to_its_hedge_and_is_cancelled() -> None:
    released = asyncio.Event()
    cancelled: list[int] = []

    async def attempt(entry: int, head_after_s: float, gate: asyncio.Event | None = None) -> None:
        try:
            sending()  # its request leaves: the hedge's delay runs from here
            if gate is not None:
                await gate.wait()
            await asyncio.sleep(head_after_s)
            if claim():
                return
            raise RuntimeError("lost")
        except asyncio.CancelledError:
            cancelled.append(entry)
            raise

    # On time: no hedge is asked for.
    assert await race(attempt(1, 0.0), lambda: pytest.fail("hedged"), after_s=30.0) == 1
    # Held: the hedge answers first, the first attempt is cancelled.
    assert await race(attempt(1, 0.0, released), lambda: attempt(2, 0.0), after_s=0.01) == 2
    assert cancelled == [1]
    # No hedge available: the first is waited for.
    released.set()
    assert await race(attempt(1, 0.02), lambda: None, after_s=0.01) == 1


async def test_a_first_attempt_queued_before_sending_is_not_hedged() -> None:
    async def queued() -> None:
        await asyncio.sleep(0.05)  # at the stage gate or the budget: not sent yet
        sending()
        assert claim()

    assert await race(queued(), lambda: pytest.fail("hedged a queue"), after_s=0.01) == 1


async def test_with_both_failing_the_first_attempts_failure_is_raised() -> None:
    async def failing(message: str, after_s: float) -> None:
        sending()
        await asyncio.sleep(after_s)
        raise ValueError(message)

    with pytest.raises(ValueError, match="first"):
        await race(failing("first", 0.05), lambda: failing("hedge", 0.0), after_s=0.01)


async def test_a_winner_that_fails_right_after_its_head_raises_its_own_failure() -> None:
    """From review: the hedge claims the head and fails in the same step (a refusal in a
    body that came with the headers); its failure is what the call raises, not a crash."""

    async def late() -> None:
        sending()
        await asyncio.sleep(0.5)
        assert not claim()

    async def filtered() -> None:
        await asyncio.sleep(0.01)
        assert claim()
        raise ValueError("content_filter")

    with pytest.raises(ValueError, match="content_filter"):
        await race(late(), filtered, after_s=0.05)


async def test_one_deployment_holding_every_reply_scans_end_normally_within_the_hedge_budget(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = SimConfig(time_scale=0.002, latency_sigma=0.0, text_tokens=40)
    async with (
        simulators(1, fast) as (good,),
        simulators(1, SimConfig(**{**fast.to_dict(), "hold_rate": 1.0})) as (held,),
    ):
        listed = [deployment("held", held), deployment("good", good)]
        settings = {
            "hedge_min_s": 0.2,
            "hedge_max_s": 0.5,  # the held deployment never answers: nothing learned, the ceiling
            "hedge_budget": 0.05,
            "openai_read_timeout_s": 3.0,  # calls past the budget: given up after 3 s, retried
        }
        async with routed_service(database_url, sim, monkeypatch, listed, **settings) as svc:
            outcomes = await scans(svc, 30)
            hedges = {
                outcome: svc.metric("ecoscan_upstream_hedges_total", {"stage": stage, "outcome": outcome})
                for stage in ("vision",)
                for outcome in ("sent", "won", "lost", "no_budget")
            }
            sent = sum(
                svc.metric("ecoscan_upstream_hedges_total", {"stage": stage, "outcome": "sent"})
                for stage in ("vision", "answer")
            )
            attempts = sum(
                svc.metric("ecoscan_upstream_routed_total", {"upstream": name, "stage": stage})
                for name in ("held", "good")
                for stage in ("vision", "answer")
            )
            held_stats = await sim_stats(held)

    assert [o.terminal.event for o in outcomes] == ["done"] * 30, [o.terminal.data for o in outcomes]
    assert held_stats["holds_injected"] >= 1  # it was called, and held
    assert hedges["won"] >= 1  # held calls answered by the other deployment
    # Within budget: at most HEDGE_BUDGET of the calls (plus the burst a start allows).
    assert sent <= 0.05 * attempts + BURST, (sent, attempts)


async def test_the_simulator_holds_a_fraction_of_its_replies_before_their_first_byte() -> None:
    config = SimConfig(time_scale=0.001, latency_sigma=0.0, hold_rate=0.5, hold_s=2.0)
    async with run_simulator(config) as sim, httpx.AsyncClient(base_url=sim.base_url, timeout=10) as client:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        headers = {"Authorization": "Bearer sk-test"}

        async def ask() -> tuple[int, float]:
            started = asyncio.get_running_loop().time()
            response = await client.post("/chat/completions", json=body, headers=headers)
            return response.status_code, asyncio.get_running_loop().time() - started

        replies = await asyncio.gather(*(ask() for _ in range(20)))
        held = (await sim_stats(sim))["holds_injected"]
    assert {status for status, _ in replies} == {200}
    assert 0 < held < 20  # a fraction of them
    assert sum(1 for _, took in replies if took >= 2.0) == held  # each held one was late by hold_s
