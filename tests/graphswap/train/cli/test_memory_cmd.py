"""``graphswap plan-memory``: the console command end to end, and its plot option."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from graphswap import rewrite
from graphswap._compat._table import RENAMED_KEYWORDS
from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import PRESETS
from graphswap.planning.measure import ResidentActivationTracker, output_tensors
from graphswap.train.cli import _memory

CONSOLE_TEST = "test_json_output_parses_and_counts_every_layer"
CONSOLE_ARGV = [
    "plan-memory", "--preset", "tiny", "--seq-len", "1024", "--batch-size", "2",
    "--num-layers", "2", "--format", "json",
]  # fmt: skip
"""The console-script run of this module (the ``console`` fixture)."""


def test_text_output_from_a_checkpoint_folder(tmp_path: Path, graphswap_cmd) -> None:
    from graphswap.hf.presets import qwen3_moe_config

    qwen3_moe_config("tiny", num_hidden_layers=2).save_pretrained(tmp_path)
    done = graphswap_cmd(
        "plan-memory", "--model", str(tmp_path), "--seq-len", "64", "--swap-bandwidth-gbps", "25",
        "--swap-tflops", "100",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "link=25 GB/s" in done.stdout and "kept on device" in done.stdout


def test_a_model_source_is_required(graphswap_cmd) -> None:
    done = graphswap_cmd("plan-memory", "--seq-len", "64")
    assert done.returncode == 2
    assert "--model" in done.stderr and "--preset" in done.stderr


def test_a_family_whose_attention_is_not_self_attn_is_planned(
    tmp_path: Path, tour_config, graphswap_cmd
) -> None:
    """GPT-NeoX: no num_key_value_heads in its config, its attention named ``attention``:
    attention swap plans what that module saves."""
    tour_config("gpt_neox").save_pretrained(tmp_path)
    done = graphswap_cmd(
        "plan-memory", "--model", str(tmp_path), "--seq-len", "512", "--attn-implementation",
        "eager", "--format", "json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert len(plan["layers"]) == 2
    assert all(layer["swappable_bytes"] > 0 for layer in plan["layers"][:-1])


@pytest.mark.parametrize("command", ["plan-memory", "graph"])
def test_a_checkpoint_whose_config_names_its_attention_is_read(
    command: str, tmp_path: Path, graphswap_cmd
) -> None:
    """What transformers writes after model.config.attn_implementation = ...; the
    command's own --attn-implementation (or default) decides, as from_pretrained's
    argument does."""
    from graphswap.hf.presets import preset_config

    config = preset_config("tiny-llama")
    config.attn_implementation = "eager"
    config.save_pretrained(tmp_path)
    assert "attn_implementation" in json.loads((tmp_path / "config.json").read_text())
    extra = ["--seq-len", "64"] if command == "plan-memory" else []
    done = graphswap_cmd(command, "--model", str(tmp_path), *extra)
    assert done.returncode == 0, done.stderr


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _memory.add_parser(parser.add_subparsers())
    return parser.parse_args(["plan-memory", *argv])


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "timeline.png"
    args = _args("--preset", "tiny", "--num-layers", "1", "--seq-len", "64", "--plot", str(target))
    assert args.run(args) == 0
    assert target.read_bytes()[:4] == b"\x89PNG"
    assert "timeline written" in capsys.readouterr().out


def test_fit_plot_draws_each_modes_peak_and_ratio_over_the_length(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "fit.png"
    args = _args(
        "--preset",
        "tiny",
        "--num-layers",
        "2",
        "--seq-step",
        "1024",
        "--fit",
        "--plot",
        str(target),
    )
    assert args.run(args) == 0
    assert target.read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out.splitlines()[-1] == f"fit written to {target}"


def test_plot_without_matplotlib_names_the_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    args = _args(
        "--preset",
        "tiny",
        "--num-layers",
        "1",
        "--seq-len",
        "64",
        "--plot",
        str(tmp_path / "t.png"),
    )
    assert args.run(args) == 2
    assert "pip install graphswap[plot]" in capsys.readouterr().err


def test_plot_to_a_file_whose_suffix_names_no_image_format_is_refused_before_planning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("matplotlib")
    args = _args("--preset", "tiny", "--seq-len", "64", "--plot", "fit.txt")
    assert args.run(args) == 2
    assert capsys.readouterr().err.startswith(
        "graphswap plan-memory: error: --plot fit.txt: the file's suffix names the image"
        " format, one of "
    )


def _plan(capsys: pytest.CaptureFixture[str], *argv: str, layers: int = 1) -> dict:
    """The JSON plan of ``layers`` tiny layers at batch 2 x seq 512 with ``argv``."""
    args = _args(
        "--preset", "tiny", "--num-layers", str(layers), "--seq-len", "512", "--batch-size", "2",
        "--format", "json", *argv,
    )  # fmt: skip
    assert args.run(args) == 0
    return json.loads(capsys.readouterr().out)


def test_tp_predicts_one_rank_of_the_sharded_heads(capsys: pytest.CaptureFixture[str]) -> None:
    whole = _plan(capsys, "--dtype", "float32")
    rank = _plan(capsys, "--dtype", "float32", "--tp-size", "2")
    assert rank["tp_size"] == 2 and rank["config"] == whole["config"]
    assert 0 < rank["total_saved_bytes"] < whole["total_saved_bytes"]
    assert rank["head_saved_bytes"] == whole["head_saved_bytes"]  # replicated
    assert any("2 of 4 query heads" in text for text in rank["assumptions"])


def test_autocast_dtype_plans_the_saves_autocast_makes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--dtype float32 --autocast-dtype bfloat16``: a trainer's bf16 mixed precision,
    whose linears save bf16 copies beside the fp32 residual stream."""
    fp32 = _plan(capsys, "--dtype", "float32")
    mixed = _plan(capsys, "--dtype", "float32", "--autocast-dtype", "bfloat16")
    assert fp32["autocast_dtype"] is None and mixed["autocast_dtype"] == "bfloat16"
    assert mixed["total_saved_bytes"] != fp32["total_saved_bytes"]
    args = _args("--preset", "tiny", "--num-layers", "1", "--seq-len", "64", "--dtype", "float32",
                 "--autocast-dtype", "bfloat16")  # fmt: skip
    assert args.run(args) == 0
    assert "dtype=float32 autocast_dtype=bfloat16 " in capsys.readouterr().out


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
        (["--tp-size", "3"], ["--tp-size 3:", "num_attention_heads (4)", "use one of 1, 2"]),
        (["--device", "cpu", "--attn-kernel", "cudnn"], ["--attn-kernel cudnn:", "flash, math"]),
        (["--attn-implementation", "eager", "--attn-kernel", "flash"], ["--attn-kernel flash:"]),
        (
            ["--activation-swap", "auto", "--swap-hide-margin", "1"],
            ["--swap-hide-margin 1.0:", "[0, 1)"],
        ),
        (
            ["--swap-hide-margin", "0.2"],
            ["--swap-hide-margin 0.2 applies to --activation-swap auto only"],
        ),
        (["--swap-offload-lag", "-1"], ["--swap-offload-lag -1:", "integer >= 0"]),
        (["--swap-prefetch-depth", "0"], ["--swap-prefetch-depth 0:", "integer >= 1"]),
        (["--state-shards", "0"], ["--state-shards 0:", "integer >= 1"]),
        (["--profile", "h300"], ["--profile h300:", "unknown device profile 'h300'", "h100, h200"]),
        (
            ["--profile", "h200,hbm_gbps=0"],
            ["--profile h200,hbm_gbps=0:", "hbm_gbps must be a finite number > 0, got 0.0"],
        ),
        (["--seq-step", "256"], ["--seq-step 256 applies to --fit only"]),
    ],
)
def test_bad_settings_name_the_flag_before_any_model_is_built(
    argv: list[str],
    words: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import graphswap.train.build

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was built for a plan that cannot run")

    monkeypatch.setattr(graphswap.train.build, "build_model", refuse)
    args = _args("--preset", "tiny", "--seq-len", "64", *argv)
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphswap plan-memory: error: ") and "Traceback" not in err
    for word in words:
        assert word in err


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5"])
@pytest.mark.parametrize("flag", ["--swap-bandwidth-gbps", "--swap-tflops"])
def test_a_figure_that_is_not_a_finite_positive_number_is_a_usage_error(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        _args("--preset", "tiny", "--seq-len", "64", flag, value)
    assert caught.value.code == 2
    assert f"argument {flag}: must be a finite number > 0, got {value}" in capsys.readouterr().err


def test_an_unknown_kernel_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        _args("--preset", "tiny", "--seq-len", "64", "--attn-kernel", "flash3")
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "--attn-kernel" in err and "flash3" in err and "efficient" in err


def _auto_text(capsys: pytest.CaptureFixture[str], bandwidth: str) -> list[str]:
    args = _args(
        "--preset",
        "tiny",
        "--num-layers",
        "2",
        "--seq-len",
        "512",
        "--batch-size",
        "2",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--activation-swap",
        "auto",
        "--swap-bandwidth-gbps",
        bandwidth,
        "--swap-tflops",
        "0.5",
    )
    assert args.run(args) == 0
    return capsys.readouterr().out.splitlines()


def test_policy_auto_shows_per_layer_what_hides(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _auto_text(capsys, "2")
    header = next(line for line in lines if line.startswith("layer "))
    for column in (
        "saved",
        "swapped",
        "kept",
        "copy ms",
        "fwd win",
        "fwd stall",
        "reload ms",
        "bwd win",
        "bwd stall",
        "swapped saves (#)",
    ):
        assert column in header
    rows = [line for line in lines if line.startswith("model.layers.")]
    assert len(rows) == 2
    assert "  hides  " in rows[0] and "kept on device" in rows[1]
    assert any(line.startswith("auto swaps 1.00 MiB of the 6.00 MiB") for line in lines)
    step = next(line for line in lines if line.startswith("step: "))
    assert "ratio 1.0000" in step and "stalls 0.000 ms" in step


def test_policy_auto_on_a_slow_link_says_it_swaps_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = _auto_text(capsys, "0.001")
    rows = [line for line in lines if line.startswith("model.layers.")]
    assert "none swapped" in rows[0]
    assert any(line.startswith("auto swaps nothing: ") for line in lines)


def test_policy_auto_json_lists_the_swapped_saves(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(
        capsys,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--activation-swap",
        "auto",
        "--swap-bandwidth-gbps",
        "2",
        "--swap-tflops",
        "1",
        "--swap-hide-margin",
        "0.2",
        layers=2,
    )
    assert (plan["activation_swap"], plan["swap_hide_margin"]) == ("auto", 0.2)
    first = plan["layers"][0]
    storages = {s["storage"]: s["nbytes"] for s in first["swapped_saves"]}
    assert len(storages) < len(first["swapped_saves"])  # q is saved twice, swapped once
    assert first["swappable_bytes"] == sum(storages.values())
    assert first["kept_bytes"] == first["saved_bytes"] - first["swappable_bytes"]
    assert first["hides"] and first["forward_stall"] == first["backward_stall"] == 0
    assert _memory.auto_verdict(plan).startswith("auto swaps ")


def _text(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    args = _args(*argv)
    assert args.run(args) == 0
    return capsys.readouterr().out.splitlines()


def test_a_smaller_node_is_a_smaller_host_budget_and_the_plan_says_what_stays(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--host-memory and --ranks-per-node size the pool as the runtime would on that node:
    half of 16 GiB over 4 ranks is 2 GiB, less than layer swap wants at 8192 tokens."""
    argv = (
        "--preset",
        "qwen3-30b-a3b",
        "--num-layers",
        "3",
        "--seq-len",
        "8192",
        "--state-shards",
        "8",
    )
    lines = _text(capsys, *argv, "--activation-swap", "layer")
    [roomy] = [line for line in lines if line.startswith("pinned host memory per rank:")]
    assert roomy.endswith("budget 128.00 GiB")
    lines = _text(
        capsys,
        *argv,
        "--activation-swap",
        "layer",
        "--host-memory",
        "16GiB",
        "--ranks-per-node",
        "4",
    )
    [tight] = [line for line in lines if line.startswith("pinned host memory per rank:")]
    assert "budget 2.00 GiB;" in tight and "chosen for swap stays on device" in tight
    assert any("capped at 2.0 GiB per rank" in line for line in lines)
    settings = lines[0]
    assert "attention_timing=causal" in settings and "swap_offload_lag=1 " in settings


QWEN3_30B = ("--preset", "qwen3-30b-a3b", "--seq-len", "8192", "--num-layers", "2")
"""Qwen3-30B-A3B's layers at seq 8192 (bf16, flash, the H200 profile: 50 GB/s, 400
TFLOP/s); two of its 48 layers, each the same: the first's row is the full model's, the
second is the kept last layer."""


def test_attention_swap_of_qwen3_30b_shows_the_forward_stall(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = _text(capsys, *QWEN3_30B, "--activation-swap", "attention")
    assert "link=50 GB/s compute=400 TFLOP/s" in lines[0]
    first, last = (line.split() for line in lines if line.startswith("model.layers."))
    copy, forward_window, forward_stall = map(float, first[7:10])
    assert copy == pytest.approx(8.242, abs=1e-3) and forward_window < copy
    assert forward_stall > 1.0 and first[-1] == "STALLS"
    assert last[-3:] == ["kept", "on", "device"]
    assert any(line.endswith("every copy hides: NO") for line in lines)
    step = next(line for line in lines if line.startswith("step: "))
    assert float(step.split("ratio ")[1].split()[0]) > 1.01
    assert any(line.startswith("device peak with attention swap: ") for line in lines)
    assert any(line.startswith("device peak without swap: ") for line in lines)


def test_auto_on_qwen3_30b_stalls_neither_window(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(*QWEN3_30B, "--activation-swap", "auto", "--format", "json")
    assert args.run(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["step_ratio"] <= 1.01 and plan["timeline"]["stall_seconds"] == 0
    for layer in plan["layers"][:-1]:
        assert layer["forward_stall"] == layer["backward_stall"] == 0
        assert layer["verdict"] == "hides" and layer["swappable_bytes"] > 0
        # The forward binds: at most 90% of it is copies.
        assert layer["copy_seconds"] <= 0.9 * min(layer["forward_window"], layer["backward_window"])
    assert plan["all_hide"]


def test_fit_says_the_state_of_qwen3_30b_does_not_fit_one_h200_and_names_the_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = _text(capsys, "--preset", "qwen3-30b-a3b", "--fit")
    assert lines[0].startswith("fit in 131.32 GiB (h200)")
    assert "AdamW state 113.74 GiB" in lines[1]
    assert lines[2].startswith("parameters, gradients and AdamW state alone do not fit")
    assert "--state-shards 2 or more" in lines[2]


def test_fit_prints_each_modes_longest_sequence_as_its_json_says(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two tiny layers in steps of 1024 up to their 2048 positions, two traces: 41.5 MB
    holds the step at 2048 only with the first layer swapped whole (``layer``, and
    ``auto`` on a link fast enough to hide every copy), about 5% to spare either side."""
    argv = (
        "--preset",
        "tiny",
        "--num-layers",
        "2",
        "--swap-bandwidth-gbps",
        "1e4",
        "--state-shards",
        "2",
    )
    args = _args(*argv, "--seq-step", "1024", "--fit", "41.5MB", "--format", "json")
    assert args.run(args) == 0
    fit = json.loads(capsys.readouterr().out)
    assert (fit["memory_bytes"], fit["seq_step"], fit["state_shards"]) == (41_500_000, 1024, 2)
    assert fit["state_fits"] and fit["traced"] == [1024, 2048]
    assert fit["batch_size"] == 1 and "batch" not in fit
    modes = {mode["activation_swap"]: mode for mode in fit["modes"]}
    assert [point["seq_len"] for point in modes["layer"]["points"]] == [1024, 2048]
    assert modes["layer"]["plan"]["seq_len"] == modes["layer"]["seq_len"] == 2048
    assert list(modes) == ["none", "attention", "layer", "auto", "budget"]
    assert [(mode["seq_len"], mode["capped"]) for mode in modes.values()] == [
        (1024, False),
        (1024, False),
        (2048, True),
        (2048, True),
        (2048, True),
    ]
    lines = _memory.format_fit(fit).splitlines()
    assert lines[0].endswith("sequences in steps of 1024 up to 2048, state_shards 2")
    assert lines[2].startswith("host pool budget per rank: 128.00 GiB")
    assert lines[3].split()[:3] == ["mode", "longest", "seq"]
    assert lines[3].split()[-2:] == ["host", "peak"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[5:10]}
    for name, mode in modes.items():
        plan = mode["plan"]
        seq = [">=", "2048"] if mode["capped"] else ["1024"]
        assert rows[name][: len(seq) + 1] == [*seq, f"{plan['step_ratio']:.4f}"]
        assert mode["fits"] == [[1024, mode["seq_len"]]]
    assert lines[11] == (
        "every multiple of 1024 up to 2048 planned (2 lengths), 2 traced: 1024, 2048; "
        ">= N: fits even at the model's window (max_position_embeddings, or its rope scaling's)"
    )
    assert fit["max_step_ratio"] is None
    assert all(mode["seq_len_at_max_step_ratio"] is None for mode in modes.values())


def test_rope_factor_fits_past_the_window_and_each_mode_answers_at_a_step_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The tiny model's 2048 positions stretched twice: the fit plans 4096 too. On a 1 GB/s
    link attention and layer swap stall at every length, so no length runs within 1.05;
    none, auto and budget run at 1 up to the window."""
    args = _args(
        "--preset",
        "tiny",
        "--num-layers",
        "2",
        "--rope-factor",
        "2",
        "--swap-bandwidth-gbps",
        "1",
        "--seq-step",
        "2048",
        "--fit",
        "64GiB",
        "--max-step-ratio",
        "1.05",
        "--format",
        "json",
    )
    assert args.run(args) == 0
    fit = json.loads(capsys.readouterr().out)
    assert (fit["max_seq"], fit["max_step_ratio"]) == (4096, 1.05)
    within = {mode["activation_swap"]: mode["seq_len_at_max_step_ratio"] for mode in fit["modes"]}
    assert within == {"none": 4096, "attention": None, "layer": None, "auto": 4096, "budget": 4096}
    assert [point["seq_len"] for point in fit["modes"][0]["points"]] == [2048, 4096]
    lines = _memory.format_fit(fit).splitlines()
    assert lines[3].split()[:6] == ["mode", "longest", "seq", "at", "<=", "1.05"]
    rows = {line.split()[0]: line.split()[1:4] for line in lines[5:10]}
    assert rows["none"] == [">=", "4096", ">="] and rows["layer"][:3] == [">=", "4096", "none"]
    assert lines[11].startswith("at <= 1.05: the longest sequence that fits (every shorter")


def test_a_checkpoint_whose_config_scales_its_rope_fits_past_its_positions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config.json with rope scaling as Qwen3 documents it (4.x's ``rope_scaling`` key,
    YaRN over the pretraining window), no flag: the fit searches the stretched window."""
    from graphswap.hf.presets import preset_config

    text = json.loads(preset_config("tiny-qwen3").to_json_string())
    text.pop("rope_parameters", None)
    text["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 2048,
    }
    (tmp_path / "config.json").write_text(json.dumps(text))
    args = _args(
        "--model", str(tmp_path), "--num-layers", "1", "--device", "cpu", "--seq-step", "2048",
        "--fit", "64GiB", "--format", "json",
    )  # fmt: skip
    assert args.run(args) == 0
    fit = json.loads(capsys.readouterr().out)
    assert fit["max_seq"] == 4096 and fit["planned"] == 2
    assert all(mode["seq_len"] == 4096 and mode["capped"] for mode in fit["modes"])


def test_a_seq_len_past_the_window_names_the_rope_factor_that_covers_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _args("--preset", "tiny", "--seq-len", "5000")
    assert args.run(args) == 2
    assert capsys.readouterr().err == (
        "graphswap plan-memory: error: --seq-len 5000: longer than the 2048 tokens --preset "
        "tiny's positions cover (max_position_embeddings, or its rope scaling's); stretch them "
        "with --rope-factor 3 (YaRN over 2048 tokens: up to 6144)\n"
    )
    args = _args(
        "--preset", "tiny", "--num-layers", "1", "--seq-len", "5000", "--rope-factor", "3",
        "--format", "json",
    )  # fmt: skip
    assert args.run(args) == 0
    assert json.loads(capsys.readouterr().out)["seq_len"] == 5000


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], ["--seq-len N is required (or --fit"]),
        (["--fit", "--seq-len", "64"], ["--seq-len 64 with --fit: the fit searches the sequence"]),
        (["--fit", "--activation-swap", "auto"], ["--activation-swap auto with --fit"]),
        (["--fit", "--swap-hide-margin", "2"], ["--swap-hide-margin 2.0: must be in [0, 1)"]),
    ],
)
def test_fit_and_seq_go_one_at_a_time(
    argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    args = _args("--preset", "tiny", *argv)
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphswap plan-memory: error: ") and all(word in err for word in words)


@pytest.mark.parametrize(
    ("text", "nbytes"), [("141GiB", 141 << 30), ("80GB", 80 * 10**9), ("8e10", 8 * 10**10)]
)
def test_fit_reads_a_memory_size(text: str, nbytes: int) -> None:
    assert _memory.memory_size(text) == nbytes


def test_a_memory_size_without_a_known_unit_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _args("--preset", "tiny", "--fit", "141 parsecs")
    assert "expected a finite size such as 141GiB" in capsys.readouterr().err


FAMILY_PRESETS = ["tiny", *sorted(name for name in PRESETS if name.startswith("tiny-"))]


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_a_checkpoint_folder_of_each_family_plans_what_the_runtime_frees(
    preset: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    family_config: Callable[[str, str], Any],
    one_thread: None,
) -> None:
    """``--model DIR`` traces any family from its config.json; layer swap (eager, where
    the probabilities pass the 1 MiB threshold at seq 256) then takes off the device what
    the plan says, by the independent tracker, and copies what it says."""
    config = family_config(preset, "eager")
    config.save_pretrained(tmp_path)
    seq, batch = 256, 2
    args = _args(
        "--model", str(tmp_path), "--seq-len", str(seq), "--batch-size", str(batch),
        "--activation-swap", "layer",
        "--dtype", "float32", "--device", "cpu", "--attn-implementation", "eager",
        "--format", "json",
    )  # fmt: skip
    assert args.run(args) == 0
    plan = json.loads(capsys.readouterr().out)
    torch.manual_seed(0)
    model = build_model(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator())
    resident = []
    for rules in ([], ["layer_swap"]):
        report = rewrite(model, rules=rules) if rules else None
        tracker = ResidentActivationTracker("cpu")
        with tracker.track():
            out = model(input_ids=ids, labels=ids, use_cache=False)
        if report is not None:
            report.manager.synchronize()
        resident.append(tracker.resident_bytes(output_tensors(out)))
        out.loss.backward()
    assert report is not None
    offloaded = sum(layer["offloaded_bytes"] for layer in plan["layers"])
    assert report.manager.stats.offloaded_bytes == offloaded > 0
    assert resident[0] - resident[1] == pytest.approx(plan["swapped_bytes"], rel=0.01)


def test_json_output_parses_and_counts_every_layer(console: Any) -> None:
    """The console script, once: 2048 tokens make sdpa's bfloat16 query 1 MiB, the swap
    threshold, and the first of the two layers swaps it."""
    done = console.done()
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    # The flags in are the keys out: one spelling per setting, none of 0.1.0's (seq, tp, ...).
    assert (plan["seq_len"], plan["batch_size"]) == (1024, 2)
    assert not set(RENAMED_KEYWORDS) & set(plan)
    assert [layer["name"] for layer in plan["layers"]] == ["model.layers.0", "model.layers.1"]
    assert plan["timeline"]["peak_bytes"] < plan["baseline"]["peak_bytes"]
    assert plan["profile"]["d2h_gbps"] == 50.0 and plan["dtype"] == "bfloat16"
    schedule = ("swap_offload_lag", "swap_prefetch_depth", "state_shards")
    assert [plan[key] for key in schedule] == [1, 1, 1]
    defaults = ("sdpa", "cuda", "flash", 1)
    assert (
        plan["attn_implementation"],
        plan["device"],
        plan["attn_kernel"],
        plan["tp_size"],
    ) == defaults
    assert any("aten._scaled_dot_product_flash_attention;" in a for a in plan["assumptions"])


def test_the_loss_head_the_step_runs_is_planned(capsys: pytest.CaptureFixture[str]) -> None:
    full = _plan(capsys, "--device", "cpu")
    chunked = _plan(
        capsys, "--device", "cpu", "--loss-head", "chunked", "--loss-head-chunk-size", "128"
    )
    assert (full["loss_head"], chunked["loss_head"]) == ("full", "chunked")
    assert chunked["loss_head_chunk_size"] == 128
    assert chunked["head_saved_bytes"] < full["head_saved_bytes"]
    args = _args(
        "--preset", "tiny", "--num-layers", "1", "--seq-len", "512", "--loss-head", "chunked"
    )
    assert args.run(args) == 0
    assert " loss_head=chunked:1024 " in capsys.readouterr().out


def test_a_chunk_size_below_one_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        _args("--preset", "tiny", "--seq-len", "64", "--loss-head-chunk-size", "0")
    assert caught.value.code == 2
    assert "--loss-head-chunk-size" in capsys.readouterr().err


def test_the_trainers_checkpointing_plans_whole_layers(capsys: pytest.CaptureFixture[str]) -> None:
    """``--activation-checkpointing`` reaches the budget plan: a budget that needs no
    recompute still recomputes every whole layer, as a checkpointing trainer runs it."""
    argv = ("--device", "cpu", "--activation-memory-budget", "100GiB")
    free = _plan(capsys, *argv, layers=2)
    checkpointed = _plan(capsys, *argv, "--activation-checkpointing", layers=2)
    assert (free["recompute"], checkpointed["recompute"]) == ([], ["layer"])


def test_a_lora_step_is_planned_with_the_adapters_state(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--lora-rank plans the LoRA step: the AdamW state is the adapters' (a few KiB
    here), the settings line says so; --lora-target-modules narrows what is adapted."""
    full = _plan(capsys, "--device", "cpu")
    lora = _plan(capsys, "--device", "cpu", "--lora-rank", "8")
    attention = _plan(
        capsys, "--device", "cpu", "--lora-rank", "8", "--lora-target-modules", "q_proj,v_proj"
    )
    assert (full["lora_rank"], lora["lora_rank"]) == (None, 8)
    held = [plan["timeline"]["base_bytes"] for plan in (full, lora, attention)]
    assert held[0] > held[1] > held[2]
    args = _args("--preset", "tiny", "--num-layers", "1", "--seq-len", "512", "--lora-rank", "8")
    assert args.run(args) == 0
    assert " loss_head=full lora_rank=8 " in capsys.readouterr().out
