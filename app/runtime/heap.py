"""The garbage collector, set for a server whose start-up heap lives as long as it does.

CPython's cyclic collector walks the objects of a generation each time it collects it.
With its defaults, a server like this one pays for walks that find nothing (what that
costs under load: docs/benchmarks.md, CPU per completed scan, k6/cpu_per_scan.py):

- every full collection walks the objects of the imports, the OpenAPI schema, the SDK's
  types and the app itself, which never become garbage;
- a young generation of 700 allocations fills many times over while one scan runs, so
  the objects of every scan in flight are walked in generation 0, again in 1, and
  promoted to 2 to be walked by full collections until they die.

`tuned_heap` therefore, once the app is up:

- collects, then freezes what survived (`gc.freeze`): start-up objects move to a
  permanent generation no collection walks;
- raises the young generation's threshold to `young_threshold` allocations
  (`GC_YOUNG_THRESHOLD`), so that a scan's objects are mostly freed by reference count
  before any collection sees them;
- runs a full collection every `COLLECT_EVERY_S` all the same: what only the collector
  frees (reference cycles: an exception, its traceback's frames and whatever they hold)
  is freed within that time, however slowly the allocation count moves (start-up
  objects excepted: frozen, a cycle among them is never freed).

A full collection still pauses the loop while it walks every live object that is not
frozen, but on a timer, not whenever promotions add up, and without the start-up heap.
On exit the interpreter's settings come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

# Garbage in reference cycles lives at most about this long.
COLLECT_EVERY_S = 60.0


@contextlib.contextmanager
def tuned_heap(young_threshold: int, *, collect_every_s: float = COLLECT_EVERY_S) -> Iterator[None]:
    """Within: start-up objects frozen, the young generation `young_threshold`
    allocations, a full collection every `collect_every_s`. 0 leaves the collector as
    the interpreter set it. The collector is the process's: with several apps in one
    process (tests), the first to enter tunes it and the last to leave restores it."""
    if young_threshold <= 0:
        yield
        return
    if not _tuned:
        _tuned.append(_Tuning(young_threshold, collect_every_s))
    else:
        _tuned.append(_tuned[0])
    try:
        yield
    finally:
        tuning = _tuned.pop()
        if not _tuned:
            tuning.undo()


class _Tuning:
    def __init__(self, young_threshold: int, every_s: float) -> None:
        self._previous = gc.get_threshold()
        gc.collect()
        gc.freeze()
        gc.set_threshold(young_threshold, *self._previous[1:])
        self._loop = asyncio.get_running_loop()
        self._every_s = every_s
        self._handle = self._loop.call_later(every_s, self._collect)

    def _collect(self) -> None:
        gc.collect()  # pauses the loop for as long as it walks what is not frozen
        self._handle = self._loop.call_later(self._every_s, self._collect)

    def undo(self) -> None:
        self._handle.cancel()
        gc.set_threshold(*self._previous)
        gc.unfreeze()


# The apps in this process that are inside `tuned_heap`, the first one's tuning each.
_tuned: list[_Tuning] = []


@contextlib.contextmanager
def timed_collections(observe: Callable[[int, float], None]) -> Iterator[None]:
    """Within: `observe(generation, seconds)` after every collection, automatic or not:
    each one holds the loop for that long (`ecoscan_gc_pause_seconds`)."""
    started: list[float] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            observe(int(info["generation"]), time.perf_counter() - started.pop())

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)
