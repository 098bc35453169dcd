"""The graph of imports among schedc's own modules, and its cycles (strongly connected components).

    python tests/import_graph.py     # prints each cycle, or 'no cycles'

Read from the source with `ast`, nothing is imported. grammar/, solvers/ and
codegen/ count as the `schedc.grammar`, `schedc.solvers` and `schedc.codegen`
packages they install as. Every import statement counts wherever it stands:
at module level, inside a function (a lazy import is still a dependency, it
only runs later) and under `if TYPE_CHECKING:`. An import names one module: `from
schedc.x import y` is an edge to `schedc.x.y` when that is a module, else to
`schedc.x`; the packages above the named module are not edges (every module
would otherwise sit in one cycle with `schedc/__init__.py`).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Folder -> the package it installs as (pyproject.toml's package-dir).
PACKAGE_DIRS = {"schedc": "schedc", "grammar": "schedc.grammar", "solvers": "schedc.solvers",
                "codegen": "schedc.codegen"}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of schedc by its dotted name (a package by its __init__.py)."""
    out: dict[str, Path] = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The deepest module of `known` that `name` (dotted) starts with."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        candidate = ".".join(parts[:k])
        if candidate in known:
            return candidate
    return None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `module` imports anywhere in its source."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(_resolve(alias.name, known))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                out.add(sub if sub in known else _resolve(source, known))
    out.discard(None)
    out.discard(module)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted, in
    order of their first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def cycle_edges(graph: dict[str, set[str]], component: list[str]) -> list[tuple[str, str]]:
    """The imports inside one component (what to cut to break it)."""
    members = set(component)
    return sorted((a, b) for a in component for b in graph[a] if b in members)


def main() -> int:
    graph = import_graph()
    found = cycles(graph)
    if not found:
        print("no cycles")
        return 0
    for component in found:
        print(f"cycle of {len(component)} modules: " + ", ".join(component))
        for a, b in cycle_edges(graph, component):
            print(f"    {a} -> {b}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
