"""``graphswap train``: in process through the entry point, and one run of the console
script in a subprocess."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from graphswap.hf.checkpoints import build_model

CONSOLE_TEST = "test_console_script_trains_the_embedded_default"
CONSOLE_ARGV = ["train", "--no-progress", "steps=2", "num_layers=2", "output_dir=."]
"""The console-script run of this module (the ``console`` fixture)."""


@pytest.fixture
def run_cli(graphswap_cmd: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: str, cwd: Path) -> Any:
        return graphswap_cmd("train", "--no-progress", *args, cwd=cwd)

    return run


def test_train_compare_prints_both_rows_with_equal_losses(tmp_path: Path, run_cli) -> None:
    done = run_cli("--compare", "steps=2", "num_layers=2", f"output_dir={tmp_path}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    first = next(line for line in done.stdout.splitlines() if line.startswith("loss first"))
    values = first.split()[2:]
    assert len(values) == 2 and values[0] == values[1]


def test_train_builds_each_runs_pass_plan_once(
    tmp_path: Path, run_cli, plans_built: list[Any]
) -> None:
    """The preflight, the build and the passes share one plan per config (three before)."""
    done = run_cli(
        "--compare", "steps=1", "num_layers=1", "seq_len=64", f"output_dir={tmp_path}", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert [plan.config.activation_swap for plan in plans_built] == ["none", "attention"]


def test_train_rejects_bad_setting_with_key_in_message(tmp_path: Path, run_cli) -> None:
    done = run_cli("activation_swap=all", cwd=tmp_path)
    assert done.returncode == 2
    assert "activation_swap" in done.stderr and "attention" in done.stderr


def test_train_rejects_swap_with_compile(tmp_path: Path, run_cli) -> None:
    done = run_cli("compile=true", cwd=tmp_path)
    assert done.returncode == 2
    assert "compile" in done.stderr and "activation_swap" in done.stderr


def test_train_auto_prints_the_plan_and_swaps_what_it_planned(tmp_path: Path, run_cli) -> None:
    done = run_cli(
        "activation_swap=auto",
        "swap_bandwidth_gbps=2",
        "swap_tflops=1",
        "steps=2",
        "num_layers=3",
        f"output_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "activation_swap: auto, planned for seq_len: 512, batch_size: 2" in out
    # Two layers' sources held to the fence cost less than they free: the plan chose lag 2.
    assert "swap_offload_lag=2 (chosen)" in out
    assert "auto swaps 3.00 MiB of the 12.00 MiB that layer swap would move" in out
    planned = next(line for line in out.splitlines() if line.startswith("auto plan / step"))
    offloaded = next(line for line in out.splitlines() if line.startswith("swap offloaded"))
    assert planned.split()[-2:] == offloaded.split()[-2:] == ["3.0", "MiB"]
    [result] = json.loads((tmp_path / "summary.json").read_text())
    assert result["auto_swap"]["mismatched_tensors"] == 0


def test_train_compare_pairs_none_with_the_configured_mode(tmp_path: Path, run_cli) -> None:
    done = run_cli(
        "--compare",
        "activation_swap=layer",
        "steps=1",
        "num_layers=2",
        f"output_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    modes = next(line for line in done.stdout.splitlines() if line.startswith("activation_swap"))
    assert modes.split()[1:] == ["none", "layer"]


def test_train_compare_runs_the_budget_mode_beside_none_without_the_budget(
    tmp_path: Path, run_cli
) -> None:
    """The budget stays with the budget column: none refuses one."""
    done = run_cli(
        "--compare",
        "activation_swap=budget",
        "activation_memory_budget=9MiB",
        "steps=2",
        "num_layers=2",
        "seq_len=64",
        f"output_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    modes = next(line for line in lines if line.startswith("activation_swap "))
    assert modes.split()[1:] == ["none", "budget"]
    assert "activation_swap: budget, planned for seq_len: 64" in done.stdout
    assert any(line.startswith("budget plan / step") for line in lines)
    last = next(line for line in lines if line.startswith("loss last")).split()[2:]
    assert len(last) == 2 and last[0] == last[1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary[0]["losses"] == summary[1]["losses"]


def test_train_refuses_measure_on_cpu_before_building(tmp_path: Path, run_cli) -> None:
    done = run_cli(
        "activation_swap=auto", "swap_bandwidth_gbps=measure", "device=cpu", cwd=tmp_path
    )
    assert done.returncode == 2
    assert done.stderr.startswith("graphswap train: error: swap_bandwidth_gbps: measure times")
    assert "Traceback" not in done.stderr


def test_train_runs_a_pass_order_and_compare_leaves_swap_out_of_none(
    tmp_path: Path, run_cli
) -> None:
    out = tmp_path / "out"
    done = run_cli(
        "--compare",
        "pass_order=[swap]",
        "steps=1",
        "num_layers=2",
        "seq_len=64",
        f"output_dir={out}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [run["applied_passes"] for run in summary] == [[], ["swap"]]


def test_train_refuses_a_wrong_pass_order_before_anything_runs(tmp_path: Path, run_cli) -> None:
    out = tmp_path / "out"
    done = run_cli("fsdp=true", "pass_order=fsdp,swap", f"output_dir={out}", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == (
        "graphswap train: error: pass_order: swap (position 2) must run before fsdp (position 1):"
        " move swap ahead of fsdp (an order that runs: pass_order: [swap, fsdp]) or turn one"
        " off: set activation_swap: none or fsdp: false\n"
    )
    assert not out.exists(), "the output folder is made only after the plan is accepted"


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mixtral"])
def test_train_a_dense_and_a_moe_family_from_a_checkpoint_folder(
    tmp_path: Path, preset: str, family_config, run_cli
) -> None:
    """The family is the one the folder's config.json names; layer swap (eager, whose
    probabilities pass the 1 MiB threshold at seq 256) changes no loss and moves bytes."""
    folder = tmp_path / "checkpoint"
    build_model(family_config(preset, "eager")).save_pretrained(folder)
    done = run_cli(
        "--compare", f"model_path={folder}", "activation_swap=layer",
        "attn_implementation=eager", "seq_len=256", "steps=2", f"output_dir={tmp_path}",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first = next(line for line in done.stdout.splitlines() if line.startswith("loss first"))
    assert len(set(first.split()[2:])) == 1
    swapped = json.loads((tmp_path / "summary.json").read_text())[1]
    assert swapped["swap"]["offloaded_bytes"] == swapped["swap"]["reloaded_bytes"] > 0
    assert swapped["swap"]["prefetch_misses"] == 0


def test_two_ranks_without_a_distributed_pass_are_refused_before_they_meet(
    tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun, each rank refuses before it joins a process group: no rank waits
    for a rendezvous that a refused run would never finish."""
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "2")
    done = run_cli("steps=1", f"output_dir={tmp_path}", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith(
        "graphswap train: error: tp_size: 1 and fsdp: false on a world of 2 ranks"
    )
    assert "set fsdp: true" in done.stderr and "Traceback" not in done.stderr
    assert not dist.is_initialized()


def test_console_script_trains_the_embedded_default(console: Any) -> None:
    done = console.done()
    assert done.returncode == 0, done.stderr
    assert "activation_swap" in done.stdout and "attention" in done.stdout
    summary = json.loads((console.cwd / "summary.json").read_text())
    assert summary[0]["swap"]["offloaded_bytes"] > 0


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-mistral"])
def test_train_auto_on_a_dense_family(preset: str, tmp_path: Path, run_cli) -> None:
    """A model without experts: transformers' experts_implementation: eager, which it
    records on every model, is no reason to refuse auto."""
    done = run_cli(
        f"model={preset}", "activation_swap=auto", "seq_len=64", "steps=2",
        f"output_dir={tmp_path}", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "activation_swap: auto, planned for seq_len: 64" in done.stdout


def test_train_a_family_whose_attention_is_not_self_attn(
    tmp_path: Path, tour_config, run_cli
) -> None:
    """GPT-NeoX holds its attention as ``attention``: attention swap wraps it there,
    moves its probabilities (eager, above 1 MiB at seq 256) and changes no loss."""
    folder = tmp_path / "checkpoint"
    build_model(tour_config("gpt_neox")).save_pretrained(folder)
    done = run_cli(
        "--compare", f"model_path={folder}", "activation_swap=attention",
        "attn_implementation=eager", "seq_len=256", "steps=2", f"output_dir={tmp_path}",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    swapped = json.loads((tmp_path / "summary.json").read_text())[1]
    assert swapped["swap"]["offloaded_bytes"] == swapped["swap"]["reloaded_bytes"] > 0
