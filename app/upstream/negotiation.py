"""Parameter negotiation: a deployment that refuses an optional parameter costs one extra
call, not every scan. A 400 naming one of `NEGOTIABLE` (its field, or a JSON Schema
keyword of our `response_format`) drops it, or converts it, for that deployment's model
from then on; it is logged once and counted. A parameter is given up at most once, so a
400 that names it again is the request's fault, not one to negotiate: never a loop.

In one flight: while a deployment's model has not answered for a negotiable parameter
(accepted by a 2xx, or refused), one call carrying it goes alone (a `Trial`); calls
carrying any of the same unanswered parameters wait for its answer (`turn`, bounded by
`NEGOTIATION_WAIT_S` and the call's deadline), then go out as negotiated. A burst at a
deployment that refuses `temperature` costs one refused call, not one per call in flight.
A trial that ends without an answer (a 5xx, a timeout, a cancel) wakes the waiters and
one of them tries next. A model its provider and profile describe (app/upstream/profiles.py)
has nothing to find out: `settled`."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Fields we send that a call can do without, and what each becomes when refused.
DROPPABLE = (
    "temperature",
    "top_p",
    "reasoning_effort",
    "safety_identifier",
    "stream_options",
    "prompt_cache_key",
)
CONVERTED = {"max_completion_tokens": "max_tokens"}
# Keywords of our JSON schemas a provider's subset may refuse; the reply is still parsed
# and checked by the stage, so the schema can do without them.
SCHEMA_KEYWORDS = ("additionalProperties", "strict", "minItems", "maxItems", "pattern", "format")
NEGOTIABLE = frozenset((*DROPPABLE, *CONVERTED, *SCHEMA_KEYWORDS))
_TOP_LEVEL = frozenset((*DROPPABLE, *CONVERTED))
# How long a call waits, at most, for the trial of a parameter its deployment has not
# answered for yet (NEGOTIATION_WAIT_S); then it goes as it is.
NEGOTIATION_WAIT_S = 2.0
# What `turn` says of the wait: none, the trial answered (or ended), or the wait ran out.
NO_WAIT, ANSWERED, TIMED_OUT = "none", "answered", "timed_out"


@dataclass(eq=False)
class Trial:
    """The one call finding out whether the deployment takes `unknown`."""

    unknown: frozenset[str]
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Negotiation:
    """What one deployment's model refused, and the body changes that follow."""

    def __init__(
        self,
        where: str,
        *,
        dropped: frozenset[str] = frozenset(),
        schema: frozenset[str] = frozenset(),
        settled: bool = False,
    ):
        self.where = where  # "deployment/model", for the log
        self.dropped: set[str] = set(dropped)
        self.schema_dropped: set[str] = set(schema)
        self.converted: dict[str, str] = {}
        self.version = 0  # learned parameters: a body built at an older version may still carry one
        self.settled = settled  # True: every parameter's outcome is known up front
        self.accepted: set[str] = set()  # carried by a call the deployment answered with a 2xx
        self._trials: list[Trial] = []
        # A response_format's schema keywords, by its id (the stages' formats live for the process).
        self._keywords: dict[int, tuple[object, frozenset[str]]] = {}

    def names_in(self, body: dict[str, Any], leave_out: frozenset[str] = frozenset()) -> frozenset[str]:
        """The negotiable names `body` (as built, before `apply`) carries, less `leave_out`
        (what its provider is known to refuse: never sent)."""
        names = {k for k in body if k in _TOP_LEVEL and k not in leave_out}
        fmt = body.get("response_format")
        if isinstance(fmt, dict):
            cached = self._keywords.get(id(fmt))
            if cached is None or cached[0] is not fmt:
                cached = self._keywords[id(fmt)] = (fmt, _schema_keywords(fmt))
            names |= cached[1]
        return frozenset(names)

    def unanswered(self, names: frozenset[str]) -> frozenset[str]:
        """Of `names`, those the deployment has neither accepted nor refused yet."""
        if self.settled:
            return frozenset()
        return frozenset(
            n
            for n in names
            if n not in self.accepted
            and n not in self.dropped
            and n not in self.schema_dropped
            and n not in self.converted
        )

    async def turn(self, names: frozenset[str], wait_s: float) -> tuple[Trial | None, str]:
        """Before a call carrying `names` goes: a `Trial` when it is to go alone (end it
        with `end`), None when it may go (all answered, or `wait_s` ran out); and what the
        wait was (`NO_WAIT`, `ANSWERED`, `TIMED_OUT`)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + wait_s
        waited = NO_WAIT
        while unknown := self.unanswered(names):
            blocking = next((t for t in self._trials if t.unknown & unknown), None)
            if blocking is None:
                trial = Trial(unknown)
                self._trials.append(trial)
                return trial, waited
            left = until - loop.time()
            if left <= 0:
                return None, TIMED_OUT
            try:
                async with asyncio.timeout(left):
                    await blocking.done.wait()
            except TimeoutError:
                return None, TIMED_OUT
            waited = ANSWERED
        return None, waited

    def accept(self, names: frozenset[str]) -> None:
        """A 2xx answered a call carrying `names`: they are taken; trials they answer end."""
        if self.settled or names <= self.accepted:
            return
        self.accepted |= names
        for trial in [t for t in self._trials if not self.unanswered(t.unknown)]:
            self.end(trial)

    def end(self, trial: Trial) -> None:
        """The trial's call is over (answered or not): its waiters look again."""
        if trial in self._trials:
            self._trials.remove(trial)
        trial.done.set()

    def learn(self, parameter: str) -> bool:
        """Give `parameter` up for this deployment's model; False when it is not one we can
        do without, or was given up already (the 400 is then not about it)."""
        name = parameter.rsplit(".", 1)[-1]
        if (
            name not in NEGOTIABLE
            or name in self.dropped
            or name in self.schema_dropped
            or name in self.converted
        ):
            return False
        if name in CONVERTED:
            self.converted[name] = CONVERTED[name]
        elif name in SCHEMA_KEYWORDS:
            self.schema_dropped.add(name)
        else:
            self.dropped.add(name)
        self.version += 1
        log.warning("upstream %s refuses %r: sent without it from now on", self.where, name)
        return True

    def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` as this deployment's model takes it (a new dict when anything changes)."""
        if not (self.dropped or self.converted or self.schema_dropped):
            return body
        out = {k: v for k, v in body.items() if k not in self.dropped}
        for old, new in self.converted.items():
            if old in out:
                out[new] = out.pop(old)
        fmt = out.get("response_format")
        if self.schema_dropped and isinstance(fmt, dict) and isinstance(fmt.get("json_schema"), dict):
            spec = dict(fmt["json_schema"])
            if "strict" in self.schema_dropped:
                spec.pop("strict", None)
            if isinstance(spec.get("schema"), dict):
                spec["schema"] = without_keywords(spec["schema"], self.schema_dropped)
            out["response_format"] = {**fmt, "json_schema": spec}
        return out


def _schema_keywords(fmt: dict[str, Any]) -> frozenset[str]:
    """The negotiable JSON Schema keywords a `response_format` uses, at any level."""
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        return frozenset()
    found: set[str] = {"strict"} if "strict" in spec else set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key in SCHEMA_KEYWORDS:
                    found.add(key)
                if key == "properties" and isinstance(value, dict):
                    for sub in value.values():
                        walk(sub)
                else:
                    walk(value)

    walk(spec.get("schema"))
    return frozenset(found)


def without_keywords(schema: Any, keywords: set[str] | frozenset[str]) -> Any:
    """A JSON schema without `keywords`, at every level (property names are kept)."""
    if isinstance(schema, list):
        return [without_keywords(item, keywords) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in keywords:
            continue
        if key == "properties" and isinstance(value, dict):
            out[key] = {name: without_keywords(sub, keywords) for name, sub in value.items()}
        else:
            out[key] = without_keywords(value, keywords)
    return out
