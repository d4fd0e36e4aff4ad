"""A `Route` is one deployment serving one stage: where its calls go (the deployment's
endpoint), what they spend (its limit group's budget for the model), whether they can
go (the deployment's breaker), and how the deployment's model is asked (the stage's call
shaped for that model, its provider's body rules, what it refused so far).

`Router.pick` chooses a route per attempt: among the stage's routes whose breaker is
closed (with none, `NoRoute` says whether one may come back: the call can wait for its
probe, app/upstream/probes.py), the
lowest `priority` whose budgets can admit the call before its deadline; within it, the
one whose budget admits the call soonest among those with room under their own
concurrency limit (app/limits/route_limits.py; all of them when none has room, or none
with room can admit it in time), ties broken by the smallest share of its limit in use
once the call is counted (weighted least connections: each route's share of the calls
follows its limit);
routes that already failed this call only when nothing else is left. The route with room
that the call's cacheable prompt prefix went to last takes it instead of the one chosen
so, when it admits it as soon (app/upstream/affinity.py: a prompt cache is kept per
organisation). A route's limit does not pass a priority over: a standby takes the calls
a primary's budget or breaker cannot, not those past the primary's limit (the stage gate bounds those).
`Router.predicted_wait`, what admission asks, spends the routes' capacity in the same
order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.limits.clock import Clock
from app.limits.rate_budget import RateBudget
from app.limits.route_limits import RouteLimit
from app.limits.timeouts import RecentPeak
from app.upstream.affinity import PrefixAffinity, prefix_key
from app.upstream.breaker import Breaker
from app.upstream.call import ChatCall, ChatRequest
from app.upstream.deployments import Deployment
from app.upstream.endpoint import ChatEndpoint
from app.upstream.hedging import FirstByteTimes
from app.upstream.negotiation import Negotiation, without_keywords
from app.upstream.profiles import CallShape
from app.upstream.providers.base import Provider
from app.upstream.tokens import ImageBilling, estimate_chat_tokens

# Prompt-cache affinity picks the deployment that served a prefix last only while the share
# of its limit in use exceeds the balanced pick's by at most this many of that one's calls:
# "otherwise equal" give or take a call, never a deployment whose limit fell as it slowed.
AFFINITY_SLACK_CALLS = 1


@dataclass(eq=False)
class Route:
    deployment: Deployment
    provider: Provider
    stage: str
    shape: CallShape
    endpoint: ChatEndpoint  # one per deployment
    budget: RateBudget  # one per limit group and model
    breaker: Breaker  # one per deployment
    negotiation: Negotiation  # one per deployment and model
    limit: RouteLimit  # its own concurrency limit: its calls, from the stage gate's queue on
    # How long this deployment's replies to this stage took lately, to their head (a
    # whole reply when not streamed): how long the next one is waited for.
    reply_took: RecentPeak = field(default_factory=RecentPeak)
    # Its recent first-byte times, to hedge a call whose reply is late (app/upstream/hedging.py).
    first_byte: FirstByteTimes = field(default_factory=FirstByteTimes)
    _formats: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.deployment.name

    @property
    def model(self) -> str:
        return self.shape.model

    @property
    def billing(self) -> ImageBilling:
        return self.provider.image_billing(self.model) or self.shape.profile.image

    def estimate(self, request: ChatRequest) -> int:
        """The request's prompt tokens, as this deployment's model bills them."""
        sizes = request.image_sizes
        return estimate_chat_tokens(request.messages, image_sizes=sizes, image_billing=self.billing) + (
            request.extra_prompt_tokens
        )

    def limiter_tokens(self, prompt_estimate: int, kind: str) -> int:
        """What this deployment's limiter counts for a `kind` call of `prompt_estimate`
        tokens: its provider's formula, times what its budget learned the limiter really
        charges (app/limits/charge_learning.py)."""
        return self.budget.charges.charge(kind, self.limiter_formula(prompt_estimate))

    def limiter_formula(self, prompt_estimate: int) -> int:
        """The same by its provider's formula alone (today's estimate)."""
        return self.provider.limiter_tokens(prompt_estimate, self.shape.completion_cap)

    def settled_tokens(
        self, call: ChatCall, reserved: int, prompt_tokens: int, completion_tokens: int
    ) -> int:
        """What the limiter counted in the end: as reserved, or (a provider that counts the
        usage) the usage, scaled as learned like the reservation was."""
        counted = self.provider.limiter_settles(reserved, prompt_tokens, completion_tokens)
        if counted == reserved:
            return reserved
        return self.budget.charges.charge(call.kind, counted)

    def shaped(self, request: ChatRequest) -> ChatCall:
        estimate = self.estimate(request)
        kind = request.kind
        safety_id = request.safety_identifier
        if "safety_identifier" in self.provider.unsupported_fields:
            safety_id = None
        return ChatCall(
            stage=request.stage,
            shape=self.shape,
            messages=request.messages,
            prompt_estimate=estimate,
            response_format=self._format(request.response_format),
            safety_identifier=safety_id,
            upstream=self.name,
            reservation_tokens=self.limiter_tokens(estimate, kind),
            limiter_estimate=self.limiter_formula(estimate),
            kind=kind,
        )

    def adapt(self, body: dict[str, Any]) -> dict[str, Any]:
        """A request body as this deployment's model takes it: its provider's refusals
        known up front, then what it refused since."""
        unsupported = self.provider.unsupported_fields
        if unsupported and any(name in body for name in unsupported):
            body = {k: v for k, v in body.items() if k not in unsupported}
        return self.negotiation.apply(body)

    def sent_names(self, body: dict[str, Any]) -> frozenset[str]:
        """The negotiable names `body` (before `adapt`) carries to this deployment."""
        return self.negotiation.names_in(body, self.provider.unsupported_fields)

    def _format(self, response_format: dict[str, Any] | None) -> dict[str, Any] | None:
        """The stage's schema without the keywords this provider refuses (kept per schema)."""
        keywords = self.provider.unsupported_schema_keywords
        if response_format is None or not keywords or "json_schema" not in response_format:
            return response_format
        cached = self._formats.get(id(response_format))
        if cached is None:
            spec = dict(response_format["json_schema"])
            spec["schema"] = without_keywords(spec.get("schema", {}), keywords)
            cached = self._formats[id(response_format)] = {**response_format, "json_schema": spec}
        return cached


