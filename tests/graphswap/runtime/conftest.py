"""The runtime's tests run on one thread."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every runtime test on one thread: its tensors are too small for more, and on a
    loaded machine two threads make their steps several times slower."""
