"""moekit's modules import each other in one direction only: the import graph has no cycle.

Every ``import`` and ``from ... import`` in every module counts, at any depth (a function-level
import is still a dependency, only a later one), except those under ``if TYPE_CHECKING:``, which
never run. ``from moekit.a import b`` is an edge to
``moekit.a.b`` when that is a module, else to ``moekit.a``. A package's ``__init__`` is not
implied by importing one of its submodules (that would put every package that re-exports its
submodules in a cycle with them); imports built from strings (``importlib.import_module``) are
not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "moekit"


def module_name(path: Path, root: Path) -> str:
    """``moekit/kernels/count.py`` -> ``moekit.kernels.count``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that the module ``name`` imports anywhere in ``tree``."""
    found = set()
    here = name if is_package else name.rpartition(".")[0]  # what a relative import is relative to
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                   for n in ast.walk(node)}  # fmt: skip
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")  # fmt: skip


def import_graph(root: Path) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over every ``.py`` file under the package at ``root``."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(paths)
    return {
        name: imported_modules(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", known)
        for name, path in paths.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A shortest cycle through each module that is on one, as ``[a, b, ..., a]``, one per cycle found."""
    found, covered = [], set()
    for start in sorted(graph):
        if start in covered:
            continue
        path = _shortest_path_back(graph, start)
        if path:
            found.append(path)
            covered.update(path)
    return found


def _shortest_path_back(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest import path from ``start`` back to ``start`` (breadth first), or None."""
    came_from, frontier = {}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    return None


def test_the_graph_sees_moekit():
    graph = import_graph(PACKAGE)
    assert "moekit.modular_kernel" in graph and "moekit.kernels.count" in graph
    assert "moekit.errors" in graph["moekit.validate"]
    assert "moekit.experts.base" in graph["moekit.experts"]  # a package's own __init__ counts too


def test_no_import_cycles_in_moekit():
    found = sorted(tuple(c) for c in cycles(import_graph(PACKAGE)))
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


@pytest.fixture
def tiny(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg import a\n",
        "a.py": "import os\nfrom . import b\n",
        "b.py": "def late():\n    from pkg.sub.c import thing\n",  # a function-level import counts
        "sub/__init__.py": "",
        "sub/c.py": "from ..a import x\nthing = 1\n",  # relative, two levels up
        "d.py": "from pkg.sub import c\nfrom pkg import missing_name\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    return pkg


def test_graph_of_a_tiny_package(tiny):
    assert import_graph(tiny) == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.sub.c"},
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg.a"},
        "pkg.d": {"pkg.sub.c", "pkg"},
    }


def test_cycles_are_found_and_named(tiny):
    assert cycles(import_graph(tiny)) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    (tiny / "sub" / "c.py").write_text("thing = 1\n")
    assert cycles(import_graph(tiny)) == []
