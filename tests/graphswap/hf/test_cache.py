"""A layer recomputed whole in backward, in eval mode with the cache Hugging Face turns
on there: the recompute sees the cache as the forward found it, so the gradients are
the plain model's and the cache the caller gets back holds each token once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from graphswap.errors import SwapSetupError
from graphswap.hf.cache import cache_as_before
from graphswap.hf.checkpoints import decoder_layers
from graphswap.hf.presets import preset_config
from graphswap.runtime import SwapManager, swap_wrapper
from graphswap.train.build import from_config


def _eval_step(config: Any, recomputed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, gradients and the returned cache's length of one eval-mode step with
    ``use_cache`` at its default, every layer recomputed whole where ``recomputed``."""
    torch.manual_seed(0)
    model = from_config(config).eval()
    if recomputed:
        manager = SwapManager()
        for i, layer in enumerate(decoder_layers(model)[1]):
            swap_wrapper(
                layer,
                manager=manager,
                name=f"layer{i}",
                recompute=True,
                recompute_kwargs=cache_as_before,
            )
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    cache = output.cache if "cache" in output else output.past_key_values
    return output.loss.detach(), grads, cache.get_seq_length()


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_eval_mode_backward_through_whole_layer_recompute_is_the_plain_models(
    family: str, tour_config: Callable[..., Any], one_thread: None
) -> None:
    config = (
        preset_config("tiny-llama", attn_implementation="eager")
        if family == "dense"
        else tour_config("qwen3_next")
    )
    assert config.use_cache
    loss, grads, length = _eval_step(config, recomputed=False)
    recomputed_loss, recomputed_grads, recomputed_length = _eval_step(config, recomputed=True)
    assert torch.equal(loss, recomputed_loss)
    assert grads.keys() == recomputed_grads.keys()
    assert all(torch.equal(grads[k], recomputed_grads[k]) for k in grads)
    assert recomputed_length == length == 32


def test_a_layer_without_a_layer_index_is_refused_with_use_cache_off() -> None:
    with pytest.raises(SwapSetupError, match=r"Linear .* pass use_cache=False"):
        cache_as_before(torch.nn.Linear(2, 2), {"past_key_values": DynamicCache()})


def test_recompute_kwargs_without_recompute_is_refused() -> None:
    with pytest.raises(SwapSetupError, match=r"recompute_kwargs .* pass recompute=True"):
        swap_wrapper(torch.nn.Linear(2, 2), manager=SwapManager(), recompute_kwargs=cache_as_before)
