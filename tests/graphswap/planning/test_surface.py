"""``graphswap.planning`` exports the few names a user of the planner calls, what they
return and what they raise (issue 31); the steps behind a plan are
``graphswap.planning.trace``'s. ``tests/test_docs.py`` checks that each has an API entry,
``tests/graphswap/_compat/test_old_paths.py`` that 0.1.0's ``graphswap.planner`` paths
still work."""

from __future__ import annotations

import types

import pytest

import graphswap.planning
import graphswap.planning.trace


def test_planning_exports_at_most_ten_names() -> None:
    assert len(graphswap.planning.__all__) <= 10, graphswap.planning.__all__


@pytest.mark.parametrize("module", [graphswap.planning, graphswap.planning.trace])
def test_every_exported_name_resolves(module: types.ModuleType) -> None:
    assert sorted(module.__all__) == sorted(set(module.__all__))
    namespace: dict[str, object] = {}
    exec(f"from {module.__name__} import *", namespace)
    assert set(module.__all__) <= set(namespace)
