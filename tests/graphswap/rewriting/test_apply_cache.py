"""A rewritten Hugging Face model called as ``transformers.Trainer`` calls it frees what
the swap says left the device: in train mode the decoder runs without a key/value cache,
whose tensors attention saves when it has as many key/value heads as query heads; a
hybrid decoder keeps its cache, which its Mamba layers compute with, but returns none."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import graphswap
from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import qwen3_moe_config
from graphswap.planning.measure import ResidentActivationTracker, output_tensors
from graphswap.rewriting.rules import with_policy
from graphswap.runtime.policy import size_threshold_policy

SEQ, BATCH = 512, 2

POLICY = size_threshold_policy(4 << 10, name="hybrid_cache_test_policy")
"""The hybrid families' tiny saves (width 64, 32 tokens) are a few KiB."""


def model_and_ids() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    config = qwen3_moe_config(
        "tiny",
        attn_implementation="eager",
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=32,
        num_hidden_layers=3,
    )
    model = build_model(config)
    return model, torch.randint(0, config.vocab_size, (BATCH, SEQ))


def resident_after_forward(model: torch.nn.Module, ids: torch.Tensor) -> int:
    tracker = ResidentActivationTracker("cpu")
    with tracker.track():
        out = model(input_ids=ids, labels=ids)
        resident = tracker.resident_bytes(output_tensors(out))
    out.loss.backward()
    return resident


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_what_the_stats_say_left_the_device_is_what_the_tracker_sees_freed(mode: str) -> None:
    """Train mode: no cache, everything copied is freed. Eval mode with grad keeps the
    cache (generation needs it), and its keys and values are counted as not freed."""
    model, ids = model_and_ids()
    getattr(model, mode)()
    plain = resident_after_forward(model, ids)
    report = graphswap.rewrite(model, rules=["qwen3_attn_swap"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        swapped = resident_after_forward(model, ids)
    stats = report.manager.stats
    assert stats.offloaded_bytes > 0
    assert plain - swapped == stats.offloaded_bytes - stats.offloaded_not_freed_bytes
    if mode == "train":
        assert stats.offloaded_not_freed_bytes == 0
        assert not caught
    else:
        assert stats.offloaded_not_freed_bytes > 0
        assert any("use_cache=False" in str(w.message) for w in caught)


def test_use_cache_true_in_train_mode_is_overridden_with_a_warning_and_undo_restores_it() -> None:
    model, ids = model_and_ids()
    report = graphswap.rewrite(model, rules=["qwen3_attn_swap"])
    with pytest.warns(UserWarning, match="use_cache=True is overridden in train mode"):
        out = model(input_ids=ids[:, :64], use_cache=True)
    assert out.past_key_values is None
    model.eval()
    with torch.no_grad():
        assert model(input_ids=ids[:, :64], use_cache=True).past_key_values is not None
    model.train()
    report.undo()
    assert model(input_ids=ids[:, :64], use_cache=True).past_key_values is not None


@pytest.mark.parametrize("family", ["jamba", "qwen3_next", "bamba", "nemotron_h"])
def test_a_hybrid_stack_keeps_its_cache_path_and_its_numbers(
    family: str, tour_config: Any, one_thread: None
) -> None:
    """Mamba and linear-attention layers compute along another path without a cache, so a
    hybrid decoder called with ``use_cache`` at its default (as ``transformers.Trainer``
    calls it) runs with its cache under ``layer_swap`` too: the same numbers bit for bit;
    the cache is left out of what forward returns, so nothing keeps what was copied."""
    config = tour_config(family)
    torch.manual_seed(0)
    model = build_model(config)
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))

    def step() -> tuple[Any, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out, [p.grad for p in model.parameters() if p.grad is not None]

    plain, plain_grads = step()
    if all(plain.get(name) is None for name in ("cache", "past_key_values")):
        pytest.skip(f"this transformers' {family} builds no cache in training")
    report = graphswap.rewrite(model, rules=[with_policy("layer_swap", POLICY)])
    swapped, grads = step()
    assert torch.equal(swapped.loss, plain.loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    assert all(swapped.get(name) is None for name in ("cache", "past_key_values"))
    stats = report.manager.stats
    assert stats.offloaded_bytes > 0 and stats.offloaded_not_freed_bytes == 0
