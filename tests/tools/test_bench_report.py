"""The benchmark's verdicts: what ``tools/device_check.sh`` summarises as met / missed / n/a."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
MIB = 1 << 20


@pytest.fixture
def report(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(TOOLS))
    return importlib.import_module("bench_report")


def mode(median_s: float, peak: int, *, loss: float = 1.0, copied: int = MIB) -> dict[str, Any]:
    return {
        "verify": {"loss": loss, "grad_digest": "g", "counters": {"offloaded_bytes": copied}},
        "losses": [loss],
        "summary": {"median_step_s": median_s},
        "peak_allocated_bytes": [peak],
        "resident_saved_bytes": peak,
    }


def run(seq: int = 8192, **modes: dict[str, Any]) -> dict[str, Any]:
    return {
        "seq": seq,
        "modes": modes,
        "none_reproducible": True,
        "plan": {"swapped_bytes": 100 * MIB},
    }


def verdicts(report: ModuleType, measured: dict[str, Any], device: str = "cuda") -> dict:
    return {t.name: t.met for t in report.targets(measured, device=device, attn="sdpa")}


def test_all_targets_met_on_cuda(report: ModuleType) -> None:
    measured = run(
        none=mode(1.000, 1000 * MIB),
        attention=mode(1.010, 900 * MIB),
        save_on_cpu=mode(1.200, 900 * MIB),
    )
    assert verdicts(report, measured) == {
        "numbers_unchanged": True,
        "peak_reduction": True,
        "step_time_ratio": True,
        "overhead_vs_save_on_cpu": True,
    }


def test_each_target_misses_just_past_its_bound(report: ModuleType) -> None:
    measured = run(
        none=mode(1.000, 1000 * MIB),
        attention=mode(1.021, 902 * MIB, loss=1.5),
        save_on_cpu=mode(1.200, 900 * MIB),
    )
    assert verdicts(report, measured) == {
        "numbers_unchanged": False,
        "peak_reduction": False,  # 98 MiB of the 100 MiB the planner says leave: < 99%
        "step_time_ratio": False,
        "overhead_vs_save_on_cpu": False,  # 21 ms against 200 ms: above one tenth
    }


def test_off_target_runs_are_not_judged(report: ModuleType) -> None:
    measured = run(
        seq=4096,
        none=mode(1.0, 1000 * MIB),
        attention=mode(1.5, 900 * MIB),
        save_on_cpu=mode(1.2, 900 * MIB, copied=0),
    )
    found = verdicts(report, measured)
    assert found["step_time_ratio"] is None  # the 1.02 target is for seq 8192
    assert found["overhead_vs_save_on_cpu"] is None  # save_on_cpu copied nothing (on a CPU)

    measured["none_reproducible"] = False
    measured["plan"]["swapped_bytes"] = 0
    found = verdicts(report, measured)
    assert found["numbers_unchanged"] is None  # without swap two runs already differ
    assert found["peak_reduction"] is None  # the planner says nothing leaves the device
