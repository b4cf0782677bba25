"""``tools/bench_swap.py`` on the tiny CPU shape: every mode, one JSON, identical losses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_writes_all_modes_with_identical_losses(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench_swap.py"),
            "--device",
            "cpu",
            "--out-dir",
            str(tmp_path),
            "--seq",
            "256",
            "--layers",
            "3",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--whole-layer",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    [result_file] = tmp_path.glob("cpu-*.json")
    assert result_file.with_suffix(".md").is_file()
    result = json.loads(result_file.read_text())
    [run] = result["runs"]
    assert set(run["modes"]) == {"none", "graphswap", "save_on_cpu", "graphswap_layer"}
    assert run["losses_identical"] and run["gradients_identical"]
    assert run["checks"]["plan_vs_measured_no_swap"]["holds"]
    modes = run["modes"]
    assert modes["graphswap"]["resident_saved_bytes"] < modes["none"]["resident_saved_bytes"]
    assert modes["graphswap"]["bytes_offloaded"] == run["plan"]["swapped_bytes"]
    assert run["ratios_vs_none"]["none"]["median_step"] == 1.0


def test_bench_auto_on_a_fast_link_swaps_what_layer_swaps(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench_swap.py"),
            "--device",
            "cpu",
            "--out-dir",
            str(tmp_path),
            "--seq",
            "256",
            "--layers",
            "2",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--modes",
            "none",
            "graphswap_layer",
            "graphswap_auto",
            "--swap-bandwidth",
            "1e9",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    [run] = json.loads(next(tmp_path.glob("cpu-*.json")).read_text())["runs"]
    assert run["losses_identical"] and run["gradients_identical"]
    modes = run["modes"]
    assert modes["graphswap_auto"]["bytes_offloaded"] == modes["graphswap_layer"]["bytes_offloaded"]
    assert modes["graphswap_auto"]["bytes_offloaded"] > 0
    assert run["checks"]["auto_offloaded_vs_plan"]["holds"]
