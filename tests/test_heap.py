"""The garbage collector's settings while an app runs (app/runtime/heap.py), in this process's
real collector: frozen start-up heap, the young threshold, the periodic collection, and
the interpreter's settings back once the last app has left."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

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
        assert frozen > 0 and gc.get_threshold() == (12_345, *before[1:])
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
