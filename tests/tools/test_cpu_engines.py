"""``tools/cpu_engines.py`` on tiny shapes: both engines swap, and give the same gradients."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cpu_engines(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import cpu_engines

    return cpu_engines


def test_both_engines_swap_and_change_no_number(cpu_engines: ModuleType) -> None:
    result = cpu_engines.measure(layers=2, seq=512, batch=2, steps=2, warmup=1)
    assert result["swapped_tensors_per_step"] > 0
    assert set(result["median_step_s"]) == {"none", "noop", "sim"}
    assert set(result["us_per_swapped_tensor"]) == {"noop", "sim"}
    assert result["same_gradients"] is True
