"""graphswap's modules import one another one way: no cycle, counting the imports made
only for the type checker (``if TYPE_CHECKING:``) and those inside functions.

A cycle means two modules that each need the other: state split between them (the
runtime's mixins, before its objects each owned their state), or an entry point
living in a module its callee imports back (``plan_memory`` beside ``plan_step``,
which the budget's choice imports)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import graphswap

PACKAGE = Path(graphswap.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    """Edges ``importer -> imported`` between modules of graphswap, from every import
    statement of its files, wherever it stands."""
    modules = {_module(path): path for path in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0]
                    base = f"{anchor}.{base}" if base else anchor
                # ``from pkg import mod`` imports the module ``pkg.mod`` when there is one.
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            graph.add_edges_from((name, t) for t in targets if t in modules and t != name)
    return graph


def test_modules_import_without_a_cycle() -> None:
    graph = import_graph()
    assert graph.has_edge("graphswap.runtime._forward", "graphswap.runtime._handles")
    assert graph.has_edge("graphswap.planning._registry", "graphswap.planning._budget")
    cycles = list(nx.simple_cycles(graph))
    assert cycles == [], f"import cycles among graphswap modules: {cycles}"


def test_the_graph_sees_type_checking_imports(tmp_path: Path, monkeypatch) -> None:
    """A cycle closed only under ``if TYPE_CHECKING:`` is found (the graph reads every
    import statement, not what runs)."""
    package = tmp_path / "graphswap"
    fake = package / "runtime"
    fake.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "_a.py").write_text("from graphswap.runtime._b import B\n")
    (fake / "_b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from graphswap.runtime._a import A\n"
    )
    monkeypatch.setattr(f"{__name__}.PACKAGE", package)
    cycles = list(nx.simple_cycles(import_graph()))
    assert cycles and set(cycles[0]) == {"graphswap.runtime._a", "graphswap.runtime._b"}
