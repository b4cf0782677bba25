"""The tools are graphswap's first users: they import public names only, so what they
measure is reachable by anyone, and a private module can change without breaking them."""

from __future__ import annotations

import ast
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def private_imports(path: Path) -> list[str]:
    """``from graphswap.x._y import z``, ``import graphswap.x._y``, ``from graphswap.x
    import _z``: each import of graphswap's that names a ``_``-prefixed module or name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [
            f"{path.name}:{node.lineno}: {name}"
            for name in names
            if name.split(".")[0] == "graphswap"
            and any(part.startswith("_") for part in name.split("."))
        ]
    return found


def test_no_tool_imports_a_private_module_or_name() -> None:
    scripts = sorted(TOOLS.glob("*.py"))
    assert len(scripts) >= 5
    found = [line for script in scripts for line in private_imports(script)]
    assert found == [], "import these from a public module (its __all__):\n" + "\n".join(found)
