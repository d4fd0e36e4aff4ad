"""A counting gate for one stage's upstream calls: an `asyncio.Semaphore` that also
reports how many slots are held and how long the caller waited for one.

It bounds only what it is named for (concurrent OpenAI calls of one stage). It is
never held across CPU work, and the CPU lane's slots are never held across I/O.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class StageGate:
    def __init__(self, stage: str, size: int) -> None:
        if size < 1:
            raise ValueError(f"{stage} concurrency must be >= 1")
        self.stage = stage
        self.size = size
        self.in_use = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(size)

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[float]:
        """Hold a slot for the body; yields the seconds spent waiting for it."""
        started = time.perf_counter()
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.in_use += 1
        try:
            yield time.perf_counter() - started
        finally:
            self.in_use -= 1
            self._sem.release()
