"""What users do with a wrapped model: deep copies and pickles, and transforms applied
by hand after the rewrite, which the plan cannot see."""

from __future__ import annotations

import copy
import dataclasses
import io
import itertools
import pickle
import warnings
from pathlib import Path

import pytest
import torch

import graphswap
from graphswap.errors import SwapExclusionError
from graphswap.rewriting.rules import _HierarchyValidator, get_rule
from graphswap.runtime import SwapManager, is_swap_wrapped, swap_manager_of, swap_wrapper
from graphswap.runtime.policy import size_threshold_policy

VOCAB = 512
DATA = Path(__file__).parent / "data"


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


def toy_blocks() -> torch.nn.Sequential:
    """Three blocks of a linear layer and a tanh, whose saves all swap at threshold 0."""
    return torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3))
    )


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).sum().backward()
    return [p.grad for p in model.parameters()]


def test_a_model_pickled_by_0_1_0_loads_with_a_warning_and_trains_as_one_wrapped_now() -> None:
    """``data/swapped_toy_0.1.0.pt`` is what 0.1.0 (commit 7c4d51b) saved of this toy:

        torch.manual_seed(0)
        model = toy_blocks()
        manager = SwapManager(prefetch_depth=2, max_host_bytes=1 << 20)
        for i, block in enumerate(model):
            swap_wrapper(block, manager=manager, policy=size_threshold_policy(0), name=f"b{i}")
        for earlier, later in zip(model, model[1:]):
            manager.set_forward_prefetch_layer(earlier, later)
        torch.save(model, path)

    Its manager's state holds the groups as ``"slots"`` and the option ``trace``, and its
    classes are at 0.1.0's paths (``graphswap.runtime.manager``, ``.wrapper``,
    ``graphswap.policy``). Saved again, it loads with no warning."""
    with pytest.warns(DeprecationWarning) as caught:
        loaded = torch.load(DATA / "swapped_toy_0.1.0.pt", weights_only=False)
    (warning,) = [w for w in caught if "pickled by 0.1.0" in str(w.message)]
    assert str(warning.message).startswith("SwapManager(trace=) of graphswap 0.1.0 is gone")
    assert "save the loaded model again" in str(warning.message)
    assert warning.filename == __file__  # the caller's line, past torch.load and pickle
    manager = swap_manager_of(loaded[0])
    assert manager is not None and manager.prefetch_depth == 2
    assert manager.links == [("b0", "b1"), ("b1", "b2")]

    fresh = toy_blocks()
    fresh.load_state_dict(loaded.state_dict())
    fresh_manager = SwapManager(prefetch_depth=2, max_host_bytes=1 << 20)
    for i, block in enumerate(fresh):
        swap_wrapper(block, manager=fresh_manager, policy=size_threshold_policy(0), name=f"b{i}")
    for earlier, later in itertools.pairwise(fresh):
        fresh_manager.link(earlier, later)
    assert type(loaded[0]) is type(fresh[0])
    grads, fresh_grads = gradients(loaded), gradients(fresh)
    assert all(torch.equal(g, f) for g, f in zip(grads, fresh_grads, strict=True))
    stats = manager.stats
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes == stats.offloaded_bytes
    assert stats.offloaded_bytes == fresh_manager.stats.offloaded_bytes

    buffer = io.BytesIO()
    torch.save(loaded, buffer)
    buffer.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = torch.load(buffer, weights_only=False)
    assert swap_manager_of(again[0]).links == manager.links


def test_a_report_pickled_by_0_1_0_holds_the_rule_registered_now(tiny_model) -> None:
    """0.1.0 (commit 7c4d51b) pickled a rewritten model's report with its rules whole, and
    the validator of ``qwen3_attn_swap`` was a ``graphswap.rules._HierarchyValidator``.
    Loaded, the report holds the rule registered under that name today, so the model
    saved again holds no class of 0.1.0's and can be undone."""
    model, _ = rewritten(tiny_model)
    validator = _HierarchyValidator()
    validator.rule_name, validator.class_name, validator.attr = (
        "qwen3_attn_swap",
        "Qwen3MoeAttention",
        "self_attn",
    )
    rule = get_rule("qwen3_attn_swap")
    report = graphswap.rewrite_report(model)
    assert report is not None
    report._applied = tuple(
        dataclasses.replace(applied, rule=dataclasses.replace(rule, validate=validator))
        for applied in report._applied
    )
    loaded = pickle.loads(pickle.dumps(model))
    loaded_report = graphswap.rewrite_report(loaded)
    assert loaded_report is not None
    assert [applied.rule is rule for applied in loaded_report._applied] == [True, True]
    graphswap.unrewrite(loaded)
    assert not any(is_swap_wrapped(layer.self_attn) for layer in loaded.model.layers)


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
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
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
