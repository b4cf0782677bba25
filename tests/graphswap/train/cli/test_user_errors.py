"""Every user error of the console commands: a non-zero exit, one message that starts
by naming the input (and says the fix), no traceback, and no model built first.

The commands run in process through ``graphswap.train.cli.main`` (what the console script
calls), with model construction made to fail the test: an error raised after a model
was built would show up as that failure, and an exception that escaped ``main`` (a
traceback, from the console script) as an error of the test. Each command's own module
runs its console script once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from graphswap.hf.presets import qwen3_moe_config
from graphswap.train.cli import main


@pytest.fixture
def no_model_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was built before the input was checked")

    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoePreTrainedModel, "__init__", refuse)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit code and stderr of ``graphswap ARGV`` (argparse errors exit through SystemExit)."""
    try:
        code = main(argv)
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    return code, capsys.readouterr().err


def checkpoint_config(tmp_path: Path, text: str) -> str:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(text)
    return str(folder)


def qwen3_without_weights(tmp_path: Path) -> str:
    folder = tmp_path / "ckpt"
    qwen3_moe_config("tiny").save_pretrained(folder)
    return str(folder)


def data_file(content: bytes) -> Callable[[Path], str]:
    def make(tmp_path: Path) -> str:
        path = tmp_path / "corpus.txt"
        path.write_bytes(content)
        return str(path)

    return make


def binary_config(tmp_path: Path) -> str:
    path = tmp_path / "train.yaml"
    path.write_bytes(bytes([0x80, 0xFF, 0x00, 0xC3]) * 16)
    return str(path)


