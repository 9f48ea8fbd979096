"""The core's modules import each other without cycles, and the contracts import no implementation.

Every ``import`` counts, including those inside functions and under ``if TYPE_CHECKING:``: a lazy
import that breaks a cycle at import time, or one that only annotations need, is still two modules
that need each other (#29). The one exception: the contracts may name ``Batch`` for annotations.
"""

from __future__ import annotations

import ast
from pathlib import Path

import verl_core

PACKAGE = Path(verl_core.__file__).parent


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (``testing/`` left out)."""
    modules = {_module_name(p, package): p for p in package.rglob("*.py") if "testing" not in p.relative_to(package).parts}
    root = package.name
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        is_package = path.name == "__init__.py"

        class Visitor(ast.NodeVisitor):
            def visit_Import(self, node: ast.Import) -> None:
                found.update(a.name for a in node.names)

            def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
                if node.level:
                    base = name.split(".")
                    base = base[: len(base) - node.level + (1 if is_package else 0)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import module`

        Visitor().visit(ast.parse(path.read_text()))
        graph[name] = {m for m in found if m in modules and m != name and m.startswith(root)}
    # Importing `verl_core.x.y` runs `verl_core.x` first; the one package __init__ that imports its
    # modules, verl_core.contracts, imports only contracts, so edges to packages are what they say.
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycles_in_core():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle among verl_core modules: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_lazy_import_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    graph = import_graph(pkg)
    assert graph["pkg.c"] == {"pkg", "pkg.a"}  # annotations need it too
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_contracts_import_no_implementation():
    """The contracts (``verl_core.contracts`` and its modules) import no other core module (Batch only for
    annotations)."""
    graph = import_graph()
    contracts = {m for m in graph if m == "verl_core.contracts" or m.startswith("verl_core.contracts.")}
    assert len(contracts) > 1, "the contracts package has no modules"
    for module in sorted(contracts):
        assert graph[module] <= contracts | {"verl_core.batch"}, (module, graph[module] - contracts)