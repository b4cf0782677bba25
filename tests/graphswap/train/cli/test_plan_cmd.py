"""``graphswap plan``: renders a checked plan, or exits non-zero with the reason."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from graphswap.train.cli import _plan

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "train.yaml"

CONSOLE_TEST = "test_console_script_runs_plan"
CONSOLE_ARGV = ["plan", "activation_swap=attention", "pp_size=2"]
"""The console-script run of this module (the ``console`` fixture)."""


def run_plan(argv: list[str]) -> int:
    """The ``plan`` sub-command alone, so that it is tested apart from its siblings."""
    parser = argparse.ArgumentParser(prog="graphswap")
    _plan.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    return int(args.run(args))


def test_text_plan_of_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan(["--config", str(EXAMPLE)]) == 0
    assert "no passes" in capsys.readouterr().out


def test_overrides_reach_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--config", str(EXAMPLE), "activation_swap=attention", "tp_size=2", "fsdp=true"]
    assert run_plan(argv) == 0
    out = capsys.readouterr().out
    assert out.index("1. swap") < out.index("2. tensor_parallel") < out.index("3. fsdp")
    assert "activation_swap: attention" in out and "swap -> tensor_parallel" in out


def test_json_and_dot(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan(["--format", "json", "activation_swap=attention", "fsdp=true"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in data["passes"]] == ["swap", "fsdp"]
    assert run_plan(["--format", "dot", "activation_swap=attention", "fsdp=true"]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith("digraph pass_plan {") and '"swap" -> "fsdp";' in dot


def test_rejected_plan_exits_with_the_code_its_help_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        run_plan(["--help"])
    assert "Exits 2 with the reason on stderr" in " ".join(capsys.readouterr().out.split())
    assert run_plan(["activation_swap=attention", "compile=true"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "graphswap plan: error: activation_swap: attention excludes compile: true; set"
        " activation_swap: none or compile: false (swap (position 1) and compile (position 2)"
        " cannot run together)\n"
    )


def test_config_errors_exit_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "train.yaml"
    config.write_text("activation_swap: null\n")
    assert run_plan(["--config", str(config)]) == 2
    assert capsys.readouterr().err.startswith("graphswap plan: error: activation_swap: got null;")
    assert run_plan(["activation_swp=attention"]) == 2
    assert "did you mean 'activation_swap'" in capsys.readouterr().err


def test_order_is_checked_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    settings = ["activation_swap=attention", "tp_size=2", "fsdp=true"]
    assert run_plan(["--order", "swap,tensor_parallel,fsdp", "--format", "json", *settings]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in data["passes"]] == ["swap", "tensor_parallel", "fsdp"]
    assert run_plan(["--order", "swap,fsdp,tensor_parallel", *settings]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "graphswap plan: error: pass_order: tensor_parallel (position 3) must run before fsdp"
        " (position 2): move tensor_parallel ahead of fsdp (an order that runs: pass_order:"
        " [swap, tensor_parallel, fsdp]) or turn one off: set tp_size: 1 or fsdp: false\n"
    )


def test_order_overrides_the_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "train.yaml"
    config.write_text("activation_swap: attention\npass_order: [swap, fsdp]\n")
    assert run_plan(["--config", str(config)]) == 2
    assert capsys.readouterr().err.startswith(
        "graphswap plan: error: pass_order: fsdp (position 2) is in pass_order but fsdp: false"
    )
    assert run_plan(["--config", str(config), "--order", "swap"]) == 0
    assert "1. swap" in capsys.readouterr().out
    assert run_plan(["--config", str(config), "--order", "swap,swapp"]) == 2
    assert capsys.readouterr().err.startswith(
        "graphswap plan: error: pass_order: unknown pass 'swapp'; declared passes:"
        " pipeline_parallel,"
    )


def test_console_script_runs_plan(console: Any) -> None:
    """Through ``python -m graphswap.train.cli`` from another folder, as a user runs it: the
    installed ``passes`` package must be the regular package, not a namespace."""
    done = console.done()
    assert done.returncode == 2, done.stderr
    assert "activation_swap: attention excludes pp_size: 2" in done.stderr
