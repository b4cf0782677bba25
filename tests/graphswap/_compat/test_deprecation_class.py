"""graphswap's deprecations have a class of their own, and this suite fails on them: a
user filters graphswap's apart from other libraries', and a test that calls a deprecated
name by accident fails instead of hiding the warning its users would see."""

from __future__ import annotations

import warnings

import pytest

from graphswap import _compat
from graphswap.errors import GraphswapDeprecationWarning

pytestmark = pytest.mark.compat


def test_an_old_path_warns_graphswaps_own_deprecation_at_the_callers_line() -> None:
    with pytest.warns(GraphswapDeprecationWarning) as caught:
        _compat.warn("old is deprecated: use new")
    [warning] = caught
    assert issubclass(warning.category, DeprecationWarning), "filters of the base still see it"
    assert str(warning.message) == "old is deprecated: use new (removed in 0.3)"
    assert warning.filename == __file__


def test_the_suite_fails_on_graphswaps_deprecations_but_not_on_other_libraries() -> None:
    """pyproject's filterwarnings: outside ``pytest.warns`` graphswap's deprecation is an
    error, another library's stays a warning."""
    with pytest.raises(GraphswapDeprecationWarning, match="use new"):
        _compat.warn("old is deprecated: use new")
    with warnings.catch_warnings(record=True) as caught:  # the suite's filters, recorded
        warnings.warn("a library's own deprecation", DeprecationWarning, stacklevel=1)
    assert [warning.category for warning in caught] == [DeprecationWarning]
