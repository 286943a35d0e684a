"""The package's import graph: no circles between modules nor between subpackages, and only the command reaches
into pyzipmoe.cli.

Read from the source (every import statement, those inside functions too), so that a circle that only shows when a
function runs is caught as well. The subpackages form layers, each importing only those below it: file, plan,
runtime, models, server, cli (docs/architecture.md, "The Python package").
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "pyzipmoe"
CLI_USERS = {"pyzipmoe.__main__"}  # `python -m pyzipmoe`


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The pyzipmoe modules `module` imports: a name imported from a module counts as that module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found = set()
    for t in targets:
        while t and t not in modules:
            t = t.rpartition(".")[0]
        if t and t != module:
            found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imported(m, p, modules) for m, p in modules.items()}


def subpackage_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """`graph` with the modules of each subpackage taken as one node (pyzipmoe.runtime.llama is pyzipmoe.runtime);
    modules directly under pyzipmoe stay nodes of their own."""
    def node(module: str) -> str:
        parts = module.split(".")
        subpackage = len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir())
        return ".".join(parts[:2]) if subpackage else module

    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(node(m), set()).update(node(d) for d in deps if node(d) != node(m))
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_checker_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_checker_finds_a_circle_between_subpackages() -> None:
    """Two subpackages that import each other through different modules: no module circle, a subpackage one."""
    graph = {"pyzipmoe.runtime.runner": {"pyzipmoe.models.package"}, "pyzipmoe.models.package": set(),
             "pyzipmoe.models.create": {"pyzipmoe.runtime.budget"}, "pyzipmoe.runtime.budget": {"pyzipmoe.errors"}}
    assert find_cycle(graph) is None
    assert subpackage_graph(graph) == {"pyzipmoe.runtime": {"pyzipmoe.models", "pyzipmoe.errors"},
                                       "pyzipmoe.models": {"pyzipmoe.runtime"}}
    assert find_cycle(subpackage_graph(graph)) == ["pyzipmoe.models", "pyzipmoe.runtime", "pyzipmoe.models"]


def test_no_import_circles() -> None:
    graph = import_graph()
    assert "pyzipmoe.runtime.llama" in graph and "pyzipmoe.cli" in graph  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_only_the_command_imports_cli() -> None:
    reaching = sorted(m for m, deps in import_graph().items()
                      if m != "pyzipmoe.cli" and not m.startswith("pyzipmoe.cli.") and m not in CLI_USERS
                      and any(d == "pyzipmoe.cli" or d.startswith("pyzipmoe.cli.") for d in deps))
    assert not reaching, f"modules outside pyzipmoe.cli that import it: {reaching}"


def test_no_import_circles_between_subpackages() -> None:
    graph = import_graph()
    layers = subpackage_graph(graph)
    assert {"pyzipmoe.plan", "pyzipmoe.runtime", "pyzipmoe.models"} <= layers.keys()  # modules were collapsed
    cycle = find_cycle(layers)
    if cycle:
        pairs = zip(cycle, cycle[1:])
        why = [f"{m} -> {d}" for a, b in pairs for m in sorted(graph) for d in sorted(graph[m])
               if m.startswith(a + ".") and d.startswith(b + ".")]
        raise AssertionError(f"import circle between subpackages: {' -> '.join(cycle)} ({'; '.join(why)})")
