"""The garbage collector, set for a server whose start-up heap lives as long as it does.

CPython's cyclic collector walks the objects of a generation each time it collects it.
With its defaults, under load (k6/cpu_per_scan.py), it cost ecoscan ~0.8 ms of CPU per
scan, more than a tenth of the whole:

- every full collection walked the ~170,000 objects of the imports, the OpenAPI schema,
  the SDK's types and the app itself, which never become garbage (~130 ms each, every
  few seconds);
- a young generation of 700 allocations is a few milliseconds of traffic, so the objects
  of every scan in flight (each lives ~2 s) were walked in generation 0, again in 1, and
  promoted to 2 to be walked by full collections until they died.

`tuned_heap` therefore, once the app is up:

- collects, then freezes what survived (`gc.freeze`): start-up objects move to a
  permanent generation no collection walks;
- raises the young generation's threshold to `young_threshold` allocations
  (`GC_YOUNG_THRESHOLD`), so that a scan's objects are mostly freed by reference count
  before any collection sees them;
- runs a full collection every `COLLECT_EVERY_S` all the same: what only the collector
  frees (reference cycles: an exception, its traceback's frames and whatever they hold)
  is freed within that time, however slowly the allocation count moves.

On exit the interpreter's settings come back (tests run several apps in one process).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator

# Garbage in reference cycles lives at most about this long.
COLLECT_EVERY_S = 60.0


@contextlib.contextmanager
def tuned_heap(young_threshold: int, *, collect_every_s: float = COLLECT_EVERY_S) -> Iterator[None]:
    """Within: start-up objects frozen, the young generation `young_threshold`
    allocations, a full collection every `collect_every_s`. 0 leaves the collector as
    the interpreter set it."""
    if young_threshold <= 0:
        yield
        return
    previous = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(young_threshold, *previous[1:])
    timer = _Collector(asyncio.get_running_loop(), collect_every_s)
    try:
        yield
    finally:
        timer.stop()
        gc.set_threshold(*previous)
        gc.unfreeze()


class _Collector:
    def __init__(self, loop: asyncio.AbstractEventLoop, every_s: float) -> None:
        self._loop = loop
        self._every_s = every_s
        self._handle = loop.call_later(every_s, self._collect)

    def _collect(self) -> None:
        gc.collect()
        self._handle = self._loop.call_later(self._every_s, self._collect)

    def stop(self) -> None:
        self._handle.cancel()
