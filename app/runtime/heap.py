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
- leaves full collections to a timer (none automatic): one is due every
  `COLLECT_EVERY_S`, so what only the collector frees (reference cycles: an exception
  and its traceback's frames, every closed asyncio transport) is freed within about
  that time, however slowly the allocation count moves (start-up objects excepted:
  frozen, a cycle among them is never freed);
- collects the middle generation every other young collection, so neither walks more
  than a few young generations' objects: the young pauses stay short however many
  scans are in flight, and survivors move on to the old generation, which no automatic
  collection walks.

The young generation sizes itself down under a large heap: a collection walks the
references of each young object, and with hundreds of megabytes of scans in flight
each one is a cache miss, so the same 20,000 objects that take a few milliseconds in a
quiet process take tens (docs/benchmarks.md). After each middle-generation collection
(the longest automatic one) the young threshold is scaled by `AUTO_PAUSE_TARGET_S` over
the CPU time it took, between `MIN_YOUNG_THRESHOLD` and `young_threshold`: collections
come more often and each holds the loop for less. CPU time, not wall time: a box busy
with other processes stretches a pause without it walking more.

A full collection walks every live object that is not frozen, and a scan in flight holds
a few hundred (coroutines, their frames, futures, buffers): with thousands in flight it
would hold the loop, and every stream, for far longer than a young one. So a due full
collection waits while its pause, estimated from the last one's pause per scan in flight,
would exceed `FULL_PAUSE_BUDGET_S`, and runs at the first quieter moment, or when it has
waited `MAX_DEFER_S` (what cycles may pile up meanwhile stays bounded).
On exit the interpreter's settings come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

# A full collection is due this often: garbage in reference cycles lives about this long.
COLLECT_EVERY_S = 60.0
# A due full collection waits while it would hold the loop longer than this...
FULL_PAUSE_BUDGET_S = 0.05
# ...but never longer than this: cycles pile up meanwhile.
MAX_DEFER_S = 600.0
# A full collection's pause per scan in flight until one is measured: a scan in flight holds
# a few hundred objects for the collector to walk (docs/benchmarks.md).
PRIOR_PAUSE_PER_SCAN_S = 1e-4
# How often a deferred full collection looks again.
RECHECK_S = 5.0
# No automatic full collection: the old generation's threshold is never reached.
NEVER = 1 << 30
# A middle-generation collection should take about this much CPU at most...
AUTO_PAUSE_TARGET_S = 0.02
# ...the young threshold shrinking for it down to this many allocations, and growing back
# (at most this factor a collection) when collections are quick again.
MIN_YOUNG_THRESHOLD = 2_000
YOUNG_REGROWTH = 1.25


@contextlib.contextmanager
def tuned_heap(
    young_threshold: int,
    *,
    in_flight: Callable[[], int] = lambda: 0,
    collect_every_s: float = COLLECT_EVERY_S,
    max_defer_s: float = MAX_DEFER_S,
) -> Iterator[None]:
    """Within: start-up objects frozen, the young generation `young_threshold`
    allocations, a full collection due every `collect_every_s` and put off (at most
    `max_defer_s`) while `in_flight()` scans would make it pause too long. 0 leaves the
    collector as the interpreter set it. The collector is the process's: with several
    apps in one process (tests), the first to enter tunes it and the last to leave
    restores it."""
    if young_threshold <= 0:
        yield
        return
    if not _tuned:
        _tuned.append(_Tuning(young_threshold, collect_every_s, max_defer_s, in_flight))
    else:
        _tuned.append(_tuned[0])
    try:
        yield
    finally:
        tuning = _tuned.pop()
        if not _tuned:
            tuning.undo()


class _Tuning:
    def __init__(
        self, young_threshold: int, every_s: float, max_defer_s: float, in_flight: Callable[[], int]
    ) -> None:
        self._previous = gc.get_threshold()
        gc.collect()
        gc.freeze()
        gc.set_threshold(young_threshold, 1, NEVER)
        self._young_max = young_threshold
        self._young = float(young_threshold)
        self._started_cpu = 0.0
        gc.callbacks.append(self._sized)
        self._loop = asyncio.get_running_loop()
        self._every_s = every_s
        self._max_defer_s = max_defer_s
        self._in_flight = in_flight
        self._due_at = self._loop.time() + every_s
        # The last full collection's pause per scan in flight (and one for the rest of the heap).
        self._pause_per_scan_s = PRIOR_PAUSE_PER_SCAN_S
        self._handle = self._loop.call_at(self._due_at, self._collect)

    def _collect(self) -> None:
        now = self._loop.time()
        scans = self._in_flight()
        estimate = self._pause_per_scan_s * (scans + 1)
        if estimate > FULL_PAUSE_BUDGET_S and now < self._due_at + self._max_defer_s:
            self._handle = self._loop.call_at(now + min(RECHECK_S, self._every_s), self._collect)
            return
        started = time.perf_counter()
        gc.collect()  # pauses the loop for as long as it walks what is not frozen
        self._pause_per_scan_s = (time.perf_counter() - started) / (scans + 1)
        self._due_at = self._loop.time() + self._every_s
        self._handle = self._loop.call_at(self._due_at, self._collect)

    def _sized(self, phase: str, info: dict[str, Any]) -> None:
        """A gc callback: each middle-generation collection's CPU time resizes the young one."""
        if info["generation"] != 1:
            return
        if phase == "start":
            self._started_cpu = time.thread_time()
            return
        took = time.thread_time() - self._started_cpu
        scale = min(YOUNG_REGROWTH, AUTO_PAUSE_TARGET_S / max(took, 1e-6))
        # Never above the setting, nor below the minimum unless the setting is lower.
        self._young = min(self._young_max, max(MIN_YOUNG_THRESHOLD, self._young * scale))
        gc.set_threshold(int(self._young), 1, NEVER)

    def undo(self) -> None:
        gc.callbacks.remove(self._sized)
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
