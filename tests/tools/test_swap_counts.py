"""``tools/swap_counts.py`` on a few blocks: every phase of the swap is counted."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def swap_counts(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import swap_counts

    return swap_counts


def test_counts_every_phase_per_swapped_tensor(swap_counts: ModuleType) -> None:
    from swap_overhead import OverheadConfig

    result = swap_counts.count(OverheadConfig(blocks=4))
    assert result["swapped_tensors"] == 8  # each block's input and ReLU output
    assert result["calls"] > 0 and result["bytecodes"] > 0
    for phase in ("pack hook", "unpack hook (reloads included)", "backward begins (prefetch)"):
        assert result["bytecodes_by_phase"][phase] > 0
