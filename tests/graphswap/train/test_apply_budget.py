"""Budget mode in one call under the trainers users run: ``SFTTrainer`` with ``SFTConfig``'s
defaults (gradient checkpointing on) and ``transformers.Trainer`` with checkpointing on
train bit for bit like the same runs without graphswap, the trainer's checkpointing
honoured as whole layers recomputed inside the swap, never twice."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import graphswap
from graphswap.errors import SwapExclusionError
from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import preset_config
from graphswap.train.budget import apply_budget
from graphswap.train.config import ConfigError

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

STEPS, BATCH, SEQ = 2, 2, 256
BUDGET = "1GiB"
"""Far above the tiny models' peak: with the trainer's checkpointing the plan recomputes
whole layers whatever the budget; without it, it recomputes nothing."""

CHECKPOINTING = (
    "activation_checkpointing"
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(trl.SFTConfig)}
    else "gradient_checkpointing"
)
"""transformers 5.23 renamed TrainingArguments' gradient_checkpointing; the old name warns."""


def tokenizer() -> Any:
    """A word-level tokenizer built in memory: SFTTrainer wants one, nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(254)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")


def rows() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, 256, (SEQ,), generator=gen).tolist() for _ in range(STEPS * BATCH)]


def model(preset: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(preset_config(preset))


def sft_args(out: Path) -> Any:
    """SFTConfig's defaults (gradient checkpointing on, TRL's fused head), but what a tiny
    CPU run needs: two steps of two ``SEQ``-token rows (``max_length`` the rows' length,
    so the plan is the step's shape; the plain run truncates nothing either), every loss
    logged, nothing saved or reported. SFTConfig's bf16 autocast stays on (even on CPU):
    the plan is made for it."""
    return trl.SFTConfig(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        max_length=SEQ,
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
    )


Run = tuple[list[float], dict[str, torch.Tensor]]


def sft(
    net: torch.nn.Module,
    args: Any,
    prepare: Callable[[Any], None] | None = None,
    peft_config: Any = None,
) -> tuple[Run, Any]:
    """The losses and final parameters of ``args``' SFTTrainer run, and the trainer;
    ``prepare`` is given the trainer before it trains."""
    trainer = trl.SFTTrainer(
        model=net,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"input_ids": rows()}),
        processing_class=tokenizer(),
        peft_config=peft_config,
    )
    if prepare is not None:
        prepare(trainer)
    trainer.train()
    return _finished(trainer), trainer


def _finished(trainer: Any) -> Run:
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return losses, params


def _checkpointed(net: torch.nn.Module) -> bool:
    """Hugging Face's own checkpointing is on in some module."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in net.modules())


def assert_same(run: Run, plain: Run) -> None:
    losses, params = run
    assert len(losses) == STEPS and losses == plain[0]
    assert params.keys() == plain[1].keys()
    assert all(torch.equal(params[name], plain[1][name]) for name in params)


def assert_recomputed_whole_layers(result: Any) -> None:
    """The plan recomputes every whole layer, the step ran it (the recomputed bytes of
    two steps), and every save matched the plan."""
    plan = result.plan_executor.plan
    assert plan.recompute == ("layer",) and plan.loss_head in ("trl", "full")
    stats = result.report.manager.stats
    assert stats.recomputed_bytes == STEPS * plan.recomputed_bytes > 0
    assert stats.offloaded_bytes == STEPS * plan.swapped_bytes
    result.plan_executor.check()


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Per preset, the SFTTrainer run without graphswap, its checkpointing on (once)."""
    runs = {}
    for preset in ("tiny-llama", "tiny"):
        run, trainer = sft(model(preset), sft_args(tmp_path_factory.mktemp(preset)))
        assert _checkpointed(trainer.model), "SFTConfig's default checkpointing ran"
        runs[preset] = run
    return runs


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny"])
def test_sft_trainer_defaults_train_a_budget_plan_like_the_plain_run(
    preset: str, plain: dict[str, Run], tmp_path: Path, one_thread: None
) -> None:
    """Llama and Qwen3-MoE: one call before the trainer is built, planned from its
    arguments; the trainer's checkpointing becomes the plan's whole-layer recompute
    (Hugging Face's stays off, else the swap would refuse to run under it), and losses and
    parameters are bitwise those of TRL's own checkpointed run, under SFTConfig's bf16
    autocast as planned (no mismatch: ``check()`` passes)."""
    net = model(preset)
    args = sft_args(tmp_path)
    result = apply_budget(net, BUDGET, args)
    assert result.plan_executor.plan.loss_head == "trl"
    assert result.plan_executor.plan.autocast_dtype == "bfloat16"  # SFTConfig's bf16
    assert "seq_len: 256, batch_size: 2" in result.plan_executor.made_for
    run, trainer = sft(net, args)
    assert not _checkpointed(trainer.model)
    assert_same(run, plain[preset])
    assert_recomputed_whole_layers(result)


def test_applied_to_the_model_the_trainer_holds_it_plans_trls_head_and_trains_the_same(
    plain: dict[str, Run], tmp_path: Path, one_thread: None
) -> None:
    """The other order: after SFTTrainer is built (its fused head installed), before it
    trains, with the trainer's own model and arguments."""
    applied: list[Any] = []

    def budget(trainer: Any) -> None:
        applied.append(apply_budget(trainer.model, BUDGET, trainer.args))

    run, _ = sft(model("tiny-llama"), sft_args(tmp_path), prepare=budget)
    assert_same(run, plain["tiny-llama"])
    [result] = applied
    assert result.plan_executor.plan.loss_head == "trl"
    assert_recomputed_whole_layers(result)


LORA_TARGETS = {
    "tiny-llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "tiny": ("q_proj", "k_proj", "v_proj", "o_proj"),
}
"""Every projection of Llama; Qwen3-MoE's attention (PEFT adapts its fused experts as
parameters, which the planner refuses rather than models)."""


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny"])
def test_sft_trainer_defaults_with_peft_config_train_a_budget_plan_like_the_plain_run(
    preset: str, tmp_path: Path, one_thread: None
) -> None:
    """SFTConfig's defaults with ``peft_config`` (rank 8): the one call on the PeftModel
    the trainer holds plans its LoRA step (the adapters' state, TRL's head inside it),
    honours the trainer's checkpointing as whole layers recomputed, and the adapters
    train bit for bit like TRL's own checkpointed LoRA run."""
    peft = pytest.importorskip("peft")

    def lora() -> Any:
        return peft.LoraConfig(r=8, target_modules=list(LORA_TARGETS[preset]))

    plain, _ = sft(model(preset), sft_args(tmp_path / "plain"), peft_config=lora())
    applied: list[Any] = []

    def budget(trainer: Any) -> None:
        applied.append(apply_budget(trainer.model, BUDGET, trainer.args))

    run, trainer = sft(model(preset), sft_args(tmp_path), prepare=budget, peft_config=lora())
    assert not _checkpointed(trainer.model)
    assert_same(run, plain)
    [result] = applied
    assert (result.plan_executor.plan.lora_rank, result.plan_executor.plan.loss_head) == (8, "trl")
    assert_recomputed_whole_layers(result)


def test_hf_trainer_with_checkpointing_trains_a_budget_plan_like_the_plain_run(
    tmp_path: Path, one_thread: None
) -> None:
    """transformers.Trainer, checkpointing on: its arguments name no sequence length, so
    the call is given one; the model's own head is planned."""
    from transformers import Trainer, TrainingArguments

    def fit(net: torch.nn.Module, out: Path, budget: bool) -> Run:
        args = TrainingArguments(
            output_dir=str(out),
            max_steps=STEPS,
            per_device_train_batch_size=BATCH,
            logging_steps=1,
            save_strategy="no",
            use_cpu=True,
            report_to=[],
            disable_tqdm=True,
            **{CHECKPOINTING: True},
        )
        if budget:
            result = apply_budget(net, BUDGET, args, seq_len=SEQ)
            assert result.plan_executor.plan.loss_head == "full"
        data = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r)} for r in rows()]
        trainer = Trainer(model=net, args=args, train_dataset=data)
        trainer.train()
        assert _checkpointed(trainer.model) is not budget
        if budget:
            assert_recomputed_whole_layers(result)
        return _finished(trainer)

    assert_same(
        fit(model("tiny-llama"), tmp_path / "budget", True),
        fit(model("tiny-llama"), tmp_path / "plain", False),
    )


