"""What graphswap 0.1.0 pickled loads until 0.3 (``graphswap._compat._pickles``): a
swap-wrapped model saved by ``torch.save``, whose classes are at 0.1.0's module paths and
whose manager's state has 0.1.0's shape, and a rewritten model's report holding 0.1.0's
rules. Loaded, each is what this version makes; saved again, it holds nothing of 0.1.0's."""

from __future__ import annotations

import dataclasses
import io
import itertools
import pickle
import warnings
from pathlib import Path

import pytest
import torch

import graphswap
from graphswap._compat._pickles import HierarchyValidator
from graphswap.rewriting.rules import get_rule
from graphswap.runtime import SwapManager, is_swap_wrapped, swap_manager_of, swap_wrapper
from graphswap.runtime.policy import size_threshold_policy

pytestmark = pytest.mark.compat

DATA = Path(__file__).parent / "data"


def rewritten(tiny_model) -> torch.nn.Module:
    """A real model through ``graphswap.rewrite``: two layers, attention swapped."""
    model = tiny_model(0, attn_implementation="sdpa", num_hidden_layers=2)
    graphswap.rewrite(model, rules=["qwen3_attn_swap"])
    return model


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
    assert manager is not None and manager.swap_prefetch_depth == 2
    assert manager.links == [("b0", "b1"), ("b1", "b2")]

    fresh = toy_blocks()
    fresh.load_state_dict(loaded.state_dict())
    fresh_manager = SwapManager(swap_prefetch_depth=2, max_host_bytes=1 << 20)
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
    model = rewritten(tiny_model)
    validator = HierarchyValidator()
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
    # Pickled as 0.1.0 named the class; the old path finds it in graphswap._compat.
    named = HierarchyValidator.__module__, HierarchyValidator.__qualname__
    HierarchyValidator.__module__, HierarchyValidator.__qualname__ = "graphswap.rules", "_HV"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # graphswap.rules: its own test
            with pytest.raises(pickle.PicklingError):  # no such name at the old path
                pickle.dumps(model)
            HierarchyValidator.__qualname__ = "_HierarchyValidator"
            pickled = pickle.dumps(model)
    finally:
        HierarchyValidator.__module__, HierarchyValidator.__qualname__ = named
    assert b"graphswap.rules" in pickled and b"_compat" not in pickled
    loaded = pickle.loads(pickled)
    loaded_report = graphswap.rewrite_report(loaded)
    assert loaded_report is not None
    assert [applied.rule is rule for applied in loaded_report._applied] == [True, True]
    graphswap.unrewrite(loaded)
    assert not any(is_swap_wrapped(layer.self_attn) for layer in loaded.model.layers)
