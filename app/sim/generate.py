"""Deterministic assistant content: schema-valid JSON, a small JSON object, or Korean text."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from typing import Any

from app.sim.filler import korean_text
from app.sim.request import ChatRequest
from app.sim.waste import answer_document, vision_document

# Past this nesting depth recursive schemas take their smallest valid shape.
MAX_DEPTH = 12
UNBOUNDED_ARRAY_MAX = 3
_FORMAT_SAMPLES = {
    "date-time": "2024-05-01T09:30:00Z",
    "date": "2024-05-01",
    "time": "09:30:00",
    "email": "sim@example.com",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "uri": "https://example.com/sim",
}


def content_rng(digest: bytes, seed: int) -> random.Random:
    """RNG seeded by the request digest (images + text + schema) and the config seed."""
    mixed = hashlib.sha256(digest + seed.to_bytes(16, "big", signed=True)).digest()
    return random.Random(int.from_bytes(mixed[:8], "big"))


def generate_content(request: ChatRequest, text_tokens: int, seed: int) -> str:
    """The assistant message for ``request``; identical requests give identical content."""
    rng = content_rng(request.digest, seed)
    if request.format_type == "json_schema" and request.schema:
        # ecoscan's own calls get replies that make sense; any other schema a valid value.
        document = vision_document(request.schema, request.schema_key, request.text, rng, request.image_key)
        if document is None:
            document = answer_document(request.schema, request.text, text_tokens)
        if document is None:
            document = generate_document(request.schema, rng, text_tokens)
        return json.dumps(document, ensure_ascii=False, separators=(",", ":"))
    if request.format_type in ("json_object", "json_schema"):
        answer = {"answer": korean_text(rng, text_tokens)}
        return json.dumps(answer, ensure_ascii=False, separators=(",", ":"))
    return korean_text(rng, text_tokens)


def unenforced_content(request: ChatRequest, text_tokens: int, seed: int) -> str:
    """The reply to a json_schema ``request`` when the schema is not enforced (``malformed_next``).

    Strict structured outputs never do this on OpenAI: with finish ``stop`` the content
    always matches the schema. Without enforcement — JSON mode (``json_object``), a
    non-strict schema, or a compatible server that treats ``json_schema`` as JSON mode —
    the model only promises JSON that parses, and will pick keys of its own. So this is
    JSON mode's reply (valid JSON, not the schema's shape) rather than broken JSON: JSON
    mode's content is only cut short with finish ``length``, which the cap already models.
    (A schema that accepts an object with just a string ``answer`` would accept it.)
    """
    unbound = dataclasses.replace(request, format_type="json_object", schema=None)
    return generate_content(unbound, text_tokens, seed)


def generate_document(schema: dict[str, Any], rng: random.Random, text_tokens: int) -> Any:
    """A value valid against ``schema`` whose free strings hold ~``text_tokens`` tokens."""
    walker = _Walker(schema, rng)
    document = walker.value(schema, 0)
    slots = walker.slots
    if not slots:
        return document
    share, extra = divmod(text_tokens, len(slots))
    for i, slot in enumerate(slots):
        slot.fill(korean_text(rng, max(2, share + (1 if i < extra else 0))))
    return _resolve_slots(document)


class _Slot:
    """A free string whose text is chosen once the number of free strings is known."""

    __slots__ = ("max_length", "min_length", "text")

    def __init__(self, min_length: int, max_length: int | None) -> None:
        self.min_length = min_length
        self.max_length = max_length
        self.text = ""

    def fill(self, text: str) -> None:
        if self.max_length is not None:
            text = text[: self.max_length]
        if len(text) < self.min_length:
            text = (text + "가" * self.min_length)[: max(self.min_length, len(text))]
        self.text = text


def _resolve_slots(value: Any) -> Any:
    if isinstance(value, _Slot):
        return value.text
    if isinstance(value, dict):
        return {k: _resolve_slots(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_slots(v) for v in value]
    return value


class _Walker:
    def __init__(self, root: dict[str, Any], rng: random.Random) -> None:
        self.root = root
        self.rng = rng
        self.slots: list[_Slot] = []

    def resolve(self, ref: str) -> dict[str, Any]:
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            raise ValueError(f"unsupported $ref {ref!r}")
        node: Any = self.root
        for part in ref[2:].split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        if not isinstance(node, dict):
            raise ValueError(f"$ref {ref!r} does not point at a schema")
        return node

    def value(self, schema: dict[str, Any], depth: int) -> Any:
        if "$ref" in schema:
            return self.value(self.resolve(schema["$ref"]), depth + 1)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return self.rng.choice(schema["enum"])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.value(self._pick_branch(schema[key], depth), depth + 1)
        if "allOf" in schema:
            return self.value(self._merge(schema["allOf"], schema), depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            concrete = [k for k in kind if k != "null"]
            if not concrete:
                return None
            kind = concrete[0] if len(concrete) == 1 else self.rng.choice(concrete)
        if kind is None:
            kind = _infer_type(schema)
        if kind == "object":
            props = schema.get("properties", {})
            return {name: self.value(sub, depth + 1) for name, sub in props.items()}
        if kind == "array":
            return self._array(schema, depth)
        if kind == "string":
            return self._string(schema)
        if kind == "integer":
            return self._integer(schema)
        if kind == "number":
            return self._number(schema)
        if kind == "boolean":
            return self.rng.random() < 0.5
        if kind == "null":
            return None
        raise ValueError(f"unsupported schema type {kind!r}")

    def _pick_branch(self, branches: list[dict[str, Any]], depth: int) -> dict[str, Any]:
        # Nullable fields get a value unless recursion must stop.
        nulls = [b for b in branches if b.get("type") == "null"]
        others = [b for b in branches if b.get("type") != "null"]
        if nulls and (depth > MAX_DEPTH or not others):
            return nulls[0]
        return self.rng.choice(others)

    def _merge(self, parts: list[dict[str, Any]], outer: dict[str, Any]) -> dict[str, Any]:
        merged: dict[str, Any] = {k: v for k, v in outer.items() if k != "allOf"}
        for part in parts:
            sub = self.resolve(part["$ref"]) if "$ref" in part else part
            for key, value in sub.items():
                if key == "properties":
                    merged["properties"] = {**merged.get("properties", {}), **value}
                elif key == "required":
                    merged["required"] = [*merged.get("required", []), *value]
                else:
                    merged.setdefault(key, value)
        return merged

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        low = int(schema.get("minItems", 0))
        high = schema.get("maxItems")
        upper = max(low, UNBOUNDED_ARRAY_MAX if high is None else min(int(high), 5))
        # Empty arrays are legal and common in real replies (e.g. "nothing left to do").
        count = low if depth > MAX_DEPTH else self.rng.randint(low, upper)
        items = schema.get("items", {})
        if isinstance(items, dict) and "enum" in items and schema.get("uniqueItems"):
            choices = items["enum"]
            return self.rng.sample(choices, min(max(count, low), len(choices)))
        return [self.value(items, depth + 1) for _ in range(count)]

    def _string(self, schema: dict[str, Any]) -> Any:
        sample = _FORMAT_SAMPLES.get(str(schema.get("format")))
        if sample is not None:
            return sample
        slot = _Slot(int(schema.get("minLength", 0)), schema.get("maxLength"))
        self.slots.append(slot)
        return slot

    def _integer(self, schema: dict[str, Any]) -> int:
        low, high = _bounds(schema, integer=True)
        return self.rng.randint(int(low), int(high))

    def _number(self, schema: dict[str, Any]) -> float:
        low, high = _bounds(schema, integer=False)
        value = round(self.rng.uniform(low, high), 2)
        return min(max(value, low), high)


def _infer_type(schema: dict[str, Any]) -> str:
    if "items" in schema:
        return "array"
    return "object" if "properties" in schema else "string"


def _bounds(schema: dict[str, Any], integer: bool) -> tuple[float, float]:
    step = 1 if integer else 0.01
    low: float | None = schema.get("minimum")
    high: float | None = schema.get("maximum")
    if "exclusiveMinimum" in schema:
        low = schema["exclusiveMinimum"] + step
    if "exclusiveMaximum" in schema:
        high = schema["exclusiveMaximum"] - step
    if integer:
        low = None if low is None else float(-(-low // 1))
        high = None if high is None else float(high // 1)
    if low is None:
        return (0.0, 100.0) if high is None else (float(high) - 100.0, float(high))
    if high is None:
        return float(low), float(low) + 100.0
    return float(low), float(max(low, high))
