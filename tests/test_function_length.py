"""No function in app/ is longer than 80 lines (the team's guide): a longer one holds more
than one idea. Read from the source with `ast`, nested functions and methods included."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parent.parent / "app"
MAX_LINES = 80


def _long_functions(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_LINES:
                found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_app_is_over_80_lines() -> None:
    long = [
        f for p in sorted(APP.rglob("*.py")) for f in _long_functions(p.read_text(), str(p.relative_to(APP)))
    ]
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_the_check_finds_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert _long_functions(f"def long():\n{body}\n", "x.py") == ["x.py:1 long (81 lines)"]
    assert _long_functions(f"def short():\n{body[: body.rindex(chr(10))]}\n", "x.py") == []
