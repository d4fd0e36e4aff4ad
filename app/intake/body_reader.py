"""Reading request bodies without letting slow or lying clients hold the service.

Two bounds, both on what uploads really cost — time and memory, not admission slots:

- **A deadline that moves with progress.** A body must arrive within
  `BODY_READ_TIMEOUT_S` plus one second per `BODY_MIN_BYTES_PER_S` bytes received, so
  a 10 MB photo from a slow phone still gets through while a client trickling 10 B/s
  (or one that declared more `Content-Length` than it sends) is cut off → 408
  `BODY_READ_TIMEOUT`, connection closed.
- **A cap on the bytes buffered at once**, across every request being read
  (`BODY_BUFFER_MAX_BYTES`). It counts bytes as they arrive, not connections, so 60
  slow connections holding 600 bytes each take 36 KB of it and never the room a
  legitimate 5 MB photo needs; when it is full → 503 `UPLOADS_AT_CAPACITY` with
  `Retry-After`. A body keeps its share until `release()` (after it is parsed).
"""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from app.errors import BodyReadTimeout, ClientDisconnected, PayloadTooLarge, UploadsAtCapacity

# Moving the deadline resets a timer (a handle cancelled, a new one in the loop's heap):
# too much to pay on every chunk of every upload. It moves when the bytes received have
# earned it, and then this far beyond: never earlier than the rule, at most this much later.
DEADLINE_STEP_S = 1.0


class BodyBudget:
    """Bytes of request bodies held in memory right now, across all requests."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.in_use = 0

    def take(self, n: int) -> None:
        if self.in_use + n > self.max_bytes:
            raise UploadsAtCapacity()
        self.in_use += n

    def give(self, n: int) -> None:
        self.in_use -= n


class BufferedBody:
    """A body read into one buffer, holding its share of the budget until released."""

    def __init__(self, budget: BodyBudget, limit: int) -> None:
        self.data = bytearray()
        self._budget = budget
        self._limit = limit
        self._held = 0

    def add(self, chunk: bytes) -> None:
        if len(self.data) + len(chunk) > self._limit:
            raise PayloadTooLarge()
        self._budget.take(len(chunk))
        self._held += len(chunk)
        self.data += chunk

    def release(self) -> None:
        self._budget.give(self._held)
        self._held = 0
        self.data = bytearray()


class BodyReader:
    def __init__(self, budget: BodyBudget, *, limit: int, timeout_s: float, min_bytes_per_s: float) -> None:
        self.budget = budget
        self._limit = limit
        self._timeout_s = timeout_s
        self._min_bytes_per_s = min_bytes_per_s

    async def read(self, request: Request) -> BufferedBody:
        """The whole body, within the size limit, the deadline and the budget."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._limit:
            raise PayloadTooLarge()
        body = BufferedBody(self.budget, self._limit)
        try:
            await self._fill(request, body)
        except BaseException:
            body.release()
            raise
        return body

    async def _fill(self, request: Request, body: BufferedBody) -> None:
        started = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout_at(started + self._timeout_s) as deadline:
                async for chunk in request.stream():
                    body.add(chunk)
                    allowed_at = started + self._timeout_s + len(body.data) / self._min_bytes_per_s
                    if allowed_at > (deadline.when() or 0.0):
                        deadline.reschedule(allowed_at + DEADLINE_STEP_S)
        except TimeoutError:
            raise BodyReadTimeout() from None
        except ClientDisconnect:
            raise ClientDisconnected() from None
