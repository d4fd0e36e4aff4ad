"""Group commit: the same write of many scans as one statement.

Every scan writes its `running` row, its terminal row and, maybe, a reward: a statement
each, on a pooled connection held until the loop reads the reply and gives it back. With
thousands of scans in flight a loop turn takes a while, a statement holds its connection
for a few turns, and the pool, not the database, caps the writes: they queue past
`DB_TIMEOUT_S` (a reward's `STAGE_TIMEOUT`, a refused scan's `DATABASE_UNAVAILABLE`).

`GroupCommit` runs at most `flushes` statements at once. A write that finds one free
goes at once, alone (no delay at a light load); the writes that come while all are busy
wait and go together in the next, up to `max_batch` rows: the busier the process, the
larger the batches, and the connections and loop turns a row costs shrink with them.
Each caller still gets its own row's result, or its own error. A write waits at most for
the batches ahead of it, each bounded by the writer's own timeouts (`DB_TIMEOUT_S` for its
connection and for its statement): in an outage, ceil(queued / (`flushes` x
`max_batch`)) of them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

# Statements of one kind in progress at once: the rest of the pool stays for the others.
FLUSHES = 4
# Rows in one statement, at most: a statement's parameters are arrays, and a batch this
# size is written in milliseconds.
MAX_BATCH = 500


class GroupCommit(Generic[T, R]):
    def __init__(
        self,
        write: Callable[[Sequence[T]], Awaitable[Sequence[R]]],
        *,
        error: Callable[[Exception], Exception],
        split: Callable[[Exception], bool] = lambda _exc: False,
        flushes: int = FLUSHES,
        max_batch: int = MAX_BATCH,
    ) -> None:
        """`write(items)`: one statement for them all, the result of each in order (its
        errors: the whole batch failed); `error(exc)`: what each caller of that batch gets
        raised (a new exception each); `split(exc)`: whether one row may have caused it
        (then each row of the batch is written alone, so one bad row fails only its own
        caller), rather than the database being away (then all fail at once)."""
        self._write = write
        self._error = error
        self._split = split
        self._flushes = flushes
        self._max_batch = max_batch
        self._queue: collections.deque[tuple[T, asyncio.Future[R]]] = collections.deque()
        self._running: set[asyncio.Task[None]] = set()

    async def submit(self, item: T) -> R:
        """`item` written, with the others waiting (its row's result). Cancelled before its
        batch went out, it is not written; after, it is (a statement sent cannot be
        called back), as a single statement cancelled in flight might be."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        entry = (item, future)
        self._queue.append(entry)
        if len(self._running) < self._flushes:
            self._running.add(asyncio.create_task(self._drain(), name="db-group-commit"))
        try:
            return await future
        except asyncio.CancelledError:
            with contextlib.suppress(ValueError):  # not if in a statement already
                self._queue.remove(entry)
            raise

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self._max_batch))]
                await self._flush(batch)
        finally:
            # Gone from the running set in the same step as the queue was seen empty: a
            # write queued after this starts a drain of its own (a done callback would
            # run a turn later, and a write queued meanwhile would wait for nobody).
            task = asyncio.current_task()
            if task is not None:
                self._running.discard(task)

    async def _flush(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._write([item for item, _ in batch])
        except Exception as exc:
            if len(batch) > 1 and self._split(exc):
                for entry in batch:  # one row's fault, maybe: each alone
                    await self._flush([entry])
                return
            for _, future in batch:
                if not future.done():
                    future.set_exception(self._error(exc))
            return
        except BaseException:  # cancelled (the loop ends): no drain goes on,
            for _, future in [*batch, *self._queue]:  # so nobody waits for one
                if not future.done():
                    future.set_exception(self._error(DrainCancelled()))
            self._queue.clear()
            raise
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)

    async def close(self) -> None:
        """Wait for the statements in progress (each bounded by the writer's timeouts)."""
        if self._running:
            await asyncio.wait(list(self._running))


class DrainCancelled(Exception):
    """The writes still queued when the loop cancelled their drain."""
