"""A rewritten model under TRL's ``SFTTrainer``, as users fine-tune long contexts: the
same losses as the ``SFTTrainer`` run without swap, and a clear refusal of what would
handle the swapped tensors a second time (TRL's default gradient checkpointing, its
activation offloading)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import graphswap
from graphswap.errors import SwapExclusionError
from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import preset_config
from graphswap.passes.plan_executor import PlanMismatchWarning
from graphswap.rewriting.apply import rewrite_report
from graphswap.train.build import from_config
from graphswap.train.config import TrainerConfig

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

STEPS, BATCH, SEQ = 2, 2, 256
"""Eager attention probabilities of 4 heads at 256 tokens are 1 MiB per sequence: the
attention and every layer pass the swap threshold."""

RULES = {"attention": "attn_swap", "layer": "layer_swap"}


def tokenizer() -> Any:
    """A word-level tokenizer built in memory: SFTTrainer wants one, nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(254)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")


def dataset() -> Any:
    """Tokenized rows (SFTTrainer takes ``input_ids`` as they are)."""
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(2, 256, (SEQ,), generator=gen).tolist() for _ in range(STEPS * BATCH)]
    return datasets.Dataset.from_dict({"input_ids": rows})


def model(preset: str, mode: str) -> torch.nn.Module:
    """``preset`` built from its config, rewritten for ``mode`` (``auto`` planned for
    this shape, on a link fast enough that it swaps)."""
    torch.manual_seed(0)
    config = preset_config(preset)
    if mode == "auto":
        planned = TrainerConfig(
            activation_swap="auto", seq_len=SEQ, batch_size=BATCH, swap_bandwidth_gbps=1e6
        )
        return from_config(config, trainer_config=planned)
    net = build_model(config)
    if mode != "none":
        graphswap.rewrite(net, RULES[mode])
    return net


CHECKPOINTING = (
    "activation_checkpointing"
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(trl.SFTConfig)}
    else "gradient_checkpointing"
)
"""transformers 5.23 renamed TrainingArguments' gradient_checkpointing (which TRL's
SFTConfig turns on by default); the old name warns."""


def sft(
    net: torch.nn.Module,
    out: Path,
    *,
    checkpointing: bool | None = False,
    prepare: Callable[[Any], None] | None = None,
    peft_config: Any = None,
    **settings: Any,
) -> list[float]:
    """The losses of ``STEPS`` SFTTrainer steps; ``checkpointing`` None keeps TRL's
    default, ``prepare`` is given the trainer before it trains, ``peft_config`` is
    SFTTrainer's (a LoRA fine-tune), ``settings`` override other SFTConfig values."""
    if checkpointing is not None:
        settings[CHECKPOINTING] = checkpointing
    args = trl.SFTConfig(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        **settings,
    )
    trainer = trl.SFTTrainer(
        model=net,
        args=args,
        train_dataset=dataset(),
        processing_class=tokenizer(),
        peft_config=peft_config,
    )
    if prepare is not None:
        prepare(trainer)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.fixture(scope="module")
def plain_fp32(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The SFTTrainer run of tiny-llama without swap and without autocast (``bf16=False``),
    which the plans made for float32 are compared with (computed once)."""
    return sft(model("tiny-llama", "none"), tmp_path_factory.mktemp("plain-fp32"), bf16=False)


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    """Per preset, the SFTTrainer run without swap (computed once)."""
    return {
        preset: sft(model(preset, "none"), tmp_path_factory.mktemp(preset))
        for preset in ("tiny", "tiny-llama")
    }


@pytest.mark.parametrize("mode", ["attention", "layer", "auto"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_sft_trainer_trains_a_rewritten_model_like_the_plain_one(
    preset: str,
    mode: str,
    plain_losses: dict[str, list[float]],
    tmp_path: Path,
    one_thread: None,
) -> None:
    """Qwen3-MoE (``tiny``) and Llama under SFTConfig's defaults but checkpointing (bf16
    autocast included): bit-for-bit the losses of the run without swap. An auto plan
    made for float32 meets bfloat16 saves there: each stays on device, warned about."""
    net = model(preset, mode)
    if mode == "auto":
        with pytest.warns(PlanMismatchWarning, match="bfloat16, but the plan expects"):
            losses = sft(net, tmp_path)
    else:
        losses = sft(net, tmp_path)
    assert len(losses) == STEPS and losses == plain_losses[preset]
    report = rewrite_report(net)
    assert report is not None and report.manager.stats.offloaded_bytes > 0


def test_an_auto_plan_of_the_dtype_sft_trainer_runs_swaps_as_planned(
    plain_fp32: list[float], tmp_path: Path
) -> None:
    """auto plans for the parameters' dtype; SFTConfig's default bf16 autocast saves
    bfloat16 instead (a mismatch, counted and warned about), so a float32 plan trains
    with bf16=False: every planned save is met, and the losses are the plain run's."""
    net = model("tiny-llama", "auto")
    assert sft(net, tmp_path / "auto", bf16=False) == plain_fp32
    report = rewrite_report(net)
    assert report is not None and report.manager.stats.offloaded_bytes > 0
    report.check()


