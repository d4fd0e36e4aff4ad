"""A concurrency limit per route (one deployment serving one stage), and the stage's
limit made of them.

Each route's `RouteLimit` is an `AdaptiveLimit` (app/limits/adaptive.py) fed by that
route's replies only: Little's law from its own budget's call rate and its own latency,
cut by its own latency rising and its own 429s, 5xx and timeouts. So one deployment that
slows down or says it has too much loses slots, and the others keep theirs.

- `Router.pick` (app/upstream/routes.py) prefers, within a priority, the routes with
  room under their limit: traffic moves off a struggling deployment before its breaker
  has to open.
- A stage gate at `auto` follows its routes (`RouteSizing.step`): its limit is the sum
  of the limits of the routes that can take calls now, clamped into the gate's own
  [floor, ceiling]. With one deployment that is the one route's limit: what the gate
  alone would have chosen, from the same replies and the same budget.
- A fixed gate keeps its number; the route limits still adapt and steer `pick`.

A route counts its calls from the moment an attempt starts (queued at the stage gate,
then at the budget, then sent) to its end: a call that waits at the gate has chosen its
route, so `pick` must count it there, or every call arriving while the gate is full
would choose the same route.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

from app.limits.adaptive import AdaptiveLimit, LimitChange
from app.limits.moves import Moves

# Why a stage's limit moved when no route's limit did (a route became ready or not).
ROUTES_CHANGED = "routes"


class RouteLimit:
    """One route's limit and the calls that hold it now."""

    def __init__(self, limiter: AdaptiveLimit) -> None:
        self.limiter = limiter
        self.active = 0  # attempts on this route from their start (gate queue included) to their end
        self._most_active = 0  # since `step` last read it
        # When each active attempt started, oldest first (dicts keep insertion order).
        self._since: dict[int, float] = {}
        self._tokens = itertools.count()

    @property
    def size(self) -> int:
        return self.limiter.limit

    @property
    def has_room(self) -> bool:
        return self.active < self.limiter.limit

    @property
    def load_with_one_more(self) -> float:
        """The share of its limit in use once one more call takes it (past 1 when calls
        wait beyond it). Counting the newcomer, an idle route with a small limit does not
        win every tie against a busy one with a large limit."""
        return (self.active + 1) / self.limiter.limit

    def enter(self) -> int:
        """An attempt on this route starts; returns the token `leave` takes."""
        token = next(self._tokens)
        self._since[token] = time.perf_counter()
        self.active += 1
        self._most_active = max(self._most_active, self.active)
        return token

    def leave(self, token: int) -> None:
        del self._since[token]
        self.active -= 1

    def observe(self, latency_s: float, *, overloaded: bool) -> None:
        """A reply after `latency_s` upstream, or a refusal for load (`overloaded`)."""
        self.limiter.observe(latency_s, overloaded=overloaded)

    def step(self, rate_per_s: float) -> LimitChange:
        """One interval: `rate_per_s`, the calls per second this route's budget allows."""
        self.limiter.in_use(self._most_active)
        self._most_active = self.active
        oldest = next(iter(self._since.values()), None)
        return self.limiter.update(
            rate_per_s=rate_per_s,
            oldest_in_progress_s=0.0 if oldest is None else time.perf_counter() - oldest,
        )


class SizedRoute(Protocol):
    """What route sizing reads of a route (app/upstream/routes.py's `Route`)."""

    @property
    def name(self) -> str: ...

    @property
    def limit(self) -> RouteLimit: ...


R = TypeVar("R", bound=SizedRoute)


class RouteSizing(Generic[R]):
    """Steps every route's limit each interval (app/limits/sizing.py calls `step`).

    `routes`: each stage's routes; `usable(stage)`: those that can take calls now (their
    breaker lets calls through; with none, those not taken out: `Router.usable`);
    `rate(route)`: the calls per second its budget allows (0 when taken out);
    `on_change(route, stage, reason)`: a route's limit moved (the metric)."""

    def __init__(
        self,
        routes: Mapping[str, Sequence[R]],
        *,
        usable: Callable[[str], Sequence[R]],
        rate: Callable[[R], float],
        on_change: Callable[[str, str, str], None] = lambda _route, _stage, _reason: None,
    ) -> None:
        self._routes = routes
        self._usable = usable
        self._rate = rate
        self._moves: Moves[tuple[str, str]] = Moves(
            lambda key, reason: on_change(key[0], key[1], reason),
            lambda key: f"{key[1]} on {key[0]}",
            {(r.name, stage): r.limit.size for stage, rs in routes.items() for r in rs},
        )

    def step(self, stage: str) -> tuple[int, str]:
        """Steps the limit of every route of `stage`; returns the sum of the usable ones'
        and why it moved: the reason of the route whose limit moved the most
        (`ROUTES_CHANGED` when none moved, so a route coming or going did)."""
        reason, biggest = ROUTES_CHANGED, 0
        for route in self._routes.get(stage, ()):
            before = route.limit.size
            change = route.limit.step(self._rate(route))
            self._moves.moved((route.name, stage), change.after, change.reason)
            if abs(change.after - before) > biggest:
                reason, biggest = change.reason, abs(change.after - before)
        return sum(r.limit.size for r in self._usable(stage)), reason