def read_only_dir(tmp_path: Path) -> str:
    """A folder that refuses writes: chmod for a normal user; root ignores the mode
    bits, so for root a path under sysfs, where no folder can be created."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    if not os.access(folder, os.W_OK):
        return str(folder / "out")
    if Path("/sys/kernel").is_dir():
        return "/sys/graphswap-test-out"
    pytest.skip("no folder refuses writes for this user")


NOT_A_DECODER = '{"model_type": "vit", "hidden_size": 64}'


def yaml_file(tmp_path: Path) -> str:
    path = tmp_path / "train.yaml"
    path.write_text("steps: 1\n")
    return str(path)


# (id, argv built from tmp_path, the message after ``graphswap COMMAND: error: ``)
CASES: list[tuple[str, Callable[[Path], list[str]], str]] = [
    (
        "train-binary-config",
        lambda p: ["train", "--config", binary_config(p)],
        "<file>: ",
    ),
    (
        "train-data-missing",
        lambda p: ["train", f"data={p / 'nope.txt'}"],
        "data: no file at",
    ),
    (
        "train-data-empty",
        lambda p: ["train", f"data={data_file(b'')(p)}"],
        "data: ",
    ),
    (
        "train-data-short",
        lambda p: ["train", "seq_len=16", f"data={data_file(b'abc')(p)}"],
        "data: ",
    ),
    ("train-data-dir", lambda p: ["train", f"data={p}"], "data: "),
    (
        "train-loss-head-chunk-size-zero",
        lambda p: ["train", "loss_head=chunked", "loss_head_chunk_size=0"],
        "loss_head_chunk_size: must be >= 1 (tokens per chunk of the loss head), got 0",
    ),
    (
        "train-loss-head-trl",
        lambda p: ["train", "loss_head=trl"],
        "loss_head: trl plans the fused head TRL's SFTTrainer installs",
    ),
    (
        "train-model-path-missing",
        lambda p: ["train", f"model_path={p / 'nope'}"],
        "model_path: ",
    ),
    (
        "train-model-path-corrupt-config",
        lambda p: ["train", f"model_path={checkpoint_config(p, '{oops')}"],
        "model_path: ",
    ),
    (
        "train-model-path-not-a-decoder",
        lambda p: ["train", f"model_path={checkpoint_config(p, NOT_A_DECODER)}"],
        "model_path: ",
    ),
    (
        "train-model-path-no-model-type",
        lambda p: ["train", f"model_path={checkpoint_config(p, '{}')}"],
        "model_path: ",
    ),
    (
        "train-model-path-without-weights",
        lambda p: ["train", f"model_path={qwen3_without_weights(p)}"],
        "model_path: ",
    ),
    (
        "train-output-dir-is-a-file",
        lambda p: ["train", f"output_dir={data_file(b'x')(p)}"],
        "output_dir: ",
    ),
    (
        "train-output-dir-read-only",
        lambda p: ["train", f"output_dir={read_only_dir(p)}"],
        "output_dir: cannot write to",
    ),
    ("train-lr-inf", lambda p: ["train", "lr=.inf"], "lr: "),
    (
        "train-pass-order-empty",
        lambda p: ["train", "pass_order="],
        "pass_order: override 'pass_order=' has no value",
    ),
    (
        "train-heads-not-divisible",
        lambda p: ["train", "tp_size=3"],
        "tp_size: 3 must divide",
    ),
    (
        "passes-exclusion",
        lambda p: ["passes", "activation_swap=attention", "compile=true"],
        "activation_swap: attention excludes compile: true",
    ),
    (
        "passes-a-pass-it-cannot-apply",
        lambda p: ["passes", "cp_size=2"],
        "cp_size: 2 asks for context_parallel, which graphswap declares and checks but cannot"
        " apply yet",
    ),
    (
        "train-a-pass-it-cannot-apply",
        lambda p: ["train", "activation_swap=none", "pp_size=2"],
        "pp_size: 2 asks for pipeline_parallel",
    ),
    (
        "graph-output-into-missing-dir",
        lambda p: ["graph", "-o", str(p / "missing" / "graph.dot")],
        "-o ",
    ),
    (
        "graph-model-not-a-decoder",
        lambda p: ["graph", "--model", checkpoint_config(p, NOT_A_DECODER)],
        "--model ",
    ),
    (
        "plan-memory-model-missing",
        lambda p: ["plan-memory", "--seq-len", "8", "--model", str(p / "nope")],
        "--model ",
    ),
    (
        "plan-memory-model-not-a-decoder",
        lambda p: ["plan-memory", "--seq-len", "8", "--model", checkpoint_config(p, NOT_A_DECODER)],
        "--model ",
    ),
    (
        "plan-memory-lora-dropout-without-rank",
        lambda p: ["plan-memory", "--preset", "tiny", "--seq-len", "8", "--lora-dropout", "0.1"],
        "--lora-dropout 0.1: applies to the LoRA step only; set lora_rank or drop it",
    ),
    (
        "plan-memory-unknown-profile",
        lambda p: ["plan-memory", "--preset", "tiny", "--seq-len", "8", "--profile", "a100"],
        "--profile a100: unknown device profile 'a100'; presets: h100, h200",
    ),
    ("train-override-twice", lambda p: ["train", "steps=3", "steps=1"], "steps: given twice"),
    (
        "train-profile-figure-twice",
        lambda p: ["train", "device=sim:h200,link_gbps=25,link_gbps=1"],
        "device: device profile 'h200,link_gbps=25,link_gbps=1': link_gbps given twice",
    ),
    (
        "train-sim-without-profile",
        lambda p: ["train", "device=sim:"],
        "device: sim: names no device profile; give one of h100, h200",
    ),
    (
        "train-seq-len-1",
        lambda p: ["train", "seq_len=1"],
        "seq_len: must be >= 2, got 1: a causal LM",
    ),
    (
        "train-profile-memory-inf",
        lambda p: ["train", "device=sim:h200,memory_bytes=inf"],
        "device: device profile 'h200 (custom)': memory_bytes must be a finite number > 0",
    ),
    (
        "train-more-layers-than-layer-types",
        lambda p: ["train", "model=tiny-gemma3", "num_layers=4"],
        "num_layers: 4 layers, but the model lists the kinds of only 3",
    ),
    (
        "plan-memory-more-layers-than-layer-types",
        lambda p: ["plan-memory", "--preset", "tiny-gemma3", "--seq-len", "8", "--num-layers", "4"],
        "--num-layers 4: --preset tiny-gemma3 has 4 layers, but the model lists the kinds of"
        " only 3",
    ),
    *(
        (
            f"plan-memory-profile-memory-{value}",
            lambda p, value=value: [
                "plan-memory",
                "--preset",
                "tiny",
                "--seq-len",
                "8",
                "--profile",
                f"h200,memory_bytes={value}",
            ],
            f"--profile h200,memory_bytes={value}: device profile 'h200 (custom)': memory_bytes"
            f" must be a finite number > 0, got {value}",
        )
        for value in ("inf", "nan")
    ),
    (
        "plan-memory-profile-without-hbm",
        lambda p: [
            "plan-memory",
            "--preset",
            "tiny",
            "--seq-len",
            "8",
            "--profile",
            "h100,hbm_gbps=-1",
        ],
        "--profile h100,hbm_gbps=-1: device profile 'h100 (custom)': hbm_gbps must be",
    ),
    ("train-rope-factor-1", lambda p: ["train", "rope_factor=1"], "rope_factor: must be a finite"),
    (
        "train-rope-factor-within-the-window",
        lambda p: ["train", "rope_factor=1.0001"],
        "rope_factor: stretches the pretraining window of 2048 tokens to 2048, which the",
    ),
    (
        "plan-memory-rope-factor-1",
        lambda p: ["plan-memory", "--preset", "tiny", "--seq-len", "8", "--rope-factor", "1"],
        "--rope-factor 1.0: must be a finite number > 1",
    ),
    (
        "plan-memory-rope-factor-within-the-window",
        lambda p: ["plan-memory", "--preset", "tiny", "--fit", "--rope-factor", "1.0001"],
        "--rope-factor 1.0001: stretches the pretraining window of 2048 tokens to 2048",
    ),
    (
        "plan-memory-max-step-ratio-below-1",
        lambda p: ["plan-memory", "--preset", "tiny", "--fit", "--max-step-ratio", "0.9"],
        "--max-step-ratio 0.9: must be a finite number >= 1",
    ),
    (
        "plan-memory-max-step-ratio-without-fit",
        lambda p: ["plan-memory", "--preset", "tiny", "--seq-len", "8", "--max-step-ratio", "2"],
        "--max-step-ratio 2.0 applies to --fit only",
    ),
    (
        "plan-memory-host-memory-without-swap",
        lambda p: [
            "plan-memory",
            "--preset",
            "tiny",
            "--seq-len",
            "8",
            "--activation-swap",
            "none",
            "--host-memory",
            "1TiB",
        ],
        "--host-memory 1099511627776 sizes the swap's host pool, and --activation-swap none",
    ),
    (
        "train-budget-infinite",
        lambda p: ["train", "activation_swap=budget", "activation_memory_budget=1e400"],
        "activation_memory_budget: is not a finite number of bytes",
    ),
    (
        "plan-memory-budget-above-the-profiles-memory",
        lambda p: [
            *("plan-memory", "--preset", "tiny", "--seq-len", "8", "--profile", "h100"),
            *("--activation-memory-budget", "200GiB"),
        ],
        "--activation-memory-budget 200GiB: is 214748364800 bytes, more than the 80000000000"
        " bytes (74.51 GiB) of the h100 profile's memory",
    ),
]


@pytest.mark.parametrize(("argv", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.usefixtures("no_model_built")
def test_user_error_is_one_message_before_any_model(
    argv: Callable[[Path], list[str]],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every command ends a user error alike: exit 2 (argparse's code) and one message
    in argparse's form, ``graphswap COMMAND: error: ...``."""
    args = argv(tmp_path)
    got, err = run(args, capsys)
    assert got == 2, err
    assert err.startswith(f"graphswap {args[0]}: error: {message}"), err
    assert "Traceback" not in err


