"""The public names of ``graphswap``, used as a user uses them (the README's "Use"
section), and the package's promise at import time (the origin's P3: a platform query
on import).

Every name in ``graphswap.__all__`` has a case here that uses it through the package
(``graphswap.<name>``) and checks what it promises; each exported error is raised by
the API under its documented condition. ``test_every_export_has_a_behaviour_case``
fails when a name is exported without one.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
from torch import nn

import graphswap
from graphswap import errors
from graphswap.runtime.policy import MIN_SWAP_TENSOR_BYTES, swap_large_activations

Model = Callable[..., nn.Module]
EXPORTS: dict[str, str] = {}
"""Exported name -> the test that uses it."""

Test = TypeVar("Test", bound=Callable[..., None])


def uses(*names: str) -> Callable[[Test], Test]:
    def register(test: Test) -> Test:
        for name in names:
            assert name not in EXPORTS, f"{name} has two cases"
            EXPORTS[name] = test.__name__
        return test

    return register


def test_import_has_no_side_effects() -> None:
    """Importing graphswap and its rewrite modules loads no model code (rules name their
    classes; a model's module is imported when a rule runs), no compiler, not the pass
    plan (the core never imports up), not the simulator (a run on a device never uses
    it), and does not touch CUDA."""
    code = (
        "import sys, torch, graphswap, graphswap.rewriting.rules, graphswap.rewriting.apply,"
        " graphswap.rewriting.graph, graphswap.runtime\n"
        "assert 'graphswap.passes' not in sys.modules, 'the core imports the pass plan'\n"
        "sim = [m for m in sys.modules if m.startswith('graphswap.runtime.sim')]\n"
        "assert not sim, f'importing graphswap loaded the simulator: {sim}'\n"
        "bad = [m for m in sys.modules if m.startswith(('transformers', 'torch._dynamo'))]\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized(), 'importing graphswap touched CUDA'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_export_has_a_behaviour_case() -> None:
    assert sorted(graphswap.__all__) == sorted(set(graphswap.__all__))
    assert len(graphswap.__all__) <= 13, "a small public surface: the rest is imported by module"
    missing = sorted(set(graphswap.__all__) - set(EXPORTS))
    assert not missing, f"exported without a behaviour case here: {missing}"
    assert set(EXPORTS) <= set(graphswap.__all__), "a case for a name no longer exported"


def loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@uses("SwapManager", "swap_wrapper", "SwapStats", "unwrap_swap")
def test_install_by_hand_swaps_without_changing_a_number(tiny_model: Model) -> None:
    """The README's three lines: one manager, one wrapper per attention, one link."""
    ids = torch.randint(0, 512, (2, 512), generator=torch.Generator().manual_seed(0))
    plain = tiny_model(num_hidden_layers=2)
    model = tiny_model(num_hidden_layers=2)
    attention_type = type(model.model.layers[0].self_attn)
    manager = graphswap.SwapManager()
    attns = [
        graphswap.swap_wrapper(layer.self_attn, manager=manager) for layer in model.model.layers
    ]
    manager.link(attns[0], attns[1])
    loss, grads = loss_and_grads(model, ids)
    plain_loss, plain_grads = loss_and_grads(plain, ids)
    assert loss == plain_loss
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    stats = manager.stats
    assert isinstance(stats, graphswap.SwapStats)
    assert stats.offloaded_bytes == stats.reloaded_bytes > 0
    for attn in attns:
        assert graphswap.unwrap_swap(attn) is attn
    assert {type(layer.self_attn) for layer in model.model.layers} == {attention_type}


@uses("rewrite", "RewriteReport", "unrewrite", "available_rules", "rewrite_report")
def test_rewrite_by_rule_name_and_undo(tiny_model: Model) -> None:
    model = tiny_model(num_hidden_layers=2)
    originals = [(layer.self_attn, type(layer.self_attn)) for layer in model.model.layers]
    assert "qwen3_attn_swap" in graphswap.available_rules()
    assert graphswap.rewrite_report(model) is None
    report = graphswap.rewrite(model, rules=["qwen3_attn_swap"])
    assert isinstance(report, graphswap.RewriteReport)
    assert graphswap.rewrite_report(model) is report
    report.check()  # nothing planned, nothing to mismatch
    assert isinstance(report.manager, graphswap.SwapManager)
    assert {type(layer.self_attn).__name__ for layer in model.model.layers} == {
        "SwapQwen3MoeAttention"
    }
    assert graphswap.unrewrite(model) is report
    assert [(layer.self_attn, type(layer.self_attn)) for layer in model.model.layers] == originals


def test_rewriting_twice_is_refused(tiny_model: Model) -> None:
    model = tiny_model(num_hidden_layers=1)
    graphswap.rewrite(model, rules="qwen3_attn_swap")
    with pytest.raises(errors.AlreadyTransformedError) as info:
        graphswap.rewrite(model, rules="qwen3_attn_swap")
    assert isinstance(info.value, errors.RewriteError)
    graphswap.unrewrite(model)
    with pytest.raises(errors.RewriteError, match="nothing to undo"):
        graphswap.unrewrite(model)


def test_a_rule_that_matches_nothing_is_an_error() -> None:
    """I2: no silent no-op."""
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(errors.NoMatchError, match="qwen3_attn_swap"):
        graphswap.rewrite(model, rules="qwen3_attn_swap")
    assert type(model[0]) is nn.Linear


@uses("GraphswapError")
def test_one_except_catches_every_refusal_and_keeps_the_builtin_type() -> None:
    """``except graphswap.GraphswapError`` catches what graphswap refuses; code that
    caught the built-in type (a ``ValueError``, a ``KeyError``) still does."""
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(graphswap.GraphswapError) as no_match:
        graphswap.rewrite(model, rules="qwen3_attn_swap")
    with pytest.raises(graphswap.GraphswapError) as unknown:
        graphswap.rewrite(model, rules="no_such_rule")
    assert isinstance(no_match.value, ValueError)
    assert isinstance(unknown.value, KeyError)
    assert not issubclass(graphswap.GraphswapError, (ValueError, RuntimeError))


@uses("Rule", "register_rule")
def test_a_rule_of_ones_own_is_registered_and_applied() -> None:
    def swap_linear(module: nn.Module, ctx: Any) -> nn.Module:
        return graphswap.swap_wrapper(module, manager=ctx.manager, policy=swap_everything)

    name = f"swap_linear_{uuid.uuid4().hex}"
    rule = graphswap.Rule(
        name=name,
        description="swap what every Linear saves",
        targets=("torch.nn:Linear",),
        factory=swap_linear,
        restore=graphswap.unwrap_swap,
    )
    assert graphswap.register_rule(rule) is rule
    assert name in graphswap.available_rules()
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    report = graphswap.rewrite(model, rules=name)
    model(torch.randn(8, 64, requires_grad=True)).sum().backward()
    assert report.manager.stats.offloaded_bytes > 0
    report.undo()
    assert [type(m) for m in model] == [nn.Linear, nn.Tanh, nn.Linear]


def swap_everything(t: torch.Tensor) -> graphswap.CheckpointPolicy:
    return graphswap.CheckpointPolicy.MUST_SWAP


def offloaded_bytes(policy: Callable[[torch.Tensor], graphswap.CheckpointPolicy]) -> int:
    """What two linked linear layers offload in one step under ``policy``."""
    manager = graphswap.SwapManager()
    first, second = (
        graphswap.swap_wrapper(nn.Linear(256, 256), manager=manager, policy=policy)
        for _ in range(2)
    )
    manager.link(first, second)
    second(torch.tanh(first(torch.randn(64, 256, requires_grad=True)))).sum().backward()
    return manager.stats.offloaded_bytes


@uses("CheckpointPolicy")
def test_the_policy_decides_per_tensor() -> None:
    """Exactly ``MIN_SWAP_TENSOR_BYTES`` swaps and a row less is saved; a policy of
    one's own answers with ``CheckpointPolicy`` members, which the manager obeys."""
    policy = swap_large_activations
    rows = MIN_SWAP_TENSOR_BYTES // (4 * 256)
    x = torch.randn(rows, 256, requires_grad=True)
    assert policy(x * 1) is graphswap.CheckpointPolicy.MUST_SWAP
    assert policy(x[1:] * 1) is graphswap.CheckpointPolicy.MUST_SAVE
    assert offloaded_bytes(swap_everything) > 0
    assert offloaded_bytes(lambda t: graphswap.CheckpointPolicy.MUST_SAVE) == 0


class Tanh(nn.Module):
    """Saves its own output, the tensor a caller may modify in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


def test_a_saved_tensor_modified_in_place_is_an_error() -> None:
    module = graphswap.swap_wrapper(Tanh(), manager=graphswap.SwapManager(), policy=swap_everything)
    y = module(torch.randn(32, 64, requires_grad=True))
    y.add_(1)
    with pytest.raises(errors.SwapIntegrityError, match=r"\(32, 64\).*in-place"):
        y.sum().backward()


def test_a_swapped_module_under_activation_checkpointing_is_refused() -> None:
    from torch.utils.checkpoint import checkpoint

    module = graphswap.swap_wrapper(Tanh(), manager=graphswap.SwapManager(), policy=swap_everything)
    x = torch.randn(32, 64, requires_grad=True)
    with pytest.raises(errors.SwapExclusionError, match="excludes activation_checkpointing"):
        checkpoint(module, x, use_reentrant=False).sum().backward()


@pytest.mark.compat
def test_the_origins_names_still_work_and_say_the_new_ones() -> None:
    """What users of the origin wrote: its policy name and its link method."""
    with pytest.warns(DeprecationWarning, match="swap_large_activations"):
        policy = graphswap.qwen3_attention_swap_policy
    assert policy is swap_large_activations
    manager = graphswap.SwapManager()
    first, second = (graphswap.swap_wrapper(nn.Linear(4, 4), manager=manager) for _ in range(2))
    with pytest.warns(errors.GraphswapDeprecationWarning, match="SwapManager.link"):
        manager.set_forward_prefetch_layer(first, second)
    assert manager.links == [(manager.groups()[0].name, manager.groups()[1].name)]
    assert {m.name for m in graphswap.CheckpointPolicy} == {"MUST_SWAP", "MUST_SAVE"}