class NoRoute(Exception):
    """No deployment can take the call now; `wait_s`: when the first one may again;
    `returning`: some are open, not taken out (a probe's success brings one back)."""

    def __init__(self, stage: str, wait_s: float, *, returning: bool = False) -> None:
        super().__init__(f"no route for {stage}")
        self.wait_s = wait_s
        self.returning = returning


class Router:
    def __init__(
        self,
        routes: Sequence[Route],
        clock: Clock,
        *,
        spill_after_s: float = math.inf,
        affinity: PrefixAffinity | None = None,
    ) -> None:
        """`spill_after_s`: the longest a call waits for a priority's budgets while the
        next priority's could take it sooner (`MAX_BUDGET_WAIT_S`, what admission accepts);
        `affinity`: where prompts' prefixes went last (None: `UPSTREAM_CACHE_AFFINITY` off)."""
        self._clock = clock
        self._spill_after_s = spill_after_s
        self._affinity = affinity
        self.by_stage: dict[str, list[Route]] = {}
        for route in routes:
            self.by_stage.setdefault(route.stage, []).append(route)

    @property
    def routes(self) -> list[Route]:
        return [route for routes in self.by_stage.values() for route in routes]

    def usable(self, stage: str) -> list[Route]:
        """The `stage` routes that can take calls now: those whose breaker lets a call
        through; with none, those not taken out (a breaker steers calls between
        deployments, it does not stop the last ones)."""
        now = self._clock.now()
        routes = self.by_stage.get(stage, [])
        return [r for r in routes if r.breaker.ready(now)] or [r for r in routes if not r.breaker.out]

    def prefix_of(self, request: ChatRequest) -> int | None:
        """The key of `request`'s cacheable prefix for `pick`; None with affinity off."""
        return None if self._affinity is None else prefix_key(request)

    def pick(
        self,
        stage: str,
        tokens: Callable[[Route], int],
        *,
        avoid: Mapping[str, object] | None = None,
        within_s: float | None = None,
        prefix: int | None = None,
    ) -> Route:
        """The route the next attempt of a `stage` call takes (see the module docstring).
        `tokens(route)`: what the call would reserve there; `within_s`: the time left to
        the call's deadline; `prefix`: its prompt's `prefix_of`. A priority whose budgets
        cannot admit the call by then, or within `spill_after_s`, is passed over for the
        next (with none that can, the route that admits it soonest)."""
        if self._affinity is None or prefix is None:
            return self._pick(stage, tokens, avoid, within_s, None)
        route = self._pick(stage, tokens, avoid, within_s, self._affinity.home(stage, prefix))
        self._affinity.sent(stage, prefix, route.name)
        return route

    def _pick(
        self,
        stage: str,
        tokens: Callable[[Route], int],
        avoid: Mapping[str, object] | None,
        within_s: float | None,
        home: str | None,
    ) -> Route:
        now = self._clock.now()
        routes = self.by_stage.get(stage, [])
        ready = [r for r in routes if r.breaker.ready(now)]
        if not ready:
            soonest = min((r.breaker.open_until for r in routes), default=now + 1.0)
            raise NoRoute(stage, max(0.0, soonest - now), returning=any(not r.breaker.out for r in routes))
        fresh = [r for r in ready if not avoid or r.name not in avoid] or ready
        # A deployment whose replies are mostly late takes calls only when no other can.
        fresh = [r for r in fresh if not r.first_byte.slow(now)] or fresh
        waits: dict[int, float] = {}

        def wait(route: Route) -> float:
            if id(route) not in waits:
                waits[id(route)] = route.budget.predicted_wait(tokens(route))
            return waits[id(route)]

        def sooner(routes: Sequence[Route]) -> Route:
            return min(routes, key=lambda r: (wait(r), r.limit.load_with_one_more))

        if len(fresh) == 1:  # nowhere else to go: no budget to ask (its queue may be long)
            return fresh[0]
        horizon_s = min(math.inf if within_s is None else within_s, self._spill_after_s)
        best: Route | None = None
        for level in _by_priority(fresh):
            if len(level) == 1 and horizon_s == math.inf:
                return level[0]
            roomy = [r for r in level if r.limit.has_room]
            if roomy and wait(chosen := sooner(roomy)) <= horizon_s:
                # Where the prompt's prefix is cached, when it takes the call as soon and is
                # about as loaded (AFFINITY_SLACK_CALLS): the cache never outweighs the
                # balance, so a deployment that slows down (its limit falls) loses calls.
                cached = next((r for r in roomy if r.name == home), None)
                if cached is None or wait(cached) > wait(chosen):
                    return chosen
                slack = AFFINITY_SLACK_CALLS / chosen.limit.size
                load = cached.limit.load_with_one_more
                return cached if load <= chosen.limit.load_with_one_more + slack else chosen
            chosen = sooner(level)
            if wait(chosen) <= horizon_s:
                return chosen
            if best is None or wait(chosen) < wait(best):
                best = chosen
        assert best is not None  # `fresh` is never empty
        return best

    def spare(self, route: Route, tokens: Callable[[Route], int]) -> Route | None:
        """For a hedge of a call on `route`: another closed route of its stage with room
        under its limit and budget to spare now (`tokens(route)` admitted at once), the
        least loaded; None when budgets or limits bind."""
        now = self._clock.now()
        spare = [
            r
            for r in self.by_stage.get(route.stage, ())
            if r.name != route.name
            and r.breaker.ready(now)
            and r.limit.has_room
            and r.budget.predicted_wait(tokens(r)) == 0
        ]
        return min(spare, key=lambda r: r.limit.load_with_one_more, default=None)

    def predicted_wait(self, stage: str, tokens: Callable[[Route], int], *, ahead: int) -> float:
        """How long a new `stage` call would wait for a budget behind `ahead` calls:
        admission's look-ahead counts the capacity of every route, as `pick` spends it.
        The calls go to the lowest priority first, shared over its routes by their request
        rates; what it cannot admit within `spill_after_s` (past which `pick` passes a
        priority over) falls to the next. Open breakers count as closed
        when every route is open (calls then go on at the retry policy's pace, probing);
        routes taken out do not count (nothing waits for them but their cooldown)."""
        usable = self.usable(stage)
        if not usable:  # every one taken out: no budget to wait for, the call fails at once and says why
            return 0.0
        horizon_s = self._spill_after_s
        wait = 0.0
        for level in _by_priority(usable):
            total_rate = sum(r.budget.effective_rpm for r in level) or 1
            wait = min(
                r.budget.predicted_wait(tokens(r), ahead=round(ahead * r.budget.effective_rpm / total_rate))
                for r in level
            )
            if wait <= horizon_s:
                return wait
            ahead -= sum(_admitted_within(r.budget, tokens(r), horizon_s) for r in level)
            if ahead < 0:  # this priority takes them all, and the new call next
                return horizon_s
        return wait


def _by_priority(routes: Sequence[Route]) -> list[list[Route]]:
    """`routes` grouped by priority, the lowest (tried first) first."""
    levels: dict[int, list[Route]] = {}
    for route in routes:
        levels.setdefault(route.deployment.priority, []).append(route)
    return [levels[p] for p in sorted(levels)]


def _admitted_within(budget: RateBudget, tokens: int, seconds: float) -> int:
    """How many calls of `tokens` the budget admits within `seconds` (its queue first):
    the largest `ahead` whose next call still waits no longer, by doubling then bisecting."""
    if budget.predicted_wait(tokens) > seconds:
        return 0
    low, high = 0, 1
    while budget.predicted_wait(tokens, ahead=high) <= seconds:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if budget.predicted_wait(tokens, ahead=middle) <= seconds:
            low = middle
        else:
            high = middle
    return low + 1
