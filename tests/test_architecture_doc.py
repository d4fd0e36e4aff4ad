"""ARCHITECTURE.md promises that every name in it exists: this holds it to that. Every
path of the repository it mentions exists, and every backticked code name (a module's
function or class, `Class.method`, a constant, a setting, a metric) is found in the code
or the tests, so a rename that forgets the map fails here instead of misleading a reader."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "ARCHITECTURE.md"

# Paths of the repository's own trees, as the map writes them (a trailing dot or comma is
# the sentence's).
PATH = re.compile(r"\b((?:app|tests|k6|deploy|docs)/[\w./-]*\w/?)")
# A code name: `name`, `Class.method`, `func()`; anything else between backticks (JSON, a
# command, `metric{label}`, an HTTP line) is prose.
CODE_NAME = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?$")
SOURCES = ("app/**/*.py", "app/**/*.lua", "app/**/*.sql", "app/static/**/*.js", "tests/**/*.py", "k6/**/*.py")
SIM_PREFIX = "SIM_"  # the simulator's settings: SIM_<field of app/sim/config.py's SimConfig>


@cache
def code_words() -> frozenset[str]:
    files = (p for pattern in SOURCES for p in REPO.glob(pattern) if p != Path(__file__))
    return frozenset(word for p in files for word in re.findall(r"\w+", p.read_text()))


def defined(part: str) -> bool:
    """`part` is a word of the code; an upper-case one may also be a setting (its field in
    lower case) or a simulator setting."""
    words = [part]
    if re.fullmatch(r"[A-Z][A-Z0-9_]+", part):
        words += [part.lower(), part.removeprefix(SIM_PREFIX).lower()]
    return any(word in code_words() for word in words)


def test_every_path_the_architecture_names_exists() -> None:
    text = DOC.read_text()
    missing = sorted({p for p in PATH.findall(text) if not (REPO / p).exists()})
    assert not missing, f"ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_code_name_the_architecture_names_exists() -> None:
    names = {n for n in re.findall(r"`([^`\n]+)`", DOC.read_text()) if CODE_NAME.match(n)}
    assert len(names) > 100, "the map names fewer things than it should: is the pattern still right?"
    missing = sorted(n for n in names if not all(defined(part) for part in n.removesuffix("()").split(".")))
    assert not missing, f"ARCHITECTURE.md names what the code does not have: {missing}"


def test_the_check_catches_a_stale_name() -> None:
    """The checks above can fail: a name nobody defines is not found."""
    assert not defined("ScanPipelineThatNeverExisted")
    assert defined("ScanPipeline") and defined("SCAN_DEADLINE_S") and defined("SIM_FLAVOR")
