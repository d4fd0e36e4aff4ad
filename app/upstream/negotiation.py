"""Parameter negotiation: a deployment that refuses an optional parameter costs one extra
call, not every scan. A 400 naming one of `NEGOTIABLE` (its field, or a JSON Schema
keyword of our `response_format`) drops it, or converts it, for that deployment's model
from then on; it is logged once and counted. A parameter is given up at most once, so a
400 that names it again is the request's fault, not one to negotiate: never a loop."""

from __future__ import annotations

import logging
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


class Negotiation:
    """What one deployment's model refused, and the body changes that follow."""

    def __init__(
        self, where: str, *, dropped: frozenset[str] = frozenset(), schema: frozenset[str] = frozenset()
    ):
        self.where = where  # "deployment/model", for the log
        self.dropped: set[str] = set(dropped)
        self.schema_dropped: set[str] = set(schema)
        self.converted: dict[str, str] = {}
        self.version = 0  # learned parameters: a body built at an older version may still carry one

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
