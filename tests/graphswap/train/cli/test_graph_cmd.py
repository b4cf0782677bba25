"""``graphswap graph``: in process for the options, in a subprocess for the console entry."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from graphswap.hf.presets import qwen3_moe_config
from graphswap.train.cli import _graph

GOLDEN = Path(__file__).parents[2] / "rewriting" / "golden" / "prefetch_graph_default.dot"

CONSOLE_TEST = "test_subprocess_default_dot_matches_golden"
CONSOLE_ARGV = ["graph"]
"""The console-script run of this module (the ``console`` fixture)."""


def run_graph(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="graphswap")
    _graph.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["graph", *argv])
    return args.run(args)


def test_json_with_layers(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_graph(["--format", "json", "--num-layers", "3"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert [n["id"] for n in data["nodes"]] == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert len(data["edges"]) == 2
    assert err.strip() == "attn_swap: 3 modules wrapped, 2 prefetch links"


def test_model_dir_reads_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    qwen3_moe_config("tiny", num_hidden_layers=5).save_pretrained(tmp_path)
    out_file = tmp_path / "graph.dot"
    assert run_graph(["--model", str(tmp_path), "-o", str(out_file)]) == 0
    assert out_file.read_text().count('[kind="prefetch"]') == 4
    assert capsys.readouterr().out == ""


def test_model_dir_of_another_family(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import MistralConfig

    MistralConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4).save_pretrained(
        tmp_path
    )
    assert run_graph(["--model", str(tmp_path), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    nodes = json.loads(out)["nodes"]
    assert {n["module_type"] for n in nodes} == {
        "transformers.models.mistral.modeling_mistral.MistralAttention"
    }
    assert err.strip() == "attn_swap: 3 modules wrapped, 2 prefetch links"


def test_layers_override_the_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    qwen3_moe_config("tiny", num_hidden_layers=5).save_pretrained(tmp_path)
    assert run_graph(["--model", str(tmp_path), "--num-layers", "2", "--format", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["nodes"]) == 2


def test_missing_model_dir_fails_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_graph(["--model", str(tmp_path / "nowhere")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_unknown_rule_fails_with_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_graph(["--num-layers", "2", "--rule", "qwen3_attn_swp"]) == 2
    assert "did you mean 'qwen3_attn_swap'" in capsys.readouterr().err


def test_bad_layer_count_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        run_graph(["--num-layers", "0"])


def test_image_without_graphviz_names_the_package(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", "")
    assert run_graph(["--format", "svg"]) == 2
    assert "install the graphviz package" in capsys.readouterr().err


def test_json_to_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "graph.json"
    assert run_graph(["--format", "json", "--num-layers", "4", "-o", str(out_file)]) == 0
    assert capsys.readouterr().out == ""
    assert len(json.loads(out_file.read_text())["edges"]) == 3


def test_png_without_graphviz_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Only the interpreter's own folder on PATH: no Graphviz.
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    assert run_graph(["--format", "png", "-o", str(tmp_path / "g.png")]) == 2
    assert "graphviz" in capsys.readouterr().err
    assert not (tmp_path / "g.png").exists()


def test_subprocess_default_dot_matches_golden(console: Any) -> None:
    result = console.done()
    assert result.returncode == 0, result.stderr
    assert result.stdout == GOLDEN.read_text()
    assert "48 modules wrapped, 47 prefetch links" in result.stderr
