"""The package imports in one direction: no import cycle anywhere in ``depthrewrite/`` (issue #24, item 5).

Every import statement counts, at module level or inside a function (a function-level import that goes back up is
still a cycle, only a later one), except those under ``if TYPE_CHECKING:`` (never executed). An import of
``a.b.c`` is an edge to ``a.b.c`` only, not to the packages above it: a package's ``__init__`` re-exporting its
submodules is not a cycle with them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import depthrewrite

ROOT = Path(depthrewrite.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("depthrewrite",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` over the package's own modules."""
    mods = _modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else base)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t in mods and t != name:
                    graph[name].setdefault(t, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert len(graph) > 50  # the walk found the package
    found = cycles(graph)
    lines = []
    for comp in found:
        members = set(comp)
        lines.append(f"cycle of {len(comp)}: " + ", ".join(comp))
        lines += [f"    {m} (line {ln}) imports {t}" for m in comp for t, ln in graph[m].items() if t in members]
    assert not found, "\n".join(lines)


def test_the_transformers_cache_is_handled_in_one_place_beside_the_runtime():
    """Only capture (the cache as a pytree input of export) and runtime/caches (checks, write-back into the caller's
    cache, MSAR's decoding state in extra layers) touch transformers' cache classes."""
    users = sorted(name for name, path in _modules().items()
                   if "cache_utils" in path.read_text() or ".lazy_initialization(" in path.read_text())
    assert users == ["depthrewrite.capture", "depthrewrite.runtime.caches"], users
