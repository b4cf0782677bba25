"""The memory strategies behind ``activation_swap`` and ``plan_memory``'s typed entry:
a mode's name becomes its strategy once, and a plan is asked of the strategy."""

from __future__ import annotations

import inspect

import pytest
import torch

from graphswap.hf.presets import qwen3_moe_config
from graphswap.planning import PlanSettingError, plan_memory
from graphswap.planning._plan import SWAP_MODES
from graphswap.planning._registry import STRATEGIES, memory_strategy
from graphswap.planning.trace import StepShape, StepTrace, SwapSchedule, plan_step

SHAPE = StepShape(seq_len=512, batch_size=2, dtype=torch.float32, device="cpu")


def test_every_mode_is_one_strategy_of_its_own_name() -> None:
    assert tuple(STRATEGIES) == SWAP_MODES
    for name in SWAP_MODES:
        assert memory_strategy(name).name == name
    assert [s.name for s in STRATEGIES.values() if s.executes_plan] == ["auto", "budget"]
    assert [s.name for s in STRATEGIES.values() if s.takes_budget] == ["budget"]


def test_an_unknown_mode_is_refused_listing_the_strategies() -> None:
    with pytest.raises(PlanSettingError, match=r"activation_swap.*none, attention, layer"):
        memory_strategy("swap-everything")


def test_plan_step_is_the_strategys_plan(tiny_trace: StepTrace) -> None:
    config = qwen3_moe_config("tiny")
    schedule = SwapSchedule(swap_offload_lag=2)
    for name in ("none", "attention", "layer", "auto"):
        by_name = plan_step(config, tiny_trace, activation_swap=name, schedule=schedule)
        assert by_name == memory_strategy(name).plan_step(config, tiny_trace, schedule)
        assert by_name.activation_swap == name
    with pytest.raises(PlanSettingError, match="per recompute level"):
        plan_step(config, tiny_trace, activation_swap="budget")


def test_plan_memory_takes_the_step_and_schedule_as_values() -> None:
    signature = inspect.signature(inspect.unwrap(plan_memory))
    kinds = {p.kind for p in signature.parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds
    assert list(signature.parameters)[:2] == ["config", "shape"]


@pytest.mark.compat
def test_flat_settings_warn_naming_the_typed_call_and_plan_the_same() -> None:
    config = qwen3_moe_config("tiny")
    typed = plan_memory(
        config, SHAPE, activation_swap="auto", schedule=SwapSchedule(swap_hide_margin=0.2)
    )
    with pytest.warns(DeprecationWarning, match=r"plan_memory\(seq_len=.*StepShape"):
        flat = plan_memory(
            config,
            activation_swap="auto",
            seq_len=512,
            batch_size=2,
            dtype=torch.float32,
            device="cpu",
            swap_hide_margin=0.2,
        )
    assert flat == typed


@pytest.mark.compat
def test_a_shape_and_flat_settings_together_are_refused() -> None:
    with pytest.raises(PlanSettingError, match="not both"):
        plan_memory(qwen3_moe_config("tiny"), SHAPE, seq_len=512)
