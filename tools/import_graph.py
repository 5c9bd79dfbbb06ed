"""Import-graph figures of the `fedjax_sim` package (used by `tests/test_layers.py`).

    python tools/import_graph.py            # units, edges, cycles, function-local imports, lines

A *module* is one `.py` file; a *top-level unit* is a module or subpackage directly under
`fedjax_sim/`. Edges are internal imports at module level or inside functions; a cycle is a
strongly connected component of more than one module (at module or top-level-unit granularity).
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections.abc import Iterator

PACKAGE = "fedjax_sim"
ROOT = pathlib.Path(__file__).resolve().parents[1] / PACKAGE


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(path: pathlib.Path, name: str, known: set[str]) -> Iterator[tuple[str, bool, int]]:
    """(imported module, is_function_local, line) for each internal import in `path`."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    local: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local.update(id(n) for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith(PACKAGE + "."):
                yield t, id(node) in local, node.lineno


def graph() -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """Module-level edges {module: imported modules} and the function-local imports."""
    mods = modules()
    known = set(mods)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    local: list[tuple[str, str, int]] = []
    for name, path in mods.items():
        for target, is_local, line in _imports(path, name, known):
            edges[name].add(target)
            if is_local and (name, target, line) not in local:
                local.append((name, target, line))
    return edges, local


def unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def unit_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {unit(m): set() for m in edges if m != PACKAGE}
    for m, ts in edges.items():
        if m == PACKAGE:  # the package's public re-exports sit above every unit
            continue
        out[unit(m)].update(unit(t) for t in ts if unit(t) != unit(m) and t != PACKAGE)
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def figures() -> dict[str, int]:
    edges, local = graph()
    units = unit_graph(edges)
    algorithms = [p for n, p in modules().items() if n.startswith(f"{PACKAGE}.algorithms")]
    return {
        "modules": len(edges),
        "module_edges": sum(len(t) for t in edges.values()),
        "module_cycles": len(cycles(edges)),
        "top_level_units": len(units),
        "unit_edges": sum(len(t) for t in units.values()),
        "unit_cycles": len(cycles(units)),
        "function_local_imports": len(local),
        "package_lines": sum(len(p.read_text().splitlines()) for p in modules().values()),
        "algorithms_lines": sum(len(p.read_text().splitlines()) for p in algorithms),
    }


if __name__ == "__main__":
    for key, value in figures().items():
        print(f"{key:24s} {value}")
    edges, local = graph()
    for c in cycles(edges):
        print("module cycle:", " -> ".join(c))
    for c in cycles(unit_graph(edges)):
        print("unit cycle:", " -> ".join(c))
    if "-v" in sys.argv:
        for m, t, line in local:
            print(f"local import: {m}:{line} -> {t}")
