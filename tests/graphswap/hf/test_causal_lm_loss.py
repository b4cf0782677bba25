"""What the chunked head reads of a Hugging Face causal LM: the targets and the reduction
of ``ForCausalLMLoss`` (the same values, and the same gradient scale, bit for bit), the
logits transform a config names, and why a model has no head to chunk."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphswap.hf.checkpoints import build_model
from graphswap.hf.loss_head import (
    LogitsTransform,
    causal_lm_loss,
    causal_lm_targets,
    head_problem,
    logits_transform,
)
from graphswap.hf.presets import preset_config


@pytest.mark.parametrize("num_items", [None, 50, torch.tensor(50)], ids=["mean", "int", "tensor"])
def test_targets_and_reduction_are_for_causal_lm_losses(num_items: Any) -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 16, 32, generator=gen, requires_grad=True)
    labels = torch.randint(0, 32, (2, 16), generator=gen)
    labels[0, :3] = -100
    want = ForCausalLMLoss(logits, labels, 32, num_items_in_batch=num_items)
    (want_grad,) = torch.autograd.grad(want, logits)
    targets = causal_lm_targets(labels, None, -100)
    assert targets.shape == (32,) and (targets.view(2, 16)[:, -1] == -100).all()
    total = F.cross_entropy(logits.view(-1, 32), targets, reduction="sum")
    got = causal_lm_loss(total, targets, num_items, -100)
    (got_grad,) = torch.autograd.grad(got, logits)
    assert torch.equal(got_grad, want_grad), "the same division scales the gradient alike"
    assert float((abs(got - want) / want).detach()) <= 1e-6


def test_shift_labels_are_taken_as_given() -> None:
    shifted = torch.arange(6).view(2, 3)
    assert torch.equal(causal_lm_targets(torch.zeros(2, 3), shifted, -100), torch.arange(6))


@pytest.mark.parametrize(
    ("model_type", "values", "expected"),
    [
        ("tiny-llama", {}, None),
        ("tiny-gemma3", {"final_logit_softcapping": 30.0}, LogitsTransform(softcap=30.0)),
        ("cohere", {"logit_scale": 0.25}, LogitsTransform(scale=0.25)),
        ("granite", {"logits_scaling": 4}, LogitsTransform(divide=4.0)),
    ],
)
def test_the_transform_is_the_configs(
    model_type: str, values: dict[str, Any], expected: LogitsTransform | None
) -> None:
    from transformers import AutoConfig

    if model_type.startswith("tiny"):
        config = preset_config(model_type, **values)
    else:
        config = AutoConfig.for_model(
            model_type, vocab_size=64, hidden_size=32, num_hidden_layers=1, **values
        )
        config.num_attention_heads = config.num_key_value_heads = 2
        config.intermediate_size = 64
    model = build_model(config, device="meta")
    assert logits_transform(model) == expected


def test_softcapping_is_written_as_gemma_writes_it() -> None:
    logits = torch.randn(4, 8) * 100
    cap = 30.0
    gemma = torch.tanh(logits / cap) * cap
    assert torch.equal(LogitsTransform(softcap=cap)(logits), gemma)
    assert str(LogitsTransform(scale=0.5, softcap=cap)) == (
        "logit_scale: 0.5, final_logit_softcapping: 30.0"
    )


def test_a_head_problem_names_what_is_missing() -> None:
    assert head_problem(build_model(preset_config("tiny-llama"), device="meta")) is None
    assert head_problem(nn.Linear(2, 2)) == (
        "Linear has no lm_head (the chunked head replaces a causal LM's lm_head and loss)"
    )

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor, labels: Any = None) -> torch.Tensor:
            return x

    found = head_problem(Odd())
    assert found is not None and "does not read lm_head or loss_function" in found
