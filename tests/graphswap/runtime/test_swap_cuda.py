"""Activation swap on a real GPU: what the accelerator copy engine must hold (skipped without CUDA).

The tiny Qwen3-MoE with 8 layers at seq 2048, batch 2, fp32: every layer's attention
tensors cross the 1 MiB threshold, and the attention input is saved by three
projections, so one reload per storage is exercised. Memory is read from the CUDA
caching allocator, never from graphswap's stats. Byte comparisons between a run with
swap and one without use the allocator's ``requested_bytes`` (the sizes asked for):
its block rounding depends on which free blocks a run happens to find, which differs
between the two runs.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from graphswap import SwapManager, swap_wrapper, unwrap_swap

# cuBLAS picks deterministic GEMMs only if this is set before its first handle exists.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.cuda
DEVICE = "cuda"
LAYERS, SEQ, BATCH = 8, 2048, 2
ATTENTIONS = ("eager", "sdpa")
LEAK_STEPS = 20


def sync() -> None:
    torch.cuda.synchronize()


def requested() -> int:
    return torch.cuda.memory_stats()["requested_bytes.all.current"]


def reset_peak() -> None:
    torch.cuda.reset_peak_memory_stats()


def peak_requested() -> int:
    return torch.cuda.memory_stats()["requested_bytes.all.peak"]


def allocated() -> int:
    return torch.cuda.memory_allocated()


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def build(
    tiny_model: Callable[..., torch.nn.Module], attn: str
) -> tuple[torch.nn.Module, torch.Tensor]:
    model = tiny_model(device=DEVICE, num_hidden_layers=LAYERS, attn_implementation=attn)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=generator)
    return model, ids.to(DEVICE)


def attention_names() -> list[str]:
    return [f"model.layers.{i}.self_attn" for i in range(LAYERS)]


@contextmanager
def swapped(model: torch.nn.Module, offload_lag: int = 1) -> Iterator[SwapManager]:
    """Every attention swap-wrapped and linked, as ``qwen3_attn_swap`` does; undone after."""
    manager = SwapManager(swap_offload_lag=offload_lag)
    attns = [
        swap_wrapper(layer.self_attn, manager=manager, name=name)
        for name, layer in zip(attention_names(), model.model.layers, strict=True)
    ]
    for prev, nxt in itertools.pairwise(attns):
        manager.link(prev, nxt)
    try:
        yield manager
    finally:
        for attn in attns:
            unwrap_swap(attn)


def step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """zero-grad + forward + backward, finished on the device; the loss."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    sync()
    return loss.item()


def peak_step(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Peak bytes of one step above what was allocated when it began."""
    model.zero_grad(set_to_none=True)
    sync()
    reset_peak()
    start = requested()
    step(model, ids)
    return peak_requested() - start


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attn", ATTENTIONS)
def test_every_offloaded_byte_comes_back_once_and_no_number_changes(
    tiny_model: Callable[..., torch.nn.Module], attn: str
) -> None:
    model, ids = build(tiny_model, attn)
    loss = step(model, ids)
    expected = grads(model)
    if step(model, ids) != loss or any(
        not torch.equal(g, expected[name]) for name, g in grads(model).items()
    ):
        pytest.skip(f"{attn} is not bitwise reproducible here even without swap")

    with swapped(model) as manager:
        swapped_loss = step(model, ids)
        stats = manager.stats
    assert stats.offloaded_bytes > 0
    assert stats.reloaded_bytes == stats.offloaded_bytes, (
        f"reloaded {stats.reloaded_bytes} B of {stats.offloaded_bytes} B offloaded"
    )
    assert stats.prefetch_misses == 0, f"{stats.prefetch_misses} misses, {stats.prefetch_hits} hits"
    assert swapped_loss == loss
    got = grads(model)
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        assert torch.equal(grad, expected[name]), name


@pytest.mark.parametrize("attn", ATTENTIONS)
def test_peak_drops_by_the_offloaded_bytes_but_one_layer(
    tiny_model: Callable[..., torch.nn.Module], attn: str
) -> None:
    """One layer comes back while the kept last layer runs its backward: the peak keeps
    one layer's swappable bytes, never more."""
    model, ids = build(tiny_model, attn)
    with swapped(model):
        peak_step(model, ids)  # copy streams, pinned host buffers, cuBLAS workspaces
    peak_step(model, ids)
    without = peak_step(model, ids)
    with swapped(model) as manager:
        manager.reset_stats()
        with_swap = peak_step(model, ids)
        stats = manager.stats

    largest = max(group.offloaded_bytes for group in stats.per_group.values())
    assert stats.offloaded_bytes > largest > 0
    bound = 0.9 * (stats.offloaded_bytes - largest)
    assert without - with_swap >= bound, (
        f"peak {without} B without swap, {with_swap} B with it: a drop of "
        f"{without - with_swap} B, below 0.9 x (offloaded {stats.offloaded_bytes} B "
        f"- largest layer {largest} B)"
    )


@pytest.mark.parametrize("offload_lag", [0, 1, 2])
def test_forward_releases_device_memory_within_the_offload_lag(
    tiny_model: Callable[..., torch.nn.Module], offload_lag: int
) -> None:
    """At the start of each wrapped layer's forward at most ``offload_lag + 1`` layers'
    swappable bytes are still allocated, however far the host runs ahead."""
    model, ids = build(tiny_model, "eager")
    marks: list[int] = []
    handles = [
        layer.self_attn.register_forward_pre_hook(lambda module, args: marks.append(requested()))
        for layer in model.model.layers
    ]

    def marked_step() -> list[int]:
        model.zero_grad(set_to_none=True)
        sync()
        marks.clear()
        start = requested()
        step(model, ids)
        return [mark - start for mark in marks]

    try:
        with swapped(model, offload_lag=offload_lag):
            marked_step()
        marked_step()
        without = marked_step()
        with swapped(model, offload_lag=offload_lag) as manager:
            manager.reset_stats()
            with_swap = marked_step()
            per_group = manager.stats.per_group
    finally:
        for handle in handles:
            handle.remove()

    swappable = [per_group[name].offloaded_bytes for name in attention_names()]
    assert min(swappable[:-1]) > 0 and swappable[-1] == 0  # the last layer is kept
    allowed = (offload_lag + 1) * max(swappable)
    for layer, (plain, swap) in enumerate(zip(without, with_swap, strict=True)):
        resident = sum(swappable[:layer]) - (plain - swap)
        assert resident <= allowed, (
            f"entering layer {layer}: {resident} B of earlier layers' swapped tensors still "
            f"allocated, more than offload_lag + 1 = {offload_lag + 1} layers ({allowed} B)"
        )


@pytest.mark.parametrize("attn", ATTENTIONS)
def test_memory_is_flat_over_twenty_steps(
    tiny_model: Callable[..., torch.nn.Module], attn: str
) -> None:
    model, ids = build(tiny_model, attn)
    with swapped(model) as manager:
        step(model, ids)
        model.zero_grad(set_to_none=True)
        sync()
        before = allocated()
        after, host = [], []
        for _ in range(LEAK_STEPS):
            step(model, ids)
            model.zero_grad(set_to_none=True)
            sync()
            after.append(allocated())
            host.append(manager.stats.host_in_use_bytes)
    assert after == [before] * LEAK_STEPS
    assert host == [0] * LEAK_STEPS
