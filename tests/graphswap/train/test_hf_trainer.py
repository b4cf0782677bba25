"""A rewritten model under ``transformers.Trainer``, as users train it: the same losses
and saved weights as the model without swap, and a checkpoint that loads into a
plain ``Qwen3MoeForCausalLM`` (the swap classes never reach the files)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import Qwen3MoeForCausalLM, Trainer, TrainingArguments
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

import graphswap
from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import qwen3_moe_config

STEPS = 5
SEQ = 256
"""Long enough that each layer's eager attention probabilities (1 MiB for one sequence)
pass the swap policy."""


def dataset() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 512, (SEQ,), generator=gen) for _ in range(STEPS)]
    return [{"input_ids": ids, "labels": ids} for ids in rows]


def model() -> nn.Module:
    torch.manual_seed(0)
    return build_model(qwen3_moe_config("tiny", num_hidden_layers=2))


def fit(net: nn.Module, out: Path) -> tuple[list[float], Path]:
    """Losses per step and the last checkpoint folder."""
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=1,
        learning_rate=1e-3,
        logging_steps=1,
        save_steps=STEPS,
        seed=0,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=net, args=args, train_dataset=dataset())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, out / f"checkpoint-{STEPS}"


def test_hf_trainer_trains_a_rewritten_model_like_the_plain_one(tmp_path: Path) -> None:
    plain_losses, plain_checkpoint = fit(model(), tmp_path / "plain")
    swapped = model()
    report = graphswap.rewrite(swapped, "qwen3_attn_swap")
    losses, checkpoint = fit(swapped, tmp_path / "swapped")

    assert len(losses) == STEPS and losses == plain_losses
    assert report.manager.stats.offloaded_bytes > 0, "the swap moved nothing"
    saved = load_file(checkpoint / "model.safetensors")
    expected = load_file(plain_checkpoint / "model.safetensors")
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[key], expected[key]) for key in saved)

    loaded = Qwen3MoeForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    assert {type(layer.self_attn) for layer in loaded.model.layers} == {Qwen3MoeAttention}
    trained = swapped.state_dict()
    assert loaded.state_dict().keys() == trained.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
