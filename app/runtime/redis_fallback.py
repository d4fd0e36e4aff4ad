"""What every holder of state shared through Redis does when Redis fails: it goes on with
a state of its own, and comes back when Redis answers.

Four parts keep state that the replicas share in Redis: the rate budget
(app/limits/shared_budget.py), the per-user caps (app/limits/shared_user_caps.py), the
per-user rate and quota (app/limits/user_quota.py) and the breakers
(app/upstream/shared_breaker.py). Redis is never a reason to stop serving, so each has a
local fallback, and `RedisFallback` is the one state machine they share:

- **shared**: calls go to Redis, each bounded by `deadline()`: a pooled connection may
  take `REDIS_TIMEOUT_S` to come free and the reply as long again.
- a call fails (`REDIS_FAILURES`: an error, a broken connection, the deadline): the
  failure is counted (`on_error`, each one), the holder goes **local** (`on_local`, and
  one warning per outage saying what goes on without Redis), and for
  `RETRY_AFTER_FAILURE_S` Redis is not asked at all (`asks()` is False): a hung Redis
  must not add its timeout to every scan.
- **local**, once that wait is over, the next call asks Redis again: a failure starts the
  wait over, an answer makes the holder **shared** again (`on_shared`, to reconcile, and
  one line in the log).

Writes Redis missed while it failed (a slot's removal, a quota's give-back) are not lost
with the outage: `Unsent` keeps each until Redis takes it, or until it no longer matters
(it has lapsed in Redis on its own), and sends them all again every `RESEND_S`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Hashable, Iterator
from typing import Any, Final, Generic, TypeVar

from app.runtime.redis_link import RedisError, RedisLink

__all__ = [
    "FAILED",
    "REDIS_FAILURES",
    "RESEND_S",
    "RETRY_AFTER_FAILURE_S",
    "Failed",
    "RedisFallback",
    "Unsent",
]

# What a call to Redis that did not get its answer raises. A bug in our own code is none
# of these: the caller logs it as a bug.
REDIS_FAILURES: Final = (RedisError, OSError, TimeoutError)
# After a failure Redis is not asked this long: each caller on its own then, not each
# waiting out a hung server first.
RETRY_AFTER_FAILURE_S = 1.0
# Writes Redis missed are sent again this often while it fails.
RESEND_S = 1.0
# A call's deadline in `REDIS_TIMEOUT_S`: a wait for a pooled connection, then the reply.
_CALL_TIMEOUTS = 2

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


class Failed(enum.Enum):
    """What `RedisFallback.call` returns when Redis did not answer (counted, logged once
    an outage): the caller goes on with its local state."""

    FAILED = "failed"


FAILED: Final = Failed.FAILED


class RedisFallback:
    """Shared or local, when to ask Redis again, and the count and log of the changes
    (see the module docstring). `what` names the holder in the log; `local` says (or
    computes) what goes on while Redis is away, `shared` what its return brings back."""

    def __init__(
        self,
        link: RedisLink,
        what: str,
        *,
        log: logging.Logger,
        local: str | Callable[[], str],
        shared: str,
        on_error: Callable[[], None] | None = None,
        on_local: Callable[[], None] | None = None,
        on_shared: Callable[[], None] | None = None,
        retry_after_s: float = RETRY_AFTER_FAILURE_S,
    ) -> None:
        self.link = link
        self._what = what
        self._log = log
        self._local_text = local
        self._shared_text = shared
        self._on_error = on_error or (lambda: None)
        self._on_local = on_local or (lambda: None)
        self._on_shared = on_shared or (lambda: None)
        self._retry_after_s = retry_after_s
        self._failing = False
        self._retry_at = 0.0

    @property
    def shared(self) -> bool:
        """False from a failure until Redis answers again."""
        return not self._failing

    def asks(self) -> bool:
        """Whether a call should go to Redis now: shared, or the wait after the last
        failure is over."""
        return not self._failing or time.monotonic() >= self._retry_at

    def retry_in(self) -> float:
        """Seconds until Redis may be asked again (0: now)."""
        return 0.0 if not self._failing else max(0.0, self._retry_at - time.monotonic())

    def deadline(self) -> asyncio.Timeout:
        """The bound of one call (or one pipeline, or one script) to Redis."""
        return asyncio.timeout(self.link.timeout_s * _CALL_TIMEOUTS)

    async def call(self, work: Awaitable[T]) -> T | Failed:
        """`work`'s result within `deadline()`, or `FAILED` when Redis did not answer.
        Anything else `work` raises (a cancel, a bug) goes to the caller."""
        try:
            async with self.deadline():
                result = await work
        except REDIS_FAILURES as exc:
            self.failed(exc)
            return FAILED
        self.recovered()
        return result

    def failed(self, exc: BaseException) -> None:
        """A call did not get its answer: counted; the first of an outage goes local."""
        self._on_error()
        self._retry_at = time.monotonic() + self._retry_after_s
        if self._failing:
            return
        self._failing = True
        self._on_local()
        local = self._local_text if isinstance(self._local_text, str) else self._local_text()
        self._log.warning("%s: Redis failed (%s); %s", self._what, str(exc) or type(exc).__name__, local)

    def recovered(self) -> None:
        """Redis answered: after an outage, shared again."""
        if not self._failing:
            return
        self._failing = False
        self._on_shared()
        self._log.info("%s: Redis answers again; %s", self._what, self._shared_text)


class Unsent(Generic[K]):
    """Writes Redis missed, kept until it takes them (see the module docstring).

    `send` writes a batch in one bounded call and raises one of `REDIS_FAILURES` when Redis
    did not take it; every write must be safe to repeat, since one whose reply was lost
    is sent again. `later` sends a write in the background (an end of a scan never waits
    for Redis); `aclose` sends what is left once more and waits for it, within one
    deadline."""

    def __init__(
        self, redis: RedisFallback, send: Callable[[list[K]], Awaitable[object]], *, name: str
    ) -> None:
        self._redis = redis
        self._send = send
        self._name = name
        self._lapses: dict[K, float] = {}  # write -> when it no longer matters (monotonic)
        self._retrying: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False  # no resending started once `aclose` has begun

    def __len__(self) -> int:
        return len(self._lapses)

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._lapses))

    def later(self, write: K, lasts_s: float) -> None:
        """Send `write` in the background; kept for `lasts_s` if Redis does not take it."""
        self._spawn(self.send(write, lasts_s))

    async def send(self, write: K, lasts_s: float) -> bool:
        """Send `write` now; False (and kept, to be sent again) if Redis did not take it."""
        if await self._redis.call(self._send([write])) is not FAILED:
            return True
        self._lapses[write] = time.monotonic() + lasts_s
        if not self._closing and (self._retrying is None or self._retrying.done()):
            self._retrying = asyncio.create_task(self._retry(), name=f"{self._name}-resend")
        return False

    def taken(self, writes: Collection[K]) -> None:
        """Writes Redis took some other way (the caller's own call carried them)."""
        for write in writes:
            self._lapses.pop(write, None)

    async def flush(self) -> None:
        """Send every write still kept (and forget the lapsed) in one call."""
        now = time.monotonic()
        for write, lapses_at in list(self._lapses.items()):
            if lapses_at <= now:
                del self._lapses[write]
        writes = list(self._lapses)
        if writes and await self._redis.call(self._send(writes)) is not FAILED:
            self.taken(writes)

    async def _retry(self) -> None:
        while self._lapses:
            await asyncio.sleep(RESEND_S)
            await self.flush()

    def _spawn(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Stop resending; send what is kept once more and wait for the writes in flight,
        within one deadline (what is left lapses in Redis on its own)."""
        self._closing = True
        if self._retrying is not None:
            self._retrying.cancel()
            await asyncio.gather(self._retrying, return_exceptions=True)
        if self._lapses:
            self._spawn(self.flush())
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self._redis.link.timeout_s * _CALL_TIMEOUTS)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
