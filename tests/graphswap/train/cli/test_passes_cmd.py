"""``graphswap passes``: renders a checked pass plan, or exits non-zero with the reason.
Its 0.1.0 name, ``graphswap plan``: ``tests/graphswap/_compat/test_old_cli.py``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from graphswap.train.cli import _passes

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "train.yaml"

CONSOLE_TEST = "test_console_script_runs_passes"
CONSOLE_ARGV = ["passes", "activation_swap=attention", "pp_size=2"]
"""The console-script run of this module (the ``console`` fixture)."""


def run_passes(argv: list[str], command: str = "passes") -> int:
    """The ``passes`` sub-command alone, so that it is tested apart from its siblings."""
    parser = argparse.ArgumentParser(prog="graphswap")
    _passes.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([command, *argv])
    return int(args.run(args))


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``passes argv`` says on stderr when it refuses: exit 2, nothing on stdout."""
    assert run_passes(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def test_text_pass_plan_of_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_passes(["--config", str(EXAMPLE)]) == 0
    assert capsys.readouterr().out == "pass plan: no passes (the config enables none)\n"


def test_overrides_reach_the_pass_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--config", str(EXAMPLE), "activation_swap=attention", "tp_size=2", "fsdp=true"]
    assert run_passes(argv) == 0
    out = capsys.readouterr().out
    assert out.index("1. swap") < out.index("2. tensor_parallel") < out.index("3. fsdp")
    assert "activation_swap: attention" in out and "swap -> tensor_parallel" in out


def test_the_swap_pass_names_the_budget_mode(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["activation_swap=budget", "activation_memory_budget=1GiB", "num_layers=1"]
    assert run_passes([*argv, "seq_len=64"]) == 0
    out = capsys.readouterr().out
    assert "activation_swap: budget" in out
    assert "or budget (per layer keep, swap or recompute within activation_memory_budget)" in out


def test_json_and_dot(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_passes(["--format", "json", "activation_swap=attention", "fsdp=true"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in data["passes"]] == ["swap", "fsdp"]
    assert run_passes(["--format", "dot", "activation_swap=attention", "fsdp=true"]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith("digraph pass_plan {") and '"swap" -> "fsdp";' in dot


def test_a_rejected_pass_plan_exits_with_the_code_its_help_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        run_passes(["--help"])
    assert "Exits 2 with the reason on stderr" in " ".join(capsys.readouterr().out.split())
    assert refusal(["activation_swap=attention", "compile=true"], capsys) == (
        "graphswap passes: error: activation_swap: attention excludes compile: true; set"
        " activation_swap: none or compile: false (swap (position 1) and compile (position 2)"
        " cannot run together)\n"
    )


def test_config_errors_exit_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "train.yaml"
    config.write_text("activation_swap: null\n")
    assert run_passes(["--config", str(config)]) == 2
    assert capsys.readouterr().err.startswith("graphswap passes: error: activation_swap: got null;")
    assert run_passes(["activation_swp=attention"]) == 2
    assert "did you mean 'activation_swap'" in capsys.readouterr().err


def test_order_is_checked_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    settings = ["activation_swap=attention", "tp_size=2", "fsdp=true"]
    assert run_passes(["--order", "swap,tensor_parallel,fsdp", "--format", "json", *settings]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in data["passes"]] == ["swap", "tensor_parallel", "fsdp"]
    assert refusal(["--order", "swap,fsdp,tensor_parallel", *settings], capsys) == (
        "graphswap passes: error: pass_order: tensor_parallel (position 3) must run before fsdp"
        " (position 2): move tensor_parallel ahead of fsdp (an order that runs: pass_order:"
        " [swap, tensor_parallel, fsdp]) or turn one off: set tp_size: 1 or fsdp: false\n"
    )


def test_order_overrides_the_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "train.yaml"
    config.write_text("activation_swap: attention\npass_order: [swap, fsdp]\n")
    assert run_passes(["--config", str(config)]) == 2
    assert capsys.readouterr().err.startswith(
        "graphswap passes: error: pass_order: fsdp (position 2) is in pass_order but fsdp: false"
    )
    assert run_passes(["--config", str(config), "--order", "swap"]) == 0
    assert "1. swap" in capsys.readouterr().out
    assert run_passes(["--config", str(config), "--order", "swap,swapp"]) == 2
    assert capsys.readouterr().err.startswith(
        "graphswap passes: error: pass_order: unknown pass 'swapp'; declared passes:"
        " pipeline_parallel,"
    )


def test_console_script_runs_passes(console: Any) -> None:
    """Through ``python -m graphswap.train.cli`` from another folder, as a user runs it: the
    installed ``passes`` package must be the regular package, not a namespace."""
    done = console.done()
    assert done.returncode == 2, done.stderr
    assert "activation_swap: attention excludes pp_size: 2" in done.stderr
