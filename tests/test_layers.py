"""The package layout is the architecture: each package imports only from those below it
(ARCHITECTURE.md draws the same list), and no modules import each other in a cycle.
Read from the source with `ast`, every import counts, lazy and type-only ones too."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parent.parent / "app"

# Lowest first. A module may import its own package and anything listed before it.
LAYERS = [
    "app.errors",
    "app.runtime",  # metrics, the heap, loop lag, the Redis link, embedded serving
    "app.limits",  # clock, retry, gates, budgets, admission, the CPU lane
    "app.db",  # pool, migrations, embedded PostgreSQL, taxonomy, characters
    "app.images",
    "app.upstream",  # calls to the model provider, their shapes, tokens, reply caches
    "app.settings",
    "app.stages",  # the stage contract, the scan's context, the stages
    "app.scans",  # running scans: pipeline, runner, events, store, mirror, drain
    "app.streaming",  # a scan's events as SSE, and reading scans back
    "app.intake",  # who asks, reading and parsing the request, acceptance
    "app.assembly",  # how each part is built: the upstream, the services, the gauges
    "app.resources",  # the lifespan: builds everything above, in order
    "app.http",  # routes, page, OpenAPI document, HTTP protocol
    "app.main",
]
# The simulator is a stand-in for the provider, not part of the service: it may use the
# runtime's embedded serving, and only the lifespan starts it (lazily, without a key).
SIMULATOR = "app.sim"
SIMULATOR_MAY_IMPORT = ("app.runtime",)
STARTS_SIMULATOR = "app.assembly.upstream"
# The lifespan and its assembly build every package's parts: they may import any module,
# in a package's face or not.
LIFESPAN = ("app.resources", "app.assembly")


def _module_name(path: Path) -> str:
    parts = path.relative_to(APP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("app."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "app":
                found.update(f"app.{alias.name}" for alias in node.names)
            elif node.module.startswith("app."):
                found.add(node.module)
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in APP.rglob("*.py")}


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _layer(module: str) -> int:
    for index, prefix in enumerate(LAYERS):
        if _within(module, prefix):
            return index
    raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS (and ARCHITECTURE.md)")


def test_every_package_imports_only_from_packages_below_it() -> None:
    wrong = []
    for module, imported in _graph().items():
        if module == "app" or _within(module, SIMULATOR):
            continue
        for target in imported:
            if _within(target, SIMULATOR):
                if module != STARTS_SIMULATOR:
                    wrong.append(f"{module} imports the simulator ({target})")
            elif _layer(target) > _layer(module):
                below, above = LAYERS[_layer(module)], LAYERS[_layer(target)]
                wrong.append(f"{module} ({below}) imports {target} ({above})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_the_simulator_stays_out_of_the_service() -> None:
    wrong = [
        f"{module} imports {target}"
        for module, imported in _graph().items()
        if _within(module, SIMULATOR)
        for target in imported
        if not _within(target, SIMULATOR) and not any(_within(target, p) for p in SIMULATOR_MAY_IMPORT)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def _face(package: Path) -> set[str] | None:
    """The modules a package's `__init__.py` lists in `__all__` (None: it shows no face)."""
    for node in ast.parse((package / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def test_other_packages_import_only_a_packages_face() -> None:
    """A package whose `__init__.py` has an `__all__` (its face, ARCHITECTURE.md's
    "Package faces") is imported by the other packages only through the modules it lists,
    and each of those is used by one. The lifespan, which builds everything, may import
    any module."""
    graph = _graph()
    faces = {_module_name(p.parent): face for p in APP.glob("*/__init__.py") if (face := _face(p.parent))}
    assert {"app.limits", "app.upstream"} <= set(faces)
    wrong = []
    for package, face in faces.items():
        used = set()
        for module, imported in graph.items():
            if _within(module, package) or any(_within(module, lifespan) for lifespan in LIFESPAN):
                continue
            for target in imported:
                if target.startswith(package + "."):
                    used.add(name := target.removeprefix(package + ".").split(".")[0])
                    if name not in face:
                        wrong.append(f"{module} imports {target}, not in {package}.__all__")
        wrong += [f"{package}.__all__ lists {name}, which no other package imports" for name in face - used]
    assert not wrong, "\n".join(sorted(wrong))


def test_the_check_sees_a_wrong_import(tmp_path: Path) -> None:
    """The checks above read real files: an upward import written to one is found."""
    sample = tmp_path / "sample.py"
    sample.write_text("from app.http.routes import router\nimport app.scans.pipeline\n")
    assert _imports(sample) == {"app.http.routes", "app.scans.pipeline"}
    assert _layer("app.http.routes") > _layer("app.limits.clock")
