"""`SingleFlight`: concurrent callers of one key share one call.

The first caller of a key *leads*: it runs the call in its own task, under its own
deadline. Callers that arrive while the call is in flight *follow*: they wait (each
bounded by its own deadline, since the wait is shielded and their own cancellation
only ends their wait) for what the leader's call came to, a `Landing`:

- a value: every follower gets it;
- an error the caller's `shares` predicate accepts (the upstream's verdict on the
  request, the same for every follower): every follower raises a fresh copy of it;
- neither: the leader gave up for reasons of its own (cancelled because its client
  left or its deadline passed, or a failure that is not a verdict). A follower never
  inherits that: it looks again and one of them leads a new call.

The flight's future always gets a *result*, never an exception, so a flight nobody
followed leaves nothing unretrieved behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True)
class Landing(Generic[V]):
    """What a led call came to; both None when its leader gave up."""

    value: V | None = None
    error: Exception | None = None


class SingleFlight(Generic[K, V]):
    def __init__(self, *, shares: Callable[[Exception], bool]) -> None:
        self._shares = shares
        self._flights: dict[K, asyncio.Future[Landing[V]]] = {}

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    async def follow(self, key: K) -> Landing[V] | None:
        """None when no call for `key` is in flight; else, once it lands, what it came to."""
        flight = self._flights.get(key)
        if flight is None:
            return None
        # Shielded: a follower's cancellation (its deadline, its client) ends its own
        # wait, never the flight the others wait for.
        return await asyncio.shield(flight)

    async def lead(self, key: K, call: Callable[[], Awaitable[V]]) -> V:
        """Run `call` as the one call for `key`; followers get what it comes to."""
        if key in self._flights:
            raise RuntimeError("a call for this key is already in flight: follow it")
        flight: asyncio.Future[Landing[V]] = asyncio.get_running_loop().create_future()
        self._flights[key] = flight
        landing: Landing[V] = Landing()
        try:
            value = await call()
            landing = Landing(value=value)
            return value
        except Exception as exc:
            if self._shares(exc):
                landing = Landing(error=exc)
            raise
        finally:  # cancelled too: the followers must wake, and one of them leads next
            del self._flights[key]
            flight.set_result(landing)