@pytest.mark.usefixtures("no_model_built")
def test_device_cuda_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    got, err = run(["train", "device=cuda"], capsys)
    assert got == 2
    assert err.startswith("graphswap train: error: device: cuda was asked for but no CUDA device")


@pytest.mark.usefixtures("no_model_built")
def test_unknown_attn_implementation_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan-memory", "--preset", "tiny", "--seq-len", "8", "--attn-implementation", "flash"]
    code, err = run(argv, capsys)
    assert code == 2 and "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith(
        "graphswap plan-memory: error: argument --attn-implementation: invalid choice: 'flash'"
    )
    assert "eager" in last and "sdpa" in last


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-2"])
@pytest.mark.parametrize("flag", ["--swap-bandwidth-gbps", "--swap-tflops"])
@pytest.mark.usefixtures("no_model_built")
def test_plan_memory_rates_follow_the_rule_train_applies(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """One rule (graphswap.train.config.check_finite_positive): train refuses
    swap_bandwidth_gbps=.inf, so plan-memory refuses --swap-bandwidth-gbps inf."""
    argv = ["plan-memory", "--preset", "tiny", "--seq-len", "8", flag, value]
    code, err = run(argv, capsys)
    assert code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"graphswap plan-memory: error: argument {flag}: must be a finite number > 0,"
        f" got {float(value)!r}"
    )


