"""The garbage collector's settings while an app runs (app/runtime/heap.py), in this process's
real collector: frozen start-up heap, the young threshold, the periodic collection, and
the interpreter's settings back once the last app has left."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import Iterator

import pytest

from app.runtime import heap
from app.runtime.heap import tuned_heap


@pytest.fixture(autouse=True)
def interpreters_collector() -> Iterator[None]:
    """The collector as the interpreter has it, nothing frozen (conftest.py's
    `no_stray_loop_errors` freezes what earlier tests left)."""
    gc.unfreeze()
    yield


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


async def test_nested_apps_tune_the_collector_once_and_the_last_one_restores_it() -> None:
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    with tuned_heap(12_345):
        frozen = gc.get_freeze_count()
        assert frozen > 0 and gc.get_threshold() == (12_345, 1, heap.NEVER)
        with tuned_heap(54_321):  # a second app in the process: the first one's settings hold
            assert gc.get_threshold()[0] == 12_345 and gc.get_freeze_count() == frozen
        assert gc.get_threshold()[0] == 12_345 and gc.get_freeze_count() == frozen
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    with tuned_heap(0):  # 0: left alone
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0


async def test_a_reference_cycle_is_freed_by_the_periodic_collection() -> None:
    with tuned_heap(10**9, collect_every_s=0.05):  # the young threshold never reached
        a, b = Node(), Node()
        a.other, b.other = b, a
        freed = asyncio.Event()
        gone = weakref.ref(a, lambda _: freed.set())
        del a, b
        assert gone() is not None  # reference counts alone never free a cycle
        async with asyncio.timeout(10):
            await freed.wait()


async def test_a_full_collection_waits_out_a_crowd_but_not_forever() -> None:
    """A due full collection is put off while the scans in flight would make it pause too
    long (learned from the last one), and runs once the crowd thins or the wait is over."""
    crowd = [0]
    with tuned_heap(10**9, in_flight=lambda: crowd[0], collect_every_s=0.05, max_defer_s=0.6):
        assert gc.get_threshold()[1:] == (1, heap.NEVER)  # no automatic full collection
        await asyncio.sleep(0.2)  # a full collection or more: its pause per scan is known
        tuning = heap._tuned[0]
        tuning._pause_per_scan_s = heap.FULL_PAUSE_BUDGET_S / 100  # as if the last one took that long
        crowd[0] = 1000  # the next would hold the loop ~10 x the budget
        a, b = Node(), Node()
        a.other, b.other = b, a
        freed = asyncio.Event()
        gone = weakref.ref(a, lambda _: freed.set())
        del a, b
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.3):
                await freed.wait()
        assert gone() is not None, "collected despite the crowd"
        async with asyncio.timeout(5):  # the crowd stays, but the wait is bounded
            await freed.wait()
        b2 = Node()
        b2.other = Node()
        b2.other.other = b2
        freed2 = asyncio.Event()
        gone2 = weakref.ref(b2, lambda _: freed2.set())
        del b2
        crowd[0] = 0  # the crowd thins: the next due collection runs at once
        async with asyncio.timeout(1):
            await freed2.wait()
        assert gone2() is None


async def test_the_young_generation_shrinks_while_collections_are_slow_and_grows_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each middle-generation collection's CPU time against the target scales the young
    threshold: slower than the target (here: any) brings it down to the minimum, quicker
    (here: all) lets it grow back to the setting, a bounded step at a time."""
    garbage: list[list[int]] = []

    def collections_of_the_middle_generation(count: int) -> None:
        for _ in range(count):
            before = gc.get_stats()[1]["collections"]
            while gc.get_stats()[1]["collections"] == before:
                garbage.append([])  # tracked allocations that survive: the young count climbs
            garbage.clear()

    with tuned_heap(20_000):
        assert gc.get_threshold()[0] == 20_000
        monkeypatch.setattr(heap, "AUTO_PAUSE_TARGET_S", 1e-9)
        collections_of_the_middle_generation(3)
        assert gc.get_threshold()[0] == heap.MIN_YOUNG_THRESHOLD
        monkeypatch.setattr(heap, "AUTO_PAUSE_TARGET_S", 10.0)
        collections_of_the_middle_generation(1)
        assert gc.get_threshold()[0] == int(heap.MIN_YOUNG_THRESHOLD * heap.YOUNG_REGROWTH)
        collections_of_the_middle_generation(30)
        assert gc.get_threshold()[0] == 20_000  # never past the setting
    assert heap._tuned == []


async def test_a_young_setting_below_the_minimum_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    with tuned_heap(700):
        monkeypatch.setattr(heap, "AUTO_PAUSE_TARGET_S", 10.0)  # quick: may grow, never past 700
        garbage: list[list[int]] = []
        before = gc.get_stats()[1]["collections"]
        while gc.get_stats()[1]["collections"] < before + 2:
            garbage.append([])
        assert gc.get_threshold()[0] == 700
