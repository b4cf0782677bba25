import json

import pytest
import torch

from graphswap.hf.checkpoints import CheckpointError, build_model
from graphswap.hf.presets import qwen3_moe_config
from graphswap.passes import PassRequirementError
from graphswap.train.config import ConfigError, TrainerConfig
from graphswap.train.preflight import check_model, check_world
from graphswap.train.trainer import (
    TrainResult,
    _Run,
    format_summary,
    state_bytes,
    token_batches,
    train,
    train_side_by_side,
    write_summary,
)

FAST = {"num_layers": 2, "seq_len": 256, "steps": 3}


@pytest.mark.parametrize(
    ("attn_implementation", "seq_len"),
    [("sdpa", 512), ("eager", 256)],
)
def test_swap_changes_no_loss_and_lowers_resident_activations(
    attn_implementation: str, seq_len: int
) -> None:
    # The shortest sequence at which each attention saves tensors of the 1 MiB swap threshold;
    # two steps: the second runs on weights the first updated.
    run = {**FAST, "attn_implementation": attn_implementation, "seq_len": seq_len, "steps": 2}
    none = train(TrainerConfig(**run), progress=False)
    swap = train(TrainerConfig(activation_swap="attention", **run), progress=False)
    assert len(swap.losses) == 2 and swap.losses == none.losses
    offloaded = swap.swap["per_group"]["model.layers.0.self_attn"]["offloaded_bytes"] / 2
    assert offloaded > 0
    assert none.peak_memory_bytes - swap.peak_memory_bytes == pytest.approx(offloaded, rel=0.01)
    assert swap.applied_passes == ["swap"] and none.applied_passes == []
    # Trained as transformers.Trainer calls a model: no cache holds what was copied.
    assert swap.swap["offloaded_not_freed_bytes"] == 0
    rows = dict(
        line.split("  ", 1) for line in format_summary([none, swap]).splitlines() if "  " in line
    )
    assert rows["swap copied, not freed / step"].split() == ["0.0", "MiB", "0.0", "MiB"]
    budget = swap.swap["max_host_bytes"]
    assert rows["host pool peak / budget"].split()[-2:] == [f"{budget / 2**20:,.1f}", "MiB"]


def test_summary_is_side_by_side_and_written(tmp_path) -> None:
    results = [train(TrainerConfig(**{**FAST, "steps": 1}), progress=False)]
    text = format_summary(results)
    assert "loss first" in text and "tokens/s" in text
    path = write_summary(results, str(tmp_path / "out"))
    assert json.loads(path.read_text())[0]["activation_swap"] == "none"


def test_text_data_is_read_byte_level(tmp_path) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text("graphswap " * 100)
    batch = next(token_batches(TrainerConfig(data=str(data), seq_len=16), 512, "cpu"))
    assert batch.shape == (2, 16)
    assert set(batch.flatten().tolist()) <= set(b"graphswap ")


def test_missing_or_short_data_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^data: no file at"):
        next(token_batches(TrainerConfig(data=str(tmp_path / "nope.txt")), 512, "cpu"))
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ConfigError, match=r"^data: .* has 3 bytes.*seq_len=16"):
        next(token_batches(TrainerConfig(data=str(short), seq_len=16), 512, "cpu"))


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-mixtral"])
def test_model_path_trains_from_the_checkpoint_weights(
    tmp_path, preset: str, family_config, one_thread
) -> None:
    """The family is the one config.json names (Qwen3-MoE, a dense and a MoE other)."""
    torch.manual_seed(123)  # not the trainer's seed: a random init cannot match
    hf_config = family_config(preset, "sdpa")
    hf_config.num_hidden_layers = 2
    checkpoint = build_model(hf_config)
    checkpoint.save_pretrained(tmp_path)
    config = TrainerConfig(model_path=str(tmp_path), seq_len=64, steps=1)
    ids = next(token_batches(config, checkpoint.config.vocab_size, "cpu"))
    expected = checkpoint(input_ids=ids, labels=ids, use_cache=False).loss.item()
    assert train(config, progress=False).losses == [expected]


