"""``loss_head: chunked`` through the infrastructure: installed before the first pass, and
the swap modes stay bitwise against the same head (I17): a chunked-head model trains
with ``attention``, ``layer``, ``auto`` and ``budget`` exactly as it does without swap."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch

import graphswap
from graphswap.errors import LossHeadError
from graphswap.passes import PassSettingError, apply_model_infrastructure
from graphswap.rewriting.loss_head import chunk_loss_head, loss_head_chunk_size
from graphswap.rewriting.transforms import Transform, shown_by
from graphswap.train.build import build
from graphswap.train.config import TrainerConfig

CHUNKED = TrainerConfig(
    model="tiny-llama",
    num_layers=2,
    seq_len=512,
    batch_size=2,
    attn_implementation="eager",
    loss_head="chunked",
    loss_head_chunk_size=256,
)
"""Two layers of eager attention at 2 x 512 tokens: 8 MiB of probabilities per layer,
which every mode swaps (the last layer's stay on device)."""

MODES: dict[str, dict[str, Any]] = {
    "attention": {},
    "layer": {},
    "auto": {"swap_bandwidth_gbps": 1e9, "swap_tflops": 0.25},
    "budget": {"activation_memory_budget": 1},
}
"""Each mode's settings; ``budget``'s 1 byte is replaced by the smallest peak a plan meets
(there it recomputes whole layers, whose inputs are below the swap threshold)."""


def _step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(
        0, model.config.vocab_size, (2, 512), generator=torch.Generator().manual_seed(1)
    )
    output = model(input_ids=ids, labels=ids, use_cache=False)
    assert output.logits is None
    output.loss.backward()
    return output.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _built(config: TrainerConfig) -> Any:
    torch.manual_seed(0)
    return build(config)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_chunked_head_trains_bitwise_like_itself_without_swap(mode: str) -> None:
    config = dataclasses.replace(CHUNKED, activation_swap=mode, **MODES[mode])  # type: ignore[arg-type]
    if mode == "budget":
        with pytest.raises(PassSettingError) as refused:
            _built(config)
        smallest = re.search(r"smallest peak any plan reaches is (\d+) bytes", str(refused.value))
        assert smallest is not None
        config = dataclasses.replace(config, activation_memory_budget=int(smallest.group(1)))
    plain_loss, plain_grads = _step(_built(CHUNKED).model)
    built = _built(config)
    assert built.infrastructure.loss_head_chunk_size == 256
    loss, grads = _step(built.model)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    assert [n for n in grads if not torch.equal(grads[n], plain_grads[n])] == []
    stats = graphswap.rewrite_report(built.model).manager.stats  # type: ignore[union-attr]
    if mode == "budget":
        assert stats.recomputed_bytes > 0, "the budget plan recomputed nothing"
    else:
        assert stats.offloaded_bytes > 0, f"{mode} swapped nothing"


def test_the_head_is_installed_before_the_passes() -> None:
    """The chunked class is the model's own under a pass that wraps its layers; the
    passes find the decoder and its classes through it."""
    config = dataclasses.replace(CHUNKED, activation_checkpointing=True)
    model = build(config).model
    assert loss_head_chunk_size(model) == 256
    assert all(Transform.CHECKPOINT in shown_by(layer) for layer in model.model.layers)


def test_a_head_installed_already_is_refused_before_any_pass() -> None:
    torch.manual_seed(0)
    model = build(TrainerConfig(model="tiny-llama", num_layers=2)).model
    chunk_loss_head(model, chunk_size=64)
    swapped = dataclasses.replace(CHUNKED, activation_swap="attention")
    with pytest.raises(LossHeadError, match=r"already has a chunked loss head \(64 tokens"):
        apply_model_infrastructure(model, swapped)
    assert graphswap.rewrite_report(model) is None, "nothing half-applied"
