"""The accelerator copy engine on a real GPU (skipped without CUDA)."""

from __future__ import annotations

import itertools

import pytest
import torch

from graphswap import SwapManager, swap_wrapper

pytestmark = pytest.mark.cuda
SEQ = 2048


def build(
    tiny_model, swap: bool, attn_implementation: str
) -> tuple[torch.nn.Module, SwapManager | None]:
    model = tiny_model(device="cuda", num_hidden_layers=8, attn_implementation=attn_implementation)
    if not swap:
        return model, None
    manager = SwapManager()
    attns = [
        swap_wrapper(layer.self_attn, manager=manager, name=f"model.layers.{i}.self_attn")
        for i, layer in enumerate(model.model.layers)
    ]
    for prev, nxt in itertools.pairwise(attns):
        manager.set_forward_prefetch_layer(prev, nxt)
    return model, manager


def peak_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, float, dict]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = model(input_ids=ids, labels=ids).loss
    # Flash and memory-efficient attention take their deterministic backward only in strict
    # mode; the forward stays warn-only because the MoE router's histc has no such kernel.
    torch.use_deterministic_algorithms(True)
    try:
        loss.backward()
    finally:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.cuda.synchronize()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated() - base, loss.item(), grads


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_peak_memory_drops_by_offloaded_bytes_and_grads_match(
    tiny_model, attn_implementation: str
) -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    ids = torch.randint(0, 512, (2, SEQ), device="cuda")
    plain, _ = build(tiny_model, swap=False, attn_implementation=attn_implementation)
    swapped, manager = build(tiny_model, swap=True, attn_implementation=attn_implementation)
    peak_step(swapped, ids)
    assert manager is not None
    manager.reset_stats()
    base_peak, base_loss, base_grads = peak_step(plain, ids)
    peak, loss, grads = peak_step(swapped, ids)

    offloaded = manager.stats.offloaded_bytes
    assert offloaded > 0
    assert base_peak - peak >= 0.95 * offloaded, (base_peak, peak, offloaded)
    assert loss == base_loss
    for name, grad in grads.items():
        assert torch.equal(grad, base_grads[name]), name
    assert manager.stats.prefetch_misses == 0
