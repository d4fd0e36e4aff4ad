"""Admission control as a unit: slots handed over in order, per-user caps, and the
upstream calls admitted scans still owe."""

from __future__ import annotations

import asyncio

import pytest

from app.errors import ServerBusy, UpstreamBudgetExhausted, UserOverLimit
from app.limits.admission import Admission

CALLS_PER_SCAN = 2  # vision + answer


def admission(
    *, max_inflight: int = 2, per_user: int = 2, wait_s: float = 1.0
) -> tuple[Admission, list[int]]:
    asked: list[int] = []

    def predicted(owed: int) -> float:
        asked.append(owed)
        return owed * 1.0  # one second per owed call, to make the arithmetic visible

    return (
        Admission(
            max_inflight=max_inflight,
            per_user=per_user,
            wait_s=wait_s,
            max_budget_wait_s=5.0,
            predicted_budget_wait=predicted,
            calls_per_scan=CALLS_PER_SCAN,
        ),
        asked,
    )


async def test_owed_calls_follow_the_scan_through_its_stages() -> None:
    adm, asked = admission(max_inflight=10, per_user=10)
    first = await adm.admit("a")
    assert adm.owed_calls == CALLS_PER_SCAN
    await adm.admit("b")
    assert asked == [0, 2]  # the second scan is told about the first one's calls
    first.calls_started(1)
    assert adm.owed_calls == 3
    first.calls_started(1)
    first.calls_started(1)  # a retry is not a new owed call
    assert adm.owed_calls == 2
    first.release()
    assert adm.owed_calls == 2 and adm.in_flight == 1


async def test_a_failed_scan_gives_back_the_calls_it_never_made() -> None:
    adm, _ = admission(max_inflight=10, per_user=10)
    ticket = await adm.admit("a")
    ticket.calls_started(1)
    ticket.release()
    ticket.release()  # idempotent
    assert adm.owed_calls == 0 and adm.in_flight == 0 and adm.per_user_in_flight == {}


async def test_budget_refusal_says_when_the_wait_would_be_acceptable() -> None:
    adm, _ = admission(max_inflight=10, per_user=10)
    for user in "abc":
        await adm.admit(user)  # 6 owed calls -> predicted 6 s > 5 s
    with pytest.raises(UpstreamBudgetExhausted) as refused:
        await adm.admit("d")
    assert refused.value.retry_after_s == pytest.approx(1.0)
    assert adm.in_flight == 3


async def test_per_user_cap() -> None:
    adm, _ = admission(max_inflight=10, per_user=1)
    await adm.admit("a")
    with pytest.raises(UserOverLimit):
        await adm.admit("a")
    await adm.admit("b")


async def test_a_freed_slot_goes_to_the_oldest_waiter() -> None:
    adm, _ = admission(max_inflight=1, per_user=5, wait_s=5.0)
    holder = await adm.admit("a")
    order: list[str] = []

    async def wait_for(user: str) -> None:
        ticket = await adm.admit(user)
        order.append(user)
        await asyncio.sleep(0)
        ticket.release()

    waiters = [asyncio.create_task(wait_for(u)) for u in ("b", "c")]
    await asyncio.sleep(0)
    holder.release()
    # A newcomer arriving now must queue behind b and c, not take the freed slot.
    late = asyncio.create_task(wait_for("d"))
    await asyncio.gather(*waiters, late)
    assert order == ["b", "c", "d"]
    assert adm.in_flight == 0


async def test_waiting_is_bounded() -> None:
    adm, _ = admission(max_inflight=1, per_user=5, wait_s=0.01)
    await adm.admit("a")
    with pytest.raises(ServerBusy) as busy:
        await adm.admit("b")
    assert busy.value.retry_after_s >= 1
    assert adm.in_flight == 1 and not adm._waiters


async def test_a_ticket_says_how_long_its_scan_queued_for_a_slot() -> None:
    adm, _ = admission(max_inflight=1, per_user=5, wait_s=5.0)
    holder = await adm.admit("a")
    assert holder.waited_s == 0.0
    queued = asyncio.create_task(adm.admit("b"))
    await asyncio.sleep(0)
    assert adm.waiting == 1  # what ecoscan_admission_waiting shows
    hold_s = 0.05
    await asyncio.sleep(hold_s)
    holder.release()
    ticket = await queued
    assert ticket.waited_s >= hold_s
    assert adm.waiting == 0