def test_trls_default_gradient_checkpointing_is_refused_naming_the_setting(
    tmp_path: Path,
) -> None:
    """SFTConfig turns gradient_checkpointing on by default; it would recompute what the
    swap copied, so the first wrapped forward says what to set."""
    net = model("tiny-llama", "layer")
    with pytest.raises(SwapExclusionError) as info:
        sft(net, tmp_path, checkpointing=None)
    message = str(info.value)
    assert "excludes activation_checkpointing: 'model.layers.0'" in message
    assert "gradient_checkpointing=False" in message and "SFTConfig" in message
    assert "activation_swap: budget" in message and "apply_budget(model, budget, args)" in message


def test_trls_activation_offloading_on_a_rewritten_model_is_refused() -> None:
    """Two offloaders on one model: TRL's hooks (built as SFTTrainer builds them with
    activation_offloading=True; on CPU only without streams, and TRL asks for an
    accelerator) around a rewritten model are refused at its first wrapped forward."""
    from trl.models.activation_offloading import OffloadActivations

    net = model("tiny-llama", "layer")
    ids = torch.randint(2, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    cpu = mock.patch.object(
        torch.accelerator, "current_accelerator", lambda *_: torch.device("cpu")
    )
    with cpu:
        offloading = OffloadActivations(use_pin_memory=False, use_streams=False)
    with offloading, pytest.raises(SwapExclusionError) as info:
        net(input_ids=ids, labels=ids)
    message = str(info.value)
    assert "excludes activation_offloading: 'model.layers.0' ran under TRL's activation" in message
    assert "activation_offloading=False" in message


def test_sft_trainer_trains_a_budget_plan_that_recomputes_whole_layers(
    plain_fp32: list[float], tmp_path: Path
) -> None:
    """activation_swap: budget under SFTTrainer (its own gradient checkpointing off:
    graphswap owns recompute), at the smallest budget any plan meets: every layer
    recomputed inside its swap, the losses of the plain run, and the bytes recomputed
    and swapped that the plan says."""
    from graphswap.planning import PlanSettingError

    config = preset_config("tiny-llama")

    def planned(budget: int) -> Any:
        return _planned(config, activation_swap="budget", activation_memory_budget=budget)

    with pytest.raises(PlanSettingError) as info:
        planned(1)
    budget = info.value.smallest.peak_bytes  # type: ignore[attr-defined]
    plan = planned(budget)
    assert plan.recompute == ("layer",)
    torch.manual_seed(0)
    net = from_config(
        config,
        trainer_config=TrainerConfig(
            activation_swap="budget",
            activation_memory_budget=budget,
            seq_len=SEQ,
            batch_size=BATCH,
        ),
    )
    assert sft(net, tmp_path / "budget", bf16=False) == plain_fp32
    report = rewrite_report(net)
    assert report is not None
    stats = report.manager.stats
    assert stats.recomputed_bytes == STEPS * plan.recomputed_bytes > 0  # the plan is a step's
    assert stats.offloaded_bytes == STEPS * plan.swapped_bytes
    report.check()


def _planned(
    config: Any,
    activation_swap: str,
    activation_memory_budget: int | None = None,
    **shape: Any,
) -> Any:
    """``config``'s plan of the step these tests run: ``SEQ`` x ``BATCH`` in fp32 on CPU,
    with ``shape``'s other settings of the step (the head, LoRA's)."""
    from graphswap.planning import plan_memory
    from graphswap.planning.trace import StepShape

    step = StepShape(
        seq_len=SEQ,
        batch_size=BATCH,
        dtype=torch.float32,
        attn_implementation=config._attn_implementation,
        device="cpu",
        **shape,
    )
    return plan_memory(
        config,
        step,
        activation_swap=activation_swap,
        activation_memory_budget=activation_memory_budget,
    )


def test_a_plan_for_sft_trainer_counts_trls_head_as_it_runs(
    plain_fp32: list[float], tmp_path: Path, clocked_step: Callable[..., Any]
) -> None:
    """SFTTrainer scores tokens with TRL's fused head, never the full logits: a plan for
    ``loss_head: trl`` traces TRL's own head, whose peak is the clocked run's; a model
    graphswap builds for it installs nothing (SFTTrainer does) and trains bitwise like
    the plain one under SFTTrainer."""
    from graphswap.train.build import build

    config = preset_config("tiny-llama")
    plans = {
        head: _planned(config, activation_swap="none", loss_head=head) for head in ("full", "trl")
    }
    torch.manual_seed(0)
    fused = build_model(config)
    trl.trainer.utils.add_fused_lm_head(fused, outputs=("log_probs", "entropy", "is_top1"))
    ids = torch.randint(2, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    measured = clocked_step(fused, ids, fused_lm_head=True).peak_bytes
    assert plans["trl"].loss_head == "trl"
    assert plans["trl"].timeline.peak_bytes == pytest.approx(measured, rel=0.03)
    assert plans["trl"].timeline.peak_bytes != plans["full"].timeline.peak_bytes
    trainer_config = TrainerConfig(
        activation_swap="budget",
        activation_memory_budget=plans["trl"].timeline.peak_bytes,
        loss_head="trl",
        seq_len=SEQ,
        batch_size=BATCH,
    )
    torch.manual_seed(0)
    built = build(trainer_config, hf_config=config)
    assert built.plan_executor is not None and built.plan_executor.plan.loss_head == "trl"
    assert "loss_head: trl" in built.plan_executor.made_for
    assert sft(built.model, tmp_path / "planned", bf16=False) == plain_fp32
    built.plan_executor.check()


def test_a_model_sft_trainer_holds_is_planned_for_its_head_unasked(
    plain_fp32: list[float], tmp_path: Path
) -> None:
    """The passes applied to the model an SFTTrainer already holds (its fused head
    installed) plan TRL's head without being told, and it trains bitwise like the plain
    run."""
    from graphswap.passes import apply_model_infrastructure

    config = preset_config("tiny-llama")
    budget = _planned(config, activation_swap="none", loss_head="trl").timeline.peak_bytes
    applied: list[Any] = []

    def rewrite(trainer: Any) -> None:
        settings = TrainerConfig(
            activation_swap="budget", activation_memory_budget=budget, seq_len=SEQ, batch_size=BATCH
        )
        applied.append(apply_model_infrastructure(trainer.model, settings))

    torch.manual_seed(0)
    losses = sft(build_model(config), tmp_path / "planned", bf16=False, prepare=rewrite)
    assert losses == plain_fp32
    [result] = applied
    assert result.plan_executor is not None and result.plan_executor.plan.loss_head == "trl"
    assert "loss_head: trl" in result.plan_executor.made_for
    result.plan_executor.check()


LORA_TARGETS = {
    "tiny-llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "tiny": ("q_proj", "k_proj", "v_proj", "o_proj"),
}
"""Every projection of Llama; Qwen3-MoE's attention (PEFT adapts its fused experts as
parameters, which the planner does not model)."""
LORA = {"lora_rank": 8}


def lora_config(preset: str) -> Any:
    """SFTTrainer's ``peft_config``: rank 8 on ``preset``'s :data:`LORA_TARGETS`."""
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=8, target_modules=list(LORA_TARGETS[preset]))


@pytest.fixture(scope="module")
def plain_lora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    """Per preset, the fp32 SFTTrainer LoRA run without swap (computed once)."""
    return {
        preset: sft(
            model(preset, "none"),
            tmp_path_factory.mktemp(f"lora-{preset}"),
            bf16=False,
            peft_config=lora_config(preset),
        )
        for preset in LORA_TARGETS
    }


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_sft_trainer_with_peft_config_trains_a_budget_plan_like_the_plain_lora_run(
    preset: str, plain_lora: dict[str, list[float]], tmp_path: Path
) -> None:
    """SFTTrainer wraps the model with PEFT (peft_config); the passes applied to the
    PeftModel it holds plan its LoRA step unasked, at the smallest budget any plan of
    that step meets (SFTTrainer's config: Qwen3-MoE's router logits on): the losses of
    the plain LoRA run, bit for bit, and the bytes the plan says."""
    from graphswap.hf.lora import lora_settings
    from graphswap.passes import apply_model_infrastructure
    from graphswap.planning import PlanSettingError

    applied: list[Any] = []

    def rewrite(trainer: Any) -> None:
        step = lora_settings(trainer.model)
        assert step is not None and step["lora_rank"] == 8 and step["lora_dropout"] == 0
        assert sorted(step["lora_target_modules"]) == sorted(LORA_TARGETS[preset])
        with pytest.raises(PlanSettingError) as info:
            _planned(
                trainer.model.config,
                activation_swap="budget",
                activation_memory_budget=1,
                loss_head="trl",
                **step,
            )
        budget = info.value.smallest.peak_bytes  # type: ignore[attr-defined]
        settings = TrainerConfig(
            activation_swap="budget", activation_memory_budget=budget, seq_len=SEQ, batch_size=BATCH
        )
        applied.append(apply_model_infrastructure(trainer.model, settings))

    torch.manual_seed(0)
    losses = sft(
        build_model(preset_config(preset)),
        tmp_path,
        bf16=False,
        prepare=rewrite,
        peft_config=lora_config(preset),
    )
    assert losses == plain_lora[preset]
    [result] = applied
    plan = result.plan_executor.plan
    assert plan.lora_rank == 8 and plan.loss_head == "trl" and plan.recompute
    assert "lora_rank: 8" in result.plan_executor.made_for
    stats = result.report.manager.stats
    assert stats.recomputed_bytes == STEPS * plan.recomputed_bytes > 0
    assert stats.offloaded_bytes == STEPS * plan.swapped_bytes
    result.plan_executor.check()


def test_a_lora_plan_counts_the_adapters_state_and_peaks_as_the_clocked_peft_step(
    clocked_step: Callable[..., Any],
) -> None:
    """A plan of the LoRA step holds AdamW state for the adapters alone, and its peak is
    the clocked run's of a PeftModel under TRL's head (within 3%), below the plan of full
    fine-tuning."""
    from graphswap.planning._trace import storage_bytes

    peft = pytest.importorskip("peft")
    config = preset_config("tiny-llama")
    targets = LORA_TARGETS["tiny-llama"]
    full = _planned(config, activation_swap="none", loss_head="trl")
    lora = _planned(
        config, activation_swap="none", loss_head="trl", lora_target_modules=targets, **LORA
    )
    torch.manual_seed(0)
    net = build_model(config)
    trl.trainer.utils.add_fused_lm_head(net, outputs=("log_probs", "entropy", "is_top1"))
    net = peft.get_peft_model(net, lora_config("tiny-llama"))
    adapters = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
    ids = torch.randint(2, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    measured = clocked_step(net, ids, fused_lm_head=True).peak_bytes
    assert lora.timeline.peak_bytes == pytest.approx(measured, rel=0.03)
    assert lora.timeline.peak_bytes < full.timeline.peak_bytes
    held = storage_bytes([*net.parameters(), *net.buffers()])
    assert lora.timeline.base_bytes == held + 2 * adapters  # AdamW's moments: the adapters'
    assert full.timeline.base_bytes > held + 2 * adapters
