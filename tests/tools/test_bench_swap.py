"""``tools/bench_swap.py`` on tiny CPU shapes: every mode, identical numbers, results on disk.

The script runs in this process, through its ``main``: a process of its own would spend
most of the test importing torch and transformers again. CI's ``make device-dry-run``
runs it as the GPU check does, as a script.
"""

from __future__ import annotations

import gc
import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


@pytest.fixture
def bench_swap(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import bench_swap

    return bench_swap


@pytest.fixture
def run_bench(
    bench_swap: ModuleType, capsys: pytest.CaptureFixture[str]
) -> Iterator[Callable[..., subprocess.CompletedProcess[str]]]:
    """``run_bench(*argv)``: ``bench_swap.py --device cpu ARGV``; the process-wide
    settings a run makes (threads, deterministic kernels, a frozen collector) are
    restored after the test."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        code = bench_swap.main(["--device", "cpu", *argv])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(argv), code, out, err)

    try:
        yield run
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def test_bench_writes_every_mode_with_identical_numbers(
    run_bench: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    done = run_bench(
        "--out-dir", str(tmp_path), "--attn", "eager", "--seq", "256", "--layers", "3",
        "--steps", "1", "--warmup", "0", "--share-seq", "256", "--share-kernels", "eager", "math",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # One current result per benchmark and device: no date in the name, the date inside.
    [result_file] = tmp_path.glob("*.json")
    assert result_file.name == "bench-swap-cpu.json"
    assert result_file.with_suffix(".md").is_file()
    assert not list(tmp_path.glob("*.partial"))
    result = json.loads(result_file.read_text())
    assert {"started_utc", "load_average"} <= set(result["environment"])
    [run] = result["runs"]
    modes = run["modes"]
    assert list(modes) == ["none", "attention", "layer", "auto", "budget", "save_on_cpu"]
    for name, mode in modes.items():
        assert len(mode["step_times_s"]) == 1
        counters = mode["verify"]["counters"]
        assert counters["reloaded_bytes"] == counters["offloaded_bytes"]
        assert (counters["recomputed_bytes"] > 0) == (name == "budget")
    targets = {target["name"]: target for target in run["targets"]}
    assert targets["numbers_unchanged"]["met"] is True
    assert targets["step_time_ratio"]["met"] is None  # its target is for CUDA at seq 8192
    for name in targets:
        assert f"TARGET {name}: " in done.stdout
    # Eager attention: the planner is exact, so what leaves the device is what it predicts.
    offloaded = modes["attention"]["verify"]["counters"]["offloaded_bytes"]
    assert offloaded == run["plan"]["swapped_bytes"]
    assert modes["attention"]["resident_saved_bytes"] < modes["none"]["resident_saved_bytes"]
    assert 0 < run["attention_share"] < 1
    # auto at the default link model hides everything layer swap moves, and moves exactly
    # what it planned.
    assert run["auto_plan"]["matches_plan"] is True
    assert (
        modes["auto"]["verify"]["counters"]["offloaded_bytes"] == run["auto_plan"]["swapped_bytes"]
    )
    # budget plans within 0.7 of the bench step's predicted peak without swap, which the
    # planner meets here, and recomputes and swaps exactly what it planned, bit for bit.
    budget = run["budget_plan"]
    assert budget["budget_bytes"] == int(0.7 * budget["peak_without_swap_bytes"])
    assert "note" not in budget and budget["recompute"]
    assert budget["predicted_peak_bytes"] <= budget["budget_bytes"]
    assert budget["matches_plan"] is True and budget["gradients_as_none"] is True
    assert budget["measured_recomputed_bytes"] == budget["recomputed_bytes"] > 0
    assert targets["budget_plan"]["met"] is True
    # The planner's prediction of the bench's step (no optimizer) beside every planned mode.
    for name in ("none", "attention", "layer", "auto", "budget"):
        prediction = modes[name]["prediction"]
        assert set(prediction) >= {
            "step_ratio", "peak_bytes", "peak_without_swap_bytes", "drop_bytes", "peak_label"
        }  # fmt: skip
        assert prediction["drop_bytes"] == (
            prediction["peak_without_swap_bytes"] - prediction["peak_bytes"]
        )
        assert prediction["peak_label"] != "optimizer"
        assert modes[name]["measured_peak"] is None  # CPU: no allocator peak to place
    assert modes["none"]["prediction"]["drop_bytes"] == 0
    assert modes["budget"]["prediction"]["peak_bytes"] == budget["predicted_peak_bytes"]
    assert (
        modes["budget"]["prediction"]["peak_without_swap_bytes"]
        == (budget["peak_without_swap_bytes"])
    )
    assert modes["attention"]["prediction"]["drop_bytes"] > 0
    assert modes["save_on_cpu"]["prediction"] is None
    assert "TARGET prediction: n/a (none: step x" in done.stdout
    assert "peak label pred / meas" in result_file.with_suffix(".md").read_text()
    shares = {row["kernel"]: row for row in result["kernel_shares"]}
    assert set(shares) == {"eager", "math"}
    for row in shares.values():
        assert row["seq"] == 256 and 0 < row["share"] < 1


def test_budget_no_plan_meets_runs_within_the_smallest_peak(
    run_bench: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    done = run_bench(
        "--out-dir", str(tmp_path), "--attn", "eager", "--seq", "256", "--layers", "3",
        "--steps", "1", "--warmup", "0", "--share-kernels", "--modes", "none", "budget",
        "--budget-fraction", "0.05",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result_file = tmp_path / "bench-swap-cpu.json"
    [run] = json.loads(result_file.read_text())["runs"]
    budget = run["budget_plan"]
    assert budget["asked_budget_bytes"] < budget["budget_bytes"]
    assert budget["budget_bytes"] == budget["predicted_peak_bytes"]
    assert "no plan meets 0.05" in budget["note"]
    assert budget["matches_plan"] is True and budget["gradients_as_none"] is True
    assert "TARGET budget_plan: met (budget " in done.stdout
    assert "the smallest peak any plan reaches" in done.stdout


def test_overhead_reports_microseconds_per_swapped_tensor(
    run_bench: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    done = run_bench(
        "--overhead", "--out-dir", str(tmp_path), "--blocks", "4", "--steps", "3", "--warmup", "1"
    )
    assert done.returncode == 0, done.stderr
    [result_file] = tmp_path.glob("*.json")
    assert result_file.name == "swap-overhead-cpu.json"
    result = json.loads(result_file.read_text())
    assert result["date"] in result_file.with_suffix(".md").read_text()
    per_step = result["per_step"]
    # One step's: every block's input and ReLU output; parameters are never swapped.
    assert per_step["offloaded_tensors"] == 2 * 4
    assert per_step["reloaded_bytes"] == per_step["offloaded_bytes"]
    assert {len(steps) for steps in result["step_times_s"].values()} == {3}
    # graphswap over the no-op device (judged) and over the simulated one, beside the rest.
    modes = ["none", "bare_copy", "save_on_cpu", "noop", "sim", "keep"]
    assert list(result["step_times_s"]) == modes
    # The first step of each timed turn, after the other modes' steps, apart.
    assert list(result["median_first_step_s"]) == modes
    assert "first step of a turn ms |" in done.stdout
    assert result["engine"] == "noop"
    for mode in ("", "bare_copy_", "save_on_cpu_", "bookkeeping_"):
        assert isinstance(result[f"{mode}us_per_swapped_tensor"], float)
    assert list(result["us_per_swapped_tensor_by_mode"]) == modes[1:]
    assert list(result["us_per_module_by_mode"]) == modes[1:]
    assert list(result["bookkeeping_us_per_swapped_tensor_by_engine"]) == ["noop", "sim"]
    assert isinstance(result["us_per_wrapped_forward"], float)
    assert isinstance(result["us_per_swapped_tensor_beyond_wrapping"], float)
    assert "| sim above bare_copy |" in done.stdout
    assert "TARGET host_overhead_per_swapped_tensor: " in done.stdout
    assert "TARGET host_bookkeeping_per_swapped_tensor: " in done.stdout
    calls = result["accelerator_calls"]
    assert calls["swapped_tensors"] == per_step["offloaded_tensors"]
    assert set(calls["per_swapped_tensor"]) == {"offload", "reload", "boundary"}
    assert calls["by_kind"]["copy/offload"] == calls["by_kind"]["copy/reload"]
    assert "TARGET accelerator_calls_per_swapped_tensor: " in done.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--share-kernels", "flashy"], "--share-kernels: unknown flashy"),
        (["--layers", "0"], "--layers must be >= 1, got 0"),
    ],
)
def test_bad_arguments_name_the_flag(
    argv: list[str],
    message: str,
    bench_swap: ModuleType,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        bench_swap.main(["--device", "cpu", *argv])
    assert done.value.code == 2
    assert message in capsys.readouterr().err


def test_the_peak_goes_to_the_label_that_raised_it_last(
    bench_swap: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``PeakByLabel`` under ``step_labels`` on CPU, the allocator's running peak faked:
    each layer's forward raises it by its index + 1 MiB, backward of layer 1 by 10 MiB."""
    from graphswap.runtime.timeline import step_labels

    peak = [0]
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak[0])
    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda *_, i=i: peak.__setitem__(0, peak[0] + (i + 1) * MIB))
    recorder = bench_swap.PeakByLabel(torch.device("cpu"))
    with step_labels(layers, recorder):  # type: ignore[arg-type]
        x = torch.ones(1, 4, requires_grad=True)
        for layer in layers:
            x = layer(x)
        x.register_hook(lambda g: None)
        layers[1].weight.register_hook(lambda g: peak.__setitem__(0, peak[0] + 10 * MIB))
        x.sum().backward()
        recorder.close()
    assert recorder.rises == {"F0": MIB, "F1": 2 * MIB, "F2": 3 * MIB, "B1": 10 * MIB}
    assert recorder.peak_label == "B1"
