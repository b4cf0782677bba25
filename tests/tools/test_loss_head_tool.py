"""``tools/loss_head.py`` on a small step: the chunked head's peak, measured on the
clocked simulated device, is the planner's prediction, and below the full head's."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def loss_head(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import loss_head

    return loss_head


def test_the_chunked_heads_peak_is_measured_below_the_full_heads_and_as_predicted(
    loss_head: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--seq", "1024", "--vocab", "8192", "--chunk", "256", "--out-dir", str(tmp_path)]
    assert loss_head.main(argv) == 0
    result = json.loads((tmp_path / "loss-head-cpu.json").read_text())
    assert [row["loss_head"] for row in result["heads"]] == ["full", "chunked"]
    for row in result["heads"]:
        assert abs(row["relative_error"]) <= 0.05, row
    assert result["measured_peak_ratio"] < 0.8
    assert "| chunked |" in (tmp_path / "loss-head-cpu.md").read_text()
    assert "chunked / full peak" in capsys.readouterr().out
