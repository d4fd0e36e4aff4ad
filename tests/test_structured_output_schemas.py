"""Both response schemas stay inside what OpenAI's strict structured outputs accept
(platform.openai.com/docs/guides/structured-outputs, "Supported schemas"): an object
root, every property required, `additionalProperties: false` on every object, at most
5,000 properties and 10 levels of nesting, at most 1,000 enum values in all, at most
120,000 characters of property names and enum values, and at most 15,000 characters of
values for an enum of more than 250 values. Breaking one is a 400 for every scan."""

from __future__ import annotations

from typing import Any

import asyncpg

from app.db.taxonomy import load_taxonomy
from app.stages.answer import ANSWER_SCHEMA

from .conftest import Service

MAX_PROPERTIES = 5000
MAX_DEPTH = 10
MAX_ENUM_VALUES = 1000
MAX_TOTAL_CHARS = 120_000
LARGE_ENUM = 250
MAX_LARGE_ENUM_CHARS = 15_000
UNSUPPORTED_IN_STRICT = {"minLength", "maxLength", "pattern", "format", "minItems", "maxItems"}


def strict_schema_problems(schema: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    if schema.get("type") != "object" or "anyOf" in schema:
        problems.append("the root must be an object, not anyOf")
    totals = {"properties": 0, "enum_values": 0, "chars": 0}

    def walk(node: dict[str, Any], path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            problems.append(f"{path}: nested deeper than {MAX_DEPTH}")
        problems.extend(f"{path}: {k} (not kept by strict mode)" for k in UNSUPPORTED_IN_STRICT & set(node))
        if "enum" in node:
            values = [str(v) for v in node["enum"]]
            totals["enum_values"] += len(values)
            totals["chars"] += sum(len(v) for v in values)
            if len(values) > LARGE_ENUM and sum(len(v) for v in values) > MAX_LARGE_ENUM_CHARS:
                problems.append(f"{path}: enum of {len(values)} values over {MAX_LARGE_ENUM_CHARS} chars")
        if node.get("type") == "object":
            props: dict[str, Any] = node.get("properties", {})
            totals["properties"] += len(props)
            totals["chars"] += sum(len(name) for name in props)
            if node.get("additionalProperties") is not False:
                problems.append(f"{path}: additionalProperties must be false")
            if set(node.get("required", [])) != set(props):
                problems.append(f"{path}: every property must be required")
            for name, child in props.items():
                walk(child, f"{path}.{name}", depth + 1)
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]", depth + 1)
        for i, branch in enumerate(node.get("anyOf", [])):
            walk(branch, f"{path}|{i}", depth + 1)

    walk(schema, "$", 1)
    if totals["properties"] > MAX_PROPERTIES:
        problems.append(f"{totals['properties']} properties (max {MAX_PROPERTIES})")
    if totals["enum_values"] > MAX_ENUM_VALUES:
        problems.append(f"{totals['enum_values']} enum values (max {MAX_ENUM_VALUES})")
    if totals["chars"] > MAX_TOTAL_CHARS:
        problems.append(f"{totals['chars']} characters of names and values (max {MAX_TOTAL_CHARS})")
    return problems


async def test_the_vision_schema_built_from_the_taxonomy_is_a_valid_strict_schema(
    service: Service, db: asyncpg.Connection
) -> None:
    taxonomy = await load_taxonomy(db)
    schema = taxonomy.vision_schema()
    assert strict_schema_problems(schema) == []
    assert len(schema["properties"]["category"]["enum"]) == len(taxonomy.paths)


def test_the_answer_schema_is_a_valid_strict_schema() -> None:
    assert strict_schema_problems(ANSWER_SCHEMA) == []


def test_the_checker_catches_what_strict_mode_rejects() -> None:
    bad = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"enum": [str(i) for i in range(1001)]}},
        "required": ["a"],
    }
    problems = strict_schema_problems(bad)
    assert any("additionalProperties" in p for p in problems)
    assert any("required" in p for p in problems)
    assert any("maxLength" in p for p in problems)
    assert any("1001 enum values" in p for p in problems)