def test_model_path_with_more_layers_than_saved_is_refused(tmp_path) -> None:
    build_model(qwen3_moe_config("tiny", num_hidden_layers=1)).save_pretrained(tmp_path)
    config = TrainerConfig(model_path=str(tmp_path), num_layers=2, seq_len=64, steps=1)
    with pytest.raises(CheckpointError, match=r"does not hold model\.layers\.1\."):
        train(config, progress=False)


def test_sdpa_on_a_family_that_runs_eager_only_is_refused_by_key() -> None:
    pytest.importorskip("transformers.models.gpt_oss")
    with pytest.raises(ConfigError, match=r"^attn_implementation: sdpa: GptOssForCausalLM runs"):
        check_model(TrainerConfig(model="tiny-gpt-oss", attn_implementation="sdpa"))


def test_several_ranks_need_a_pass_that_keeps_them_one_model() -> None:
    with pytest.raises(PassRequirementError, match=r"^tp_size: 1 and fsdp: false on a world of 2"):
        check_world(TrainerConfig(), 2)
    check_world(TrainerConfig(fsdp=True), 2)
    check_world(TrainerConfig(tp_size=2), 2)


def test_side_by_side_runs_interleave_step_by_step_in_turn(monkeypatch) -> None:
    order: list[str] = []
    step = _Run.step

    def recorded(run: _Run) -> None:
        order.append(run.config.activation_swap)
        step(run)

    monkeypatch.setattr(_Run, "step", recorded)
    configs = [TrainerConfig(**FAST), TrainerConfig(activation_swap="attention", **FAST)]
    none, swap = train_side_by_side(configs, progress=False)
    assert FAST["steps"] == 3
    assert order == ["none", "attention", "attention", "none", "none", "attention"]
    assert none.losses == swap.losses


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_summary_prints_the_share_of_saved_activations_swapped(attn: str) -> None:
    fast = {**FAST, "steps": 1, "attn_implementation": attn}
    none, swap = train_side_by_side(
        [TrainerConfig(**fast), TrainerConfig(activation_swap="attention", **fast)],
        progress=False,
    )
    row = next(line for line in format_summary([none, swap]).splitlines() if "swapped **" in line)
    moved = none.resident_activation_bytes - swap.resident_activation_bytes
    share = moved / none.resident_activation_bytes
    assert row.split()[-2:] == ["0.0%", f"{share:.1%}"]
    assert moved == swap.swap["offloaded_bytes"]
    if attn == "eager":
        # The softmax output of the one layer not kept on device: batch x heads x seq^2, fp32.
        heads = qwen3_moe_config("tiny").num_attention_heads
        batch = TrainerConfig(**fast).batch_size
        probabilities = batch * heads * fast["seq_len"] ** 2 * 4
        assert moved >= probabilities, "the eager attention probabilities are swapped"


def test_step_time_ratio_pairs_the_steps_of_side_by_side_runs() -> None:
    """A load spike that hits both runs' step 2 does not move the ratio."""

    def result(mode: str, seconds: list[float]) -> TrainResult:
        return TrainResult(
            activation_swap=mode,
            attn_implementation="eager",
            device="cpu",
            world_size=1,
            losses=[1.0] * len(seconds),
            step_seconds=seconds,
            tokens_per_second=1.0,
            peak_memory_bytes=0,
            peak_memory_kind="test",
            resident_activation_bytes=0,
        )

    base = result("none", [9.0, 1.0, 4.0, 1.0])
    swap = result("attention", [1.0, 1.1, 4.4, 1.1])
    row = next(line for line in format_summary([base, swap]).splitlines() if "ratio" in line)
    assert row.split()[-2:] == ["1.000", "1.100"]


def test_the_state_a_step_starts_with_leaves_out_the_host_step_counters() -> None:
    """As the planner counts it: parameters, gradients and AdamW's two moments; the step
    counters live on the host, so the clocked simulated peak matches the plan's."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert state_bytes(model, optimizer) == 4 * params  # weights, gradients, two moments
