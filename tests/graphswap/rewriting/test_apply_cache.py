"""A rewritten Hugging Face model called as ``transformers.Trainer`` calls it frees what
the swap says left the device: in train mode the decoder runs without a key/value cache,
whose tensors attention saves when it has as many key/value heads as query heads."""

from __future__ import annotations

import warnings

import pytest
import torch

import graphswap
from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import qwen3_moe_config
from graphswap.planning.measure import ResidentActivationTracker, output_tensors

SEQ, BATCH = 512, 2


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
