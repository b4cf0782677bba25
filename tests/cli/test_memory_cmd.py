"""``graphswap plan-memory``: the console command end to end, and its plot option."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from graphswap.cli import _memory


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "graphswap.cli", "plan-memory", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_json_output_parses_and_counts_every_layer() -> None:
    done = _run(
        "--preset", "tiny", "--seq", "256", "--batch", "2", "--layers", "3", "--format", "json"
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert [layer["name"] for layer in plan["layers"]] == [f"model.layers.{i}" for i in range(3)]
    assert plan["peak_with_swap_bytes"] < plan["peak_without_swap_bytes"]
    assert plan["bandwidth_gbps"] == 50.0 and plan["dtype"] == "bfloat16"


def test_text_output_from_a_checkpoint_folder(tmp_path: Path) -> None:
    from graphswap.presets import qwen3_moe_config

    qwen3_moe_config("tiny").save_pretrained(tmp_path)
    done = _run("--model", str(tmp_path), "--seq", "64", "--bandwidth", "25", "--tflops", "100")
    assert done.returncode == 0, done.stderr
    assert "link=25 GB/s" in done.stdout and "kept on device" in done.stdout


def test_a_model_source_is_required() -> None:
    done = _run("--seq", "64")
    assert done.returncode == 2
    assert "--model" in done.stderr and "--preset" in done.stderr


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _memory.add_parser(parser.add_subparsers())
    return parser.parse_args(["plan-memory", *argv])


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "timeline.png"
    args = _args("--preset", "tiny", "--seq", "64", "--plot", str(target))
    assert args.run(args) == 0
    assert target.read_bytes()[:4] == b"\x89PNG"
    assert "timeline written" in capsys.readouterr().out


def test_plot_without_matplotlib_names_the_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    args = _args("--preset", "tiny", "--seq", "64", "--plot", str(tmp_path / "t.png"))
    assert args.run(args) == 2
    assert "pip install graphswap[plot]" in capsys.readouterr().err
