"""Reading request bodies without letting slow, stalled or lying clients hold the service.

Three bounds, all on what uploads really cost — time and memory, not admission slots:

- **A gap timeout.** No part of the body for `BODY_GAP_TIMEOUT_S` → 408
  `BODY_READ_TIMEOUT`, connection closed: a client that sends 14 MB fast and stops gives
  its bytes back within the gap, not at the end of the deadline.
- **A deadline that only comes closer**: `BODY_READ_TIMEOUT_S` plus one second per
  `BODY_MIN_BYTES_PER_S` bytes of the declared `Content-Length` (of the size limit, for a
  chunked body) when reading starts, so a 10 MB photo from a slow phone still gets through
  while a client trickling 10 B/s (or one that declared more than it sends) is cut off →
  408. After each chunk it is moved closer when what is still missing, at the minimum rate
  from now, would end sooner: bytes received earn no more time, and a fast start followed
  by a trickle, one byte per gap, is cut within `BODY_READ_TIMEOUT_S` plus the rest's
  allowance.
- **Caps on the bytes buffered at once**: across every request being read
  (`BODY_BUFFER_MAX_BYTES` → 503 `UPLOADS_AT_CAPACITY`) and per client, keyed like the
  per-user caps (`BODY_BUFFER_MAX_BYTES_PER_CLIENT` → 429 `CLIENT_UPLOADS_AT_CAPACITY`), so
  one client's stalled uploads cannot take everyone's room. Both count bytes as they
  arrive, not connections: 60 slow connections holding 600 bytes each take 36 KB and
  never the room a legitimate 5 MB photo needs. Both with `Retry-After`. A body keeps
  its share until `release()` (after it is parsed).
"""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from app.errors import (
    BodyReadTimeout,
    ClientDisconnected,
    ClientUploadsAtCapacity,
    PayloadTooLarge,
    UploadsAtCapacity,
)

# Moving the gap's deadline resets a timer (a handle cancelled, a new one in the loop's
# heap): too much to pay on every chunk of every upload. It moves when the gap since the
# last chunk needs it, and then this far beyond: a stalled body is cut after the gap and
# at most this much later.
DEADLINE_STEP_S = 1.0


class BodyBudget:
    """Bytes of request bodies held in memory right now: in all, and per client."""

    def __init__(self, max_bytes: int, *, per_client: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.per_client = min(per_client, max_bytes) if per_client is not None else max_bytes
        self.in_use = 0
        self._by_client: dict[str, int] = {}  # only clients holding bytes now: bounded by them

    def take(self, n: int, client: str) -> None:
        if self.in_use + n > self.max_bytes:
            raise UploadsAtCapacity()
        held = self._by_client.get(client, 0)
        if held + n > self.per_client:
            raise ClientUploadsAtCapacity()
        self.in_use += n
        self._by_client[client] = held + n

    def give(self, n: int, client: str) -> None:
        if n == 0:
            return
        self.in_use -= n
        left = self._by_client.pop(client, 0) - n
        if left > 0:
            self._by_client[client] = left

    def held_by(self, client: str) -> int:
        return self._by_client.get(client, 0)


class BufferedBody:
    """A body read into one buffer, holding its share of the budget until released."""

    def __init__(self, budget: BodyBudget, limit: int, client: str) -> None:
        self.data = bytearray()
        self._budget = budget
        self._limit = limit
        self._client = client
        self._held = 0

    def add(self, chunk: bytes) -> None:
        if len(self.data) + len(chunk) > self._limit:
            raise PayloadTooLarge()
        self._budget.take(len(chunk), self._client)
        self._held += len(chunk)
        self.data += chunk

    def release(self) -> None:
        self._budget.give(self._held, self._client)
        self._held = 0
        self.data = bytearray()


class BodyReader:
    def __init__(
        self, budget: BodyBudget, *, limit: int, timeout_s: float, min_bytes_per_s: float, gap_s: float
    ) -> None:
        self.budget = budget
        self._limit = limit
        self._timeout_s = timeout_s
        self._min_bytes_per_s = min_bytes_per_s
        self._gap_s = gap_s

    async def read(self, request: Request, *, client: str) -> BufferedBody:
        """The whole body, within the size limit, the deadline, the gap and the budget;
        `client` is whose share of the budget it takes (the caller's rate key)."""
        declared = request.headers.get("content-length")
        expected = int(declared) if declared is not None and declared.isdigit() else self._limit
        if expected > self._limit:
            raise PayloadTooLarge()
        body = BufferedBody(self.budget, self._limit, client)
        try:
            await self._fill(request, body, expected)
        except BaseException:
            body.release()
            raise
        return body

    async def _fill(self, request: Request, body: BufferedBody, expected: int) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        final_at = started + self._timeout_s + expected / self._min_bytes_per_s
        try:
            async with asyncio.timeout_at(min(final_at, started + self._gap_s)) as deadline:
                async for chunk in request.stream():
                    body.add(chunk)
                    now = loop.time()
                    # The deadline only ever comes closer: what is still missing must come at
                    # the minimum rate from now on, so a body sent fast and then trickled a
                    # byte per gap is cut at that pace, not after the whole size's allowance.
                    left = max(expected - len(body.data), 0)
                    final_at = min(final_at, now + self._timeout_s + left / self._min_bytes_per_s)
                    gap_ends = now + self._gap_s
                    when = deadline.when() or final_at
                    if when > final_at:
                        deadline.reschedule(final_at)
                    elif gap_ends > when and when < final_at:
                        deadline.reschedule(min(final_at, gap_ends + DEADLINE_STEP_S))
        except TimeoutError:
            if (deadline.when() or final_at) < final_at:
                raise BodyReadTimeout(
                    f"No part of the request body arrived for {self._gap_s:g} s (BODY_GAP_TIMEOUT_S)."
                ) from None
            raise BodyReadTimeout() from None
        except ClientDisconnect:
            raise ClientDisconnected() from None
