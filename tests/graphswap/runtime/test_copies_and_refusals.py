"""What users do with a wrapped model: deep copies and pickles, and transforms applied
by hand after the rewrite, which the plan cannot see."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import graphswap
from graphswap.errors import SwapExclusionError
from graphswap.runtime import is_swap_wrapped, swap_manager_of

VOCAB = 512


def rewritten(tiny_model, seed: int = 0) -> tuple[torch.nn.Module, graphswap.SwapManager]:
    """A real model through ``graphswap.rewrite``: two layers, the first swapping, linked
    to the last, which keeps its tensors on device."""
    model = tiny_model(seed, attn_implementation="sdpa", num_hidden_layers=2)
    report = graphswap.rewrite(model, rules=["qwen3_attn_swap"])
    return model, report.manager


def train(model: torch.nn.Module, steps: int = 2) -> tuple[list[float], dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        # At seq 512 the attention's queries (three stages) and output, 1 MiB each, swap.
        ids = torch.randint(0, VOCAB, (2, 512), generator=gen)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def check_independent_copy(original: torch.nn.Module, clone: torch.nn.Module) -> None:
    manager = swap_manager_of(original.model.layers[0].self_attn)
    clone_manager = swap_manager_of(clone.model.layers[0].self_attn)
    assert clone_manager is not None and clone_manager is not manager
    assert all(is_swap_wrapped(layer.self_attn) for layer in clone.model.layers)
    assert clone_manager.links == manager.links
    assert {swap_manager_of(layer.self_attn) for layer in clone.model.layers} == {clone_manager}
    losses, params = train(original)
    clone_losses, clone_params = train(clone)
    assert clone_losses == losses
    assert all(torch.equal(clone_params[n], p) for n, p in params.items())
    stats = clone_manager.stats
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes == stats.offloaded_bytes
    assert manager.stats.offloaded_bytes == stats.offloaded_bytes


def test_deepcopy_is_an_independent_rewritten_model_that_trains_bitwise_equal(tiny_model) -> None:
    model, _ = rewritten(tiny_model)
    clone = copy.deepcopy(model)
    check_independent_copy(model, clone)
    graphswap.unrewrite(clone)
    assert not any(is_swap_wrapped(layer.self_attn) for layer in clone.model.layers)
    assert all(is_swap_wrapped(layer.self_attn) for layer in model.model.layers)


def test_a_pickled_model_loads_back_with_swap_installed(tiny_model) -> None:
    model, _ = rewritten(tiny_model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    check_independent_copy(model, loaded)
    clone = pickle.loads(pickle.dumps(model))
    assert type(clone.model.layers[0].self_attn) is type(model.model.layers[0].self_attn)


def test_compile_by_hand_after_the_rewrite_is_refused(tiny_model) -> None:
    model, _ = rewritten(tiny_model)
    compiled = torch.compile(model, backend="eager")
    ids = torch.randint(0, VOCAB, (1, 16))
    with pytest.raises(SwapExclusionError, match=r"excludes compile.*activation_swap: none or"):
        compiled(input_ids=ids, labels=ids, use_cache=False)


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_by_hand_after_the_rewrite_is_refused(
    tiny_model, reentrant: bool
) -> None:
    model, manager = rewritten(tiny_model)
    # transformers 5.23 renamed gradient_checkpointing_enable to activation_checkpointing_enable.
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)({"use_reentrant": reentrant})
    model.train()
    ids = torch.randint(0, VOCAB, (1, 16))
    with pytest.raises(SwapExclusionError, match="excludes activation_checkpointing"):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert manager.stats.offloaded_bytes == 0


def toy_swapped() -> torch.nn.Sequential:
    """Two wrapped blocks in one manager: torch.compile and torch.export trace toys as
    they trace a transformer, in a fraction of the time."""
    model = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(2))
    )
    manager = graphswap.SwapManager()
    for i, block in enumerate(model):
        graphswap.swap_wrapper(block, manager=manager, name=f"b{i}")
    manager.link(model[0], model[1])
    return model


def test_another_activation_offloader_around_the_model_is_refused() -> None:
    """torch's save_on_cpu (TRL's activation_offloading: tests/graphswap/train/test_trl.py)
    would copy what the wrapped modules save a second time."""
    model = toy_swapped()
    x = torch.randn(4, 8, requires_grad=True)
    with (
        torch.autograd.graph.save_on_cpu(),
        pytest.raises(SwapExclusionError, match=r"excludes activation_offloading: 'b0' ran under"),
    ):
        model(x)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_breaks", "fullgraph"])
def test_compile_by_hand_is_refused_with_the_fix_in_every_mode(fullgraph: bool) -> None:
    """Under fullgraph=True a graph break is an error of Dynamo's own: the refusal is
    raised while Dynamo traces, so graphswap's error and fix reach the user there too."""
    compiled = torch.compile(toy_swapped(), backend="eager", fullgraph=fullgraph)
    with pytest.raises(
        SwapExclusionError,
        match=r"^activation swap excludes compile: 'b0' ran under torch\.compile.*"
        r"call graphswap\.unrewrite\(model\) before torch\.compile",
    ):
        compiled(torch.randn(4, 8, requires_grad=True))


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
def test_export_is_refused_naming_export_and_the_fix(strict: bool) -> None:
    with pytest.raises(Exception) as info:
        torch.export.export(toy_swapped(), (torch.randn(4, 8),), strict=strict)
    # torch 2.11 and later raise the refusal itself; 2.9's strict export wraps it in
    # Dynamo's TorchRuntimeError, whose message quotes it whole.
    if not isinstance(info.value, SwapExclusionError):
        assert isinstance(info.value, torch._dynamo.exc.TorchRuntimeError), info.value
    message = str(info.value)
    assert "activation swap excludes torch.export: 'b0' ran under torch.export" in message
    assert "call graphswap.unrewrite(model) before torch.export" in message
    assert "torch.compile" not in message