@pytest.mark.parametrize(
    "overrides",
    [["tp_size=3"], ["activation_swap=attention", "compile=true"], ["lr=.inf"]],
    ids=["heads", "exclusion", "value"],
)
@pytest.mark.usefixtures("no_model_built")
def test_passes_rejects_what_train_rejects(
    overrides: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    passes_code, passes_err = run(["passes", *overrides], capsys)
    train_code, train_err = run(["train", *overrides], capsys)
    assert (passes_code, train_code) == (2, 2)
    reason = passes_err.removeprefix("graphswap passes: error: ")
    assert reason != passes_err and train_err == f"graphswap train: error: {reason}"


@pytest.mark.parametrize(
    "argv",
    [["--seq-len", "8"], ["--fit", "80GB", "--activation-memory-budget", "60GiB"]],
    ids=["no-budget", "fit"],
)
@pytest.mark.usefixtures("no_model_built")
def test_plan_memory_honours_checkpointing_in_a_budget_plan_only(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(
        ["plan-memory", "--preset", "tiny", "--activation-checkpointing", *argv], capsys
    )
    assert code == 2
    assert err.splitlines()[-1].startswith(
        "graphswap plan-memory: error: --activation-checkpointing is honoured by"
        " --activation-swap budget alone"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq-len", "8", "--activation-memory-budget", "1e400"], "is not a finite number"),
        (["--fit", "1e400"], "expected a finite size"),
    ],
    ids=["budget", "fit"],
)
@pytest.mark.usefixtures("no_model_built")
def test_plan_memory_refuses_a_size_too_large_to_be_finite(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(["plan-memory", "--preset", "tiny", *argv], capsys)
    assert code == 2 and "Traceback" not in err
    flag = argv[-2]
    assert err.splitlines()[-1].startswith(
        f"graphswap plan-memory: error: argument {flag}: {message}"
    )


@pytest.mark.parametrize(
    "budget",
    [["activation_memory_budget=1"], ["activation_memory_budget=200GiB", "device=sim:h100"]],
    ids=["no-plan-meets", "above-the-memory"],
)
def test_passes_refuses_the_budgets_train_refuses_alike(
    budget: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """One check, the swap pass's plan of the model built on meta, for both commands."""
    overrides = ["activation_swap=budget", "num_layers=1", "seq_len=64", *budget]
    passes_code, passes_err = run(["passes", *overrides], capsys)
    train_code, train_err = run(["train", *overrides], capsys)
    assert (passes_code, train_code) == (2, 2)
    reason = passes_err.removeprefix("graphswap passes: error: ")
    assert reason.startswith("activation_memory_budget: ")
    assert reason.count("\n") == 1 and train_err == f"graphswap train: error: {reason}"


def test_passes_says_the_world_size_it_cannot_know(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["passes", "tp_size=2"], capsys)
    assert code == 0
    assert err == (
        "graphswap passes: the world size is not known here (torchrun sets it): tp_size: 2"
        " without fsdp needs exactly 2 ranks; set fsdp: true for more\n"
    )


def test_options_may_follow_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "steps=1", "--no-progress", "num_layers=1", f"output_dir={tmp_path}"]
    code, err = run(argv, capsys)
    assert code == 0, err
    assert (tmp_path / "summary.json").is_file()
    assert err == ""


def config_folder(tmp_path: Path, config: object) -> str:
    """A checkpoint folder of ``config`` whose weights file is never read: the command
    must refuse it before loading them."""
    folder = tmp_path / "ckpt"
    config.save_pretrained(folder)  # type: ignore[attr-defined]
    (folder / "model.safetensors").write_bytes(b"")
    return str(folder)


@pytest.mark.parametrize(
    ("family", "argv", "message"),
    [
        (
            "jamba",
            ["train", "activation_swap=attention"],
            "activation_swap: attention: attn_swap: 'model.layers.0' holds no",
        ),
        ("gpt2", ["train", "activation_swap=layer"], "activation_swap: layer: rule 'layer_swap'"),
        (
            "jamba",
            ["passes", "activation_swap=attention"],
            "activation_swap: attention: attn_swap: 'model.layers.0' holds no",
        ),
        ("gpt2", ["passes", "activation_swap=layer"], "activation_swap: layer: rule 'layer_swap'"),
        (
            "jamba",
            ["plan-memory", "--seq-len", "8", "--activation-swap", "attention"],
            "--activation-swap attention: attn_swap: 'model.layers.0' holds no",
        ),
        (
            "gpt2",
            ["plan-memory", "--seq-len", "8"],
            "--model {folder}: GPT2LMHeadModel must hold exactly one decoder layer list",
        ),
        (
            "mamba",
            ["plan-memory", "--seq-len", "8"],
            "--attn-implementation sdpa: MambaForCausalLM runs eager attention only",
        ),
        (
            "mamba",
            ["plan-memory", "--seq-len", "8", "--attn-implementation", "eager"],
            "--activation-swap attention: rule 'attn_swap' found no decoder attention",
        ),
    ],
)
def test_a_model_the_swap_rule_refuses_is_refused_by_every_command(
    family: str,
    argv: list[str],
    message: str,
    tmp_path: Path,
    tour_config: Callable[..., object],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What attn_swap or layer_swap refuse (a hybrid stack's attention, a model without a
    decoder layer list) every command refuses with the rule's reason, one line, exit 2;
    plan-memory never plans it."""
    folder = config_folder(tmp_path, tour_config(family))
    source = ["--model", folder] if argv[0] == "plan-memory" else [f"model_path={folder}"]
    code, err = run([*argv, *source], capsys)
    assert code == 2, err
    assert err.startswith(f"graphswap {argv[0]}: error: {message.format(folder=folder)}"), err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("command", ["train", "passes"])
@pytest.mark.usefixtures("no_model_built")
def test_a_config_file_given_twice_is_refused(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse would keep the second --config and drop the first without a word."""
    path = yaml_file(tmp_path)
    code, err = run([command, "--config", path, "--config", path], capsys)
    assert code == 2
    assert err.splitlines()[-1] == (
        f"graphswap {command}: error: --config {path}: given twice (first {path}); give it once"
    )


@pytest.mark.usefixtures("no_model_built")
def test_plan_memory_sdpa_on_an_eager_only_family(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan-memory", "--preset", "tiny-gpt-oss", "--seq-len", "8"]
    code, err = run([*argv, "--attn-implementation", "sdpa"], capsys)
    assert code == 2
    assert err == (
        "graphswap plan-memory: error: --attn-implementation sdpa: GptOssForCausalLM runs"
        " eager attention only in this transformers; use eager\n"
    )
