"""`ReplyCache`: upstream replies kept in memory, so a request already answered is not
sent to OpenAI again, and single-flight, so concurrent identical requests share one call.

A reply is the model's text for one request, keyed by a digest of everything that
shaped the request (see `request_digest`; the stages decide what goes in). Only
replies the stage accepted are kept: the stage's call parses the reply before
returning it, so an unusable reply raises instead and is never stored.

Bounded three ways (`CacheLimits`): entries, bytes (key and text, UTF-8) and age.
Least recently used entries go first; an entry older than the TTL is a miss. A zero
in any bound turns the cache off, single-flight included: every request calls.

Every lookup of an enabled cache counts once in `ecoscan_cache_requests_total`:
`hit` (served from memory), `coalesced` (served by another scan's call in flight,
its reply or its error) or `miss` (this scan made the call).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from app.errors import (
    UpstreamContentFiltered,
    UpstreamError,
    UpstreamQuotaExhausted,
    UpstreamRefused,
    UpstreamRejected,
    UpstreamTokenLimit,
)
from app.limits.clock import Clock
from app.runtime.metrics import Metrics
from app.upstream.single_flight import SingleFlight

# The upstream's verdict on a request (after the leader's retries): what the same request
# would get again, so followers share it. A deadline, a cancellation or a bug is the
# leader's own: a follower leads a new call instead.
UPSTREAM_VERDICTS = (
    UpstreamError,  # bad response, timeout and rate limited included
    UpstreamQuotaExhausted,
    UpstreamRejected,
    UpstreamTokenLimit,
    UpstreamRefused,
    UpstreamContentFiltered,
)


@dataclass(frozen=True)
class CacheLimits:
    entries: int
    max_bytes: int
    ttl_s: float

    @property
    def enabled(self) -> bool:
        return self.entries > 0 and self.max_bytes > 0 and self.ttl_s > 0


def request_digest(*parts: object) -> str:
    """A SHA-256 of JSON-able parts: the key of a request built from them."""
    text = json.dumps(parts, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class _Entry:
    text: str
    stored_at: float
    size: int


class _LruStore:
    """Texts by key, least recently used first, within the entry and byte bounds."""

    def __init__(self, limits: CacheLimits, clock: Clock) -> None:
        self._limits = limits
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self._clock.now() - entry.stored_at >= self._limits.ttl_s:
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return entry.text

    def put(self, key: str, text: str) -> None:
        size = len(key) + len(text.encode("utf-8", "surrogatepass"))
        if size > self._limits.max_bytes:
            return
        self._remove(key)
        self._entries[key] = _Entry(text, self._clock.now(), size)
        self.bytes += size
        while len(self._entries) > self._limits.entries or self.bytes > self._limits.max_bytes:
            self._remove(next(iter(self._entries)))

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.size


class ReplyCache:
    @classmethod
    def bounded(cls, name: str, limits: CacheLimits, *, clock: Clock, metrics: Metrics) -> ReplyCache | None:
        """A stage's cache, or None when a bound of 0 turns it off (the stage then keys nothing)."""
        return cls(name, limits, clock=clock, metrics=metrics) if limits.enabled else None

    def __init__(self, name: str, limits: CacheLimits, *, clock: Clock, metrics: Metrics) -> None:
        self.name = name
        self.limits = limits
        self._store = _LruStore(limits, clock)
        self._flights: SingleFlight[str, str] = SingleFlight(shares=_is_verdict)
        self._requests = metrics.cache_requests
        metrics.cache_entries.labels(name).set_function(lambda: len(self._store))
        metrics.cache_bytes.labels(name).set_function(lambda: self._store.bytes)

    @property
    def entries(self) -> int:
        return len(self._store)

    @property
    def bytes(self) -> int:
        return self._store.bytes

    async def get_or_call(self, key: str, call: Callable[[], Awaitable[str]]) -> str:
        """The reply for `key`: kept, another scan's in flight, or `call()`'s (then kept)."""
        if not self.limits.enabled:
            return await call()
        while True:
            text = self._store.get(key)
            if text is not None:
                self._count("hit")
                return text
            landing = await self._flights.follow(key)
            if landing is None:
                break
            if landing.value is not None:
                self._count("coalesced")
                return landing.value
            if landing.error is not None:
                self._count("coalesced")
                raise _copy(landing.error) from None
            # The leader gave up (its deadline, its client): look again; maybe lead.
        self._count("miss")
        return await self._flights.lead(key, lambda: self._call_and_keep(key, call))

    async def _call_and_keep(self, key: str, call: Callable[[], Awaitable[str]]) -> str:
        text = await call()
        self._store.put(key, text)  # before the flight lands: a newcomer finds it kept
        return text

    def _count(self, outcome: str) -> None:
        self._requests.labels(self.name, outcome).inc()


def _is_verdict(exc: Exception) -> bool:
    return isinstance(exc, UPSTREAM_VERDICTS)


def _copy(error: Exception) -> Exception:
    """A follower's own instance of the leader's error: same class, same message (each
    scan raises, logs and reports its own, never another task's traceback)."""
    message = getattr(error, "message", None)
    return type(error)(message) if isinstance(message, str) else error
