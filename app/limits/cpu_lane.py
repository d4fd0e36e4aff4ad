"""The CPU lane: one bounded ThreadPoolExecutor for CPU-bound work (image decoding,
resizing, hashing, big JSON), with a bounded wait in front of it.

Why a lane of our own and not `asyncio.to_thread`: the default executor is shared
with unrelated work (DNS lookups, pgserver start-up...), is sized for I/O rather
than cores, and queues without limit, so a burst of uploads would pile up unseen.
Here at most `max_workers` jobs run, at most `queue_limit` wait, and the rest are
refused at once with `CpuLaneSaturated` (a 503 before any stream starts).

A slot is held until the *thread* finishes, not until the awaiting coroutine stops
waiting: cancelling a caller cannot cancel a running thread, so releasing early
would let more jobs run than there are workers.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from app.errors import CpuLaneSaturated

T = TypeVar("T")


class CpuLane:
    def __init__(self, *, max_workers: int, queue_limit: int) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        if queue_limit < 0:
            raise ValueError("queue_limit must be >= 0")
        self.max_workers = max_workers
        self.queue_limit = queue_limit
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="ecoscan-cpu")
        self._slots = asyncio.Semaphore(max_workers)
        self.waiting = 0
        self.busy = 0
        # Filled by the metrics layer: (queue_wait_s, run_s) per job.
        self.observers: list[Callable[[float, float], None]] = []

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on a worker thread; refuse at once when the queue is full."""
        if self._slots.locked() and self.waiting >= self.queue_limit:
            raise CpuLaneSaturated(retry_after_s=1.0)
        queued_at = time.perf_counter()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.busy += 1
        started_at = time.perf_counter()
        loop = asyncio.get_running_loop()
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        try:
            future: Future[T] = self._executor.submit(call)
        except BaseException:
            self._release(queued_at, started_at)
            raise
        # One hop back to the loop per job, releasing the slot and handing over the result
        # together (asyncio.wrap_future plus a release callback would be two).
        waiter: asyncio.Future[T] = loop.create_future()
        future.add_done_callback(
            lambda _: loop.call_soon_threadsafe(self._finish, future, waiter, queued_at, started_at)
        )
        try:
            return await waiter
        except asyncio.CancelledError:
            future.cancel()  # if it has not started; a running thread finishes regardless
            raise

    def _finish(
        self, future: Future[T], waiter: asyncio.Future[T], queued_at: float, started_at: float
    ) -> None:
        try:
            self._release(queued_at, started_at)
        finally:  # the caller wakes whatever an observer does
            if not waiter.cancelled():
                _copy_outcome(future, waiter)

    def _release(self, queued_at: float, started_at: float) -> None:
        self.busy -= 1
        self._slots.release()
        run_s = time.perf_counter() - started_at
        for observe in self.observers:
            observe(started_at - queued_at, run_s)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _copy_outcome(future: Future[T], waiter: asyncio.Future[T]) -> None:
    if future.cancelled():
        waiter.cancel()
    elif (exc := future.exception()) is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(future.result())
