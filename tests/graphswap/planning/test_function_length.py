"""The planner stays readable: no function or method in graphswap/planning is longer
than a screenful (issue 41: ``replay`` had grown to 234 lines of closures)."""

from __future__ import annotations

import ast
from pathlib import Path

import graphswap.planning

MAX_LINES = 100
PLANNING = Path(graphswap.planning.__file__).parent


def _functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [
        (f"{path.name}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None
    ]


def test_no_planning_function_is_longer_than_100_lines() -> None:
    found = [f for path in sorted(PLANNING.rglob("*.py")) for f in _functions(path)]
    assert len(found) > 50, f"walked {PLANNING} and found {len(found)} functions"
    too_long = [f"{name}: {lines} lines" for name, lines in found if lines > MAX_LINES]
    assert not too_long, f"split these below {MAX_LINES} lines: {too_long}"
