"""The executor of ``auto`` and ``budget`` plans was ``AutoSwap`` (with ``AutoSwapPolicy``,
``AutoSwapMismatchError`` and ``AutoSwapMismatchWarning``), named after one of the two
modes it runs. Until 0.3 the old names warn, naming the new ones, and are the same
classes: code that catches the old error catches what is raised, and a model pickled
under the old names (its layers' policies and the executor behind them) loads and runs
its plan."""

from __future__ import annotations

import dataclasses
import io
import re
import warnings
from typing import Any

import pytest
import torch

from graphswap import rewrite_report
from graphswap.passes import plan_executor, swap
from graphswap.passes.plan_executor import (
    PlanExecutor,
    PlanMismatchError,
    PlanMismatchWarning,
    PlanPolicy,
)
from graphswap.train.build import build
from graphswap.train.config import TrainerConfig

pytestmark = pytest.mark.compat

RENAMED = {
    "AutoSwap": PlanExecutor,
    "AutoSwapPolicy": PlanPolicy,
    "AutoSwapMismatchError": PlanMismatchError,
    "AutoSwapMismatchWarning": PlanMismatchWarning,
}
"""Old name -> the class it is now."""

MODULE = "graphswap.passes.plan_executor"


def _ids(seq: int) -> torch.Tensor:
    return torch.randint(0, 512, (2, seq), generator=torch.Generator().manual_seed(1))


def _step(model: torch.nn.Module, seq: int = 512) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward at ``seq`` tokens: the loss and the gradients."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=_ids(seq), labels=_ids(seq), use_cache=False).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _auto_model() -> torch.nn.Module:
    """Two tiny layers under an ``auto`` plan of batch 2 x 512 tokens that swaps what the
    1 MiB threshold lets through."""
    torch.manual_seed(0)
    config = TrainerConfig(activation_swap="auto", num_layers=2, swap_bandwidth_gbps=1e9)
    return build(config).model


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_old_name_warns_naming_the_new_one_and_is_the_same_class(old: str) -> None:
    new = RENAMED[old]
    said = rf"^{re.escape(f'{MODULE}.{old}')} is deprecated: use {re.escape(f'{MODULE}.')}"
    with pytest.warns(DeprecationWarning, match=rf"{said}{new.__name__} \(removed in 0\.3\)$"):
        assert getattr(plan_executor, old) is new
    with pytest.raises(AttributeError, match="has no attribute 'AutoSwapTypo'"):
        plan_executor.AutoSwapTypo  # noqa: B018


def test_code_written_for_the_old_names_catches_what_the_executor_raises(
    one_thread: None,
) -> None:
    with pytest.warns(DeprecationWarning) as caught:
        from graphswap.passes.plan_executor import (
            AutoSwapMismatchError,
            AutoSwapMismatchWarning,
        )
    assert {w.filename for w in caught} == {__file__}, "the warning points at the import"
    model = _auto_model()
    with pytest.warns(AutoSwapMismatchWarning, match=r"^activation_swap: auto: "):
        _step(model, seq=256)
    report = rewrite_report(model)
    assert report is not None
    with pytest.raises(AutoSwapMismatchError, match=r"^activation_swap: auto: ") as raised:
        report.check()
    assert type(raised.value) is PlanMismatchError


def _pickled_under_the_old_names(model: torch.nn.Module) -> bytes:
    """``torch.save`` of ``model`` as the code before the rename wrote it: the classes
    under their old names, at the same module."""
    named = PlanExecutor.__qualname__, PlanPolicy.__qualname__
    PlanExecutor.__qualname__, PlanPolicy.__qualname__ = "AutoSwap", "AutoSwapPolicy"
    buffer = io.BytesIO()
    try:
        with warnings.catch_warnings():
            # pickle checks that the name it writes finds the class: the old name warns.
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.save(model, buffer)
    finally:
        PlanExecutor.__qualname__, PlanPolicy.__qualname__ = named
    return buffer.getvalue()


def _load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def test_a_model_pickled_under_the_old_names_loads_and_runs_its_plan(one_thread: None) -> None:
    model = _auto_model()
    pickled = _pickled_under_the_old_names(model)
    assert b"AutoSwapPolicy" in pickled and b"PlanPolicy" not in pickled
    with pytest.warns(DeprecationWarning) as caught:
        loaded = _load(pickled)
    assert sorted(str(w.message) for w in caught) == [
        f"{MODULE}.AutoSwap is deprecated: use {MODULE}.PlanExecutor (removed in 0.3)",
        f"{MODULE}.AutoSwapPolicy is deprecated: use {MODULE}.PlanPolicy (removed in 0.3)",
    ]
    assert {w.filename for w in caught} == {__file__}, "past torch.load and pickle"

    expected_loss, expected_grads = _step(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMismatchWarning)
        loss, grads = _step(loaded)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
    report = rewrite_report(loaded)
    assert report is not None and report.manager.stats.offloaded_bytes > 0
    report.check()  # the executor's check, on the plan it loaded with

    with pytest.warns(PlanMismatchWarning):
        _step(loaded, seq=256)
    with pytest.raises(PlanMismatchError):
        report.check()

    buffer = io.BytesIO()
    torch.save(loaded, buffer)
    assert b"AutoSwap" not in buffer.getvalue(), "saved again, it names the new classes"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        _load(buffer.getvalue())


def test_the_swap_pass_and_the_built_model_answer_to_their_old_executor_names(
    one_thread: None,
) -> None:
    """``plan_auto_swap``, ``apply_swap(auto=)`` and the results' ``auto_swap``: 0.2.0's
    names, after one of the two modes, warn naming the new ones and do the same."""
    torch.manual_seed(0)
    config = TrainerConfig(activation_swap="auto", num_layers=2, swap_bandwidth_gbps=1e9)
    built = build(config)
    with pytest.warns(
        DeprecationWarning, match=r"BuiltModel\.auto_swap .*BuiltModel\.plan_executor"
    ):
        assert built.auto_swap is built.plan_executor is not None
    with pytest.warns(DeprecationWarning, match=r"\.auto_swap .*\.plan_executor"):
        assert built.infrastructure.auto_swap is built.plan_executor
    with pytest.warns(
        DeprecationWarning, match=r"swap\.plan_auto_swap is deprecated: use .*plan_swap"
    ):
        from graphswap.passes.swap import plan_auto_swap
    assert plan_auto_swap is swap.plan_swap
    plain = build(
        dataclasses.replace(config, activation_swap="none", swap_bandwidth_gbps=None)
    ).model
    executor = swap.plan_swap(plain, config)
    said = r"apply_swap\(auto=...\) is deprecated: use executor="
    with pytest.warns(DeprecationWarning, match=said):
        report = swap.apply_swap(plain, activation_swap="auto", auto=executor)
    assert len(report.manager.links) == 1 and executor.plan is not None


@pytest.mark.parametrize(
    ("old", "new"),
    [("AutoSwapSettings", "SwapPlanSettings"), ("AUTO_ONLY_SETTINGS", "PLAN_ONLY_SETTINGS")],
)
def test_the_config_group_auto_and_budget_read_answers_to_its_old_name(old: str, new: str) -> None:
    from graphswap.train import config

    said = rf"^graphswap\.train\.config\.{old} is deprecated: use graphswap\.train\.config\.{new}"
    with pytest.warns(DeprecationWarning, match=said):
        assert getattr(config, old) is getattr(config, new)
