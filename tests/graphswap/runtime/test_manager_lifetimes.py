"""Off the happy path: graphs never backpropagated, forwards that raise, in-place changes
to kept tensors, tensors saved by several nodes, varying shapes, graph capture."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator

import pytest
import torch

from graphswap import SwapIntegrityError, SwapManager, swap_wrapper
from graphswap.hf import build_model
from graphswap.policy import SwapPolicy, qwen3_attention_swap_policy, size_threshold_policy
from graphswap.presets import qwen3_moe_config
from graphswap.runtime import SimulatedAccelerator
from graphswap.runtime.manager import _Entry

VOCAB = 512


def make_model(layers: int, attn: str = "eager", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(qwen3_moe_config("tiny", attn_implementation=attn, num_hidden_layers=layers))


def wrap(
    model: torch.nn.Module, policy: SwapPolicy = qwen3_attention_swap_policy, **manager_kwargs
) -> SwapManager:
    manager = SwapManager(**manager_kwargs)
    attns = [
        swap_wrapper(
            layer.self_attn, manager=manager, name=f"model.layers.{i}.self_attn", policy=policy
        )
        for i, layer in enumerate(model.model.layers)
    ]
    for prev, nxt in itertools.pairwise(attns):
        manager.set_forward_prefetch_layer(prev, nxt)
    return manager


def ids(seq: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Reference counting alone must free what a dropped graph held."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def live_entries() -> int:
    return sum(type(o) is _Entry for o in gc.get_objects())


def test_forwards_without_backward_free_everything_by_refcount(no_gc) -> None:
    model = make_model(layers=3, attn="sdpa")
    manager = wrap(model)
    x = ids(1024)
    for _ in range(5):
        model(input_ids=x, labels=x)
        assert manager.stats.host_in_use_bytes == 0
    stats = manager.stats
    assert stats.offloaded_bytes > 0, "the test must swap something to mean anything"
    assert stats.host_reserved_bytes <= stats.peak_host_bytes * 2
    group = manager._latest[model.model.layers[0].self_attn]
    assert group() is None, "a dropped graph left a swap group alive"
    assert live_entries() == 0


def test_dropped_retain_graph_releases_host_buffers(no_gc) -> None:
    model = make_model(layers=3, attn="sdpa")
    manager = wrap(model)
    x = ids(1024)
    loss = model(input_ids=x, labels=x).loss
    loss.backward(retain_graph=True)
    assert manager.stats.host_in_use_bytes > 0, "a retained graph keeps its buffers"
    del loss
    assert manager.stats.host_in_use_bytes == 0
    assert live_entries() == 0


def test_forward_that_raises_half_way_releases_everything(no_gc) -> None:
    model = make_model(layers=3, attn="sdpa")
    manager = wrap(model)

    def boom(*_args) -> None:
        raise RuntimeError("boom in layer 2")

    handle = model.model.layers[2].mlp.register_forward_hook(boom)
    x = ids(1024)
    with pytest.raises(RuntimeError, match="boom in layer 2"):
        model(input_ids=x, labels=x)
    handle.remove()
    assert manager.stats.offloaded_bytes > 0
    assert manager.stats.host_in_use_bytes == 0
    assert live_entries() == 0


def plain_and_swapped_grads(model_fn, modify) -> tuple[BaseException | None, BaseException | None]:
    """Run the same forward, in-place change and backward on a plain and a wrapped model."""
    errors: list[BaseException | None] = []
    for swapped in (False, True):
        model = model_fn()
        if swapped:
            wrap(model)
        x = ids(512)
        out = model(input_ids=x, labels=x, output_attentions=True)
        modify(out)
        try:
            out.loss.backward()
            errors.append(None)
        except RuntimeError as e:
            errors.append(e)
    return errors[0], errors[1]


@pytest.mark.parametrize("layer", [-1, 0], ids=["kept_last_layer", "swapped_layer"])
def test_in_place_change_of_a_saved_tensor_raises_where_pytorch_does(layer) -> None:
    plain, swapped = plain_and_swapped_grads(
        lambda: make_model(layers=3), lambda out: out.attentions[layer].mul_(0.5)
    )
    assert plain is not None and "modified by an inplace operation" in str(plain)
    assert isinstance(swapped, SwapIntegrityError)
    assert "self_attn" in str(swapped) and "in-place" in str(swapped)


def test_in_place_change_of_an_unsaved_output_is_no_error() -> None:
    plain, swapped = plain_and_swapped_grads(
        lambda: make_model(layers=3), lambda out: out.logits.detach().mul_(1.0)
    )
    assert plain is None and swapped is None


def test_a_tensor_saved_by_three_nodes_is_reloaded_once() -> None:
    """The attention input is saved by q, k and v projections: one reload, no miss."""
    model = make_model(layers=3, attn="sdpa")
    manager = wrap(model)
    x = ids(2048, batch=1)
    model(input_ids=x, labels=x).loss.backward()
    stats = manager.stats
    assert stats.offloaded_bytes > 0
    assert stats.reloaded_bytes == stats.offloaded_bytes
    assert stats.reloaded_tensors == stats.offloaded_tensors
    assert stats.prefetch_misses == 0


def test_varying_sequence_lengths_keep_host_memory_within_twice_the_peak() -> None:
    model = make_model(layers=3, attn="sdpa")
    manager = wrap(model, policy=size_threshold_policy(4096))
    for step, seq in enumerate(range(17, 300, 11)):
        x = ids(seq, seed=step)
        model(input_ids=x, labels=x).loss.backward()
        stats = manager.stats
        assert stats.host_in_use_bytes == 0
        assert stats.host_reserved_bytes <= 2 * stats.peak_host_bytes
    assert manager.stats.offloaded_bytes > 0


def test_under_graph_capture_tensors_stay_on_device_and_are_counted() -> None:
    base = make_model(layers=3, attn="sdpa")
    model = make_model(layers=3, attn="sdpa")
    engine = SimulatedAccelerator(lag=2)
    manager = wrap(model, engine=engine)
    x = ids(1024)
    model(input_ids=x, labels=x).loss.backward()
    offloaded = manager.stats.offloaded_tensors
    with engine.capture():
        loss = model(input_ids=x, labels=x).loss
    stats = manager.stats
    assert stats.offloaded_tensors == offloaded
    assert stats.kept_capturing > 0
    loss.backward()
    base(input_ids=x, labels=x).loss.backward()
    base(input_ids=x, labels=x).loss.backward()
    for (name, p), q in zip(model.named_parameters(), base.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_failed_host_allocation_keeps_the_tensor_and_counts_it(monkeypatch) -> None:
    model = make_model(layers=3, attn="sdpa")
    engine = SimulatedAccelerator()
    manager = wrap(model, engine=engine)

    def fail(device: torch.device, nbytes: int) -> torch.Tensor:
        raise torch.OutOfMemoryError("pinned allocation failed")

    monkeypatch.setattr(engine, "host_buffer", fail)
    x = ids(1024)
    model(input_ids=x, labels=x).loss.backward()
    stats = manager.stats
    assert stats.offloaded_tensors == 0
    assert stats.alloc_failures > 0 and stats.kept_tensors >= stats.alloc_failures


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"offload_lag": -1}, "offload_lag"),
        ({"offload_lag": 1.5}, "offload_lag"),
        ({"prefetch_depth": 0}, "prefetch_depth"),
        ({"max_host_bytes": -1}, "max_host_bytes"),
        ({"engine": object()}, "engine"),
        ({"engine": "cpu"}, "engine"),
    ],
)
def test_bad_manager_arguments_are_value_errors_naming_them(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SwapManager(**kwargs)
