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
        "--preset", "tiny", "--seq", "1024", "--batch", "2", "--layers", "3", "--format", "json"
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert [layer["name"] for layer in plan["layers"]] == [f"model.layers.{i}" for i in range(3)]
    assert plan["peak_with_swap_bytes"] < plan["peak_without_swap_bytes"]
    assert plan["bandwidth_gbps"] == 50.0 and plan["dtype"] == "bfloat16"
    defaults = ("sdpa", "cuda", "flash", 1)
    assert (
        plan["attn_implementation"],
        plan["device"],
        plan["attn_kernel"],
        plan["tp"],
    ) == defaults
    assert any("aten._scaled_dot_product_flash_attention;" in a for a in plan["assumptions"])


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


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    args = _args("--preset", "tiny", "--seq", "512", "--batch", "2", "--format", "json", *argv)
    assert args.run(args) == 0
    return json.loads(capsys.readouterr().out)


def test_tp_predicts_one_rank_of_the_sharded_heads(capsys: pytest.CaptureFixture[str]) -> None:
    whole = _plan(capsys, "--dtype", "float32")
    rank = _plan(capsys, "--dtype", "float32", "--tp", "2")
    assert rank["tp"] == 2 and rank["config"] == whole["config"]
    assert 0 < rank["total_saved_bytes"] < whole["total_saved_bytes"]
    assert rank["head_saved_bytes"] == whole["head_saved_bytes"]  # replicated
    assert any("2 of 4 query heads" in text for text in rank["assumptions"])


def test_the_kernel_decides_the_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    flash = _plan(capsys, "--attn-kernel", "flash")
    math = _plan(capsys, "--attn-kernel", "math")
    cpu = _plan(capsys, "--device", "cpu")
    assert flash["total_saved_bytes"] < math["total_saved_bytes"]
    assert (cpu["device"], cpu["attn_kernel"]) == ("cpu", "flash")
    assert _plan(capsys, "--dtype", "float32")["attn_kernel"] == "efficient"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ["--attn-kernel", "flash", "--dtype", "float32"],
            ["--attn-kernel flash:", "use one of efficient, math"],
        ),
        (["--tp", "3"], ["--tp 3:", "num_attention_heads (4)", "use one of 1, 2"]),
        (["--device", "cpu", "--attn-kernel", "cudnn"], ["--attn-kernel cudnn:", "flash, math"]),
        (["--attn-implementation", "eager", "--attn-kernel", "flash"], ["--attn-kernel flash:"]),
        (["--policy", "auto", "--hide-margin", "1"], ["--hide-margin 1.0:", "[0, 1)"]),
        (["--hide-margin", "0.2"], ["--hide-margin 0.2 applies to --policy auto only"]),
    ],
)
def test_bad_settings_name_the_flag_before_any_model_is_built(
    argv: list[str],
    words: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import graphswap.models

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was built for a plan that cannot run")

    monkeypatch.setattr(graphswap.models, "build_model", refuse)
    args = _args("--preset", "tiny", "--seq", "64", *argv)
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    for word in words:
        assert word in err


def test_an_unknown_kernel_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        _args("--preset", "tiny", "--seq", "64", "--attn-kernel", "flash3")
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "--attn-kernel" in err and "flash3" in err and "efficient" in err


def _auto_text(capsys: pytest.CaptureFixture[str], bandwidth: str) -> list[str]:
    args = _args(
        "--preset",
        "tiny",
        "--seq",
        "512",
        "--batch",
        "2",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--policy",
        "auto",
        "--bandwidth",
        bandwidth,
        "--tflops",
        "1",
    )
    assert args.run(args) == 0
    return capsys.readouterr().out.splitlines()


def test_policy_auto_shows_per_layer_what_hides(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _auto_text(capsys, "2")
    header = next(line for line in lines if line.startswith("layer "))
    for column in ("saved", "swapped", "kept", "copy ms", "overlap ms", "swapped saves (#)"):
        assert column in header
    rows = [line for line in lines if line.startswith("model.layers.")]
    assert len(rows) == 4
    assert all("  hides  " in row for row in rows[:3]) and "kept on device" in rows[3]
    assert any(line.startswith("auto swaps 6.00 MiB of the 18.00 MiB") for line in lines)


def test_policy_auto_on_a_slow_link_says_it_swaps_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = _auto_text(capsys, "0.001")
    rows = [line for line in lines if line.startswith("model.layers.")]
    assert all("none swapped" in row for row in rows[:3])
    assert any(line.startswith("auto swaps nothing: ") for line in lines)


def test_policy_auto_json_lists_the_swapped_saves(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(
        capsys,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--policy",
        "auto",
        "--bandwidth",
        "2",
        "--tflops",
        "1",
        "--hide-margin",
        "0.2",
    )
    assert (plan["swap"], plan["hide_margin"]) == ("auto", 0.2)
    first = plan["layers"][0]
    storages = {s["storage"]: s["nbytes"] for s in first["swapped_saves"]}
    assert len(storages) < len(first["swapped_saves"])  # q is saved twice, swapped once
    assert first["swappable_bytes"] == sum(storages.values())
    assert first["kept_bytes"] == first["saved_bytes"] - first["swappable_bytes"]
    assert first["prefetch_hides"] and plan["verdict"].startswith("auto swaps ")