def test_a_later_request_to_checkpoint_a_plan_made_without_it_is_refused() -> None:
    """Without the trainer's arguments the budget chooses (here: no recompute); the
    trainer's later call to checkpoint would need another plan, so it is refused, naming
    the fix, and Hugging Face's checkpointing stays off."""
    net = model("tiny-llama")
    result = apply_budget(net, BUDGET, seq_len=SEQ, batch_size=BATCH)
    assert result.plan_executor.plan.recompute == ()
    with pytest.raises(SwapExclusionError) as info:
        getattr(net, f"{CHECKPOINTING}_enable")()
    message = str(info.value)
    assert "apply_budget(model, budget, args)" in message
    assert "activation_checkpointing=False" in message
    assert not _checkpointed(net)


def test_checkpointing_already_on_is_taken_over_and_given_back_on_unrewrite() -> None:
    """A model whose checkpointing is on already is planned with whole layers recomputed
    and Hugging Face's checkpointing turned off; undone, the model's own switch works
    again."""
    net = model("tiny-llama")
    enable = f"{CHECKPOINTING}_enable"
    getattr(net, enable)()
    result = apply_budget(net, BUDGET, seq_len=SEQ, batch_size=BATCH)
    assert result.plan_executor.plan.recompute == ("layer",)
    assert "activation_checkpointing: true" in result.plan_executor.made_for
    assert not _checkpointed(net)
    getattr(net, enable)({"use_reentrant": False})  # honoured by the plan: nothing set
    assert not _checkpointed(net)
    graphswap.unrewrite(net)
    getattr(net, enable)()
    assert _checkpointed(net)
    assert enable not in net.__dict__


@pytest.mark.parametrize(
    ("options", "refused"),
    [({"every_n_layers": 2}, "every_n_layers=2"), ({"selective": True}, "selective=True")],
)
def test_checkpointing_options_the_plan_cannot_honour_are_refused(
    options: dict[str, Any], refused: str, tmp_path: Path
) -> None:
    """Checkpointing of some layers only, or TRL's selective checkpointing, is not what
    budget mode runs in its place: refused before anything changes."""
    net = model("tiny-llama")
    args = dataclasses.replace(sft_args(tmp_path), **{f"{CHECKPOINTING}_kwargs": options})
    with pytest.raises(ConfigError, match=refused) as info:
        apply_budget(net, BUDGET, args)
    assert "_checkpointing_kwargs" in str(info.value)
    assert graphswap.rewrite_report(net) is None


def test_settings_for_other_passes_are_refused() -> None:
    with pytest.raises(ConfigError, match="fsdp: apply_budget plans the swap alone"):
        apply_budget(model("tiny-llama"), BUDGET, seq_len=SEQ, batch_size=BATCH, fsdp=True)
