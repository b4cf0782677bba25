"""Plans and fits that differ only in what a trace does not read (the mode, the schedule,
the budget, the memory) replay the step traced before; what a trace reads traces again."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from transformers import PretrainedConfig

from graphswap.hf.presets import qwen3_moe_config
from graphswap.planning import PlanSettingError, _trace_cache, fit_sequence, plan_memory
from graphswap.planning.trace import StepShape, StepTrace, SwapSchedule

SHAPE = StepShape(seq_len=512, batch_size=2, dtype=torch.float32, device="cpu")
"""sdpa's query and output are 1 MiB a layer here: ``auto`` swaps them."""
NO_HOST = SwapSchedule(max_host_bytes=0)


def tiny(num_hidden_layers: int = 2) -> PretrainedConfig:
    """The tiny Qwen3-MoE, two layers deep: one swaps, the last keeps."""
    return qwen3_moe_config("tiny", num_hidden_layers=num_hidden_layers)


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[StepTrace]]:
    """Every step ``plan_memory`` traced during the test, starting from no kept trace."""
    made: list[StepTrace] = []
    trace_step = _trace_cache.trace_step

    def counted(*args: object, **kwargs: object) -> StepTrace:
        made.append(trace_step(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(_trace_cache, "trace_step", counted)
    monkeypatch.setattr(_trace_cache, "_traces", type(_trace_cache._traces)())
    yield made


def test_a_plan_of_another_schedule_replays_the_step_traced_before(
    traces: list[StepTrace],
) -> None:
    config = tiny()
    first = plan_memory(config, SHAPE, activation_swap="auto")
    again = plan_memory(config, SHAPE, activation_swap="auto", schedule=NO_HOST)
    assert len(traces) == 1
    _trace_cache._traces.clear()
    fresh = plan_memory(config, SHAPE, activation_swap="auto", schedule=NO_HOST)
    assert len(traces) == 2
    assert again == fresh
    assert first != again, "no host memory changed nothing: the test shows no replay"


def test_a_budget_plan_made_again_traces_nothing(traces: list[StepTrace]) -> None:
    config = tiny()
    with pytest.raises(PlanSettingError) as refused:
        plan_memory(config, SHAPE, activation_swap="budget", activation_memory_budget=1)
    traced = len(traces)
    options = refused.value.options  # type: ignore[attr-defined]
    budget = min(option.peak_bytes for option in options)
    plan = plan_memory(config, SHAPE, activation_swap="budget", activation_memory_budget=budget)
    assert len(traces) == traced
    assert plan.timeline.peak_bytes <= budget


def test_what_a_trace_reads_traces_again(traces: list[StepTrace]) -> None:
    config = tiny()
    plan_memory(config, SHAPE, activation_swap="attention")
    plan_memory(config, dataclasses.replace(SHAPE, seq_len=256), activation_swap="attention")
    plan_memory(config, SHAPE, activation_swap="attention", profile="h100")
    plan_memory(config, SHAPE, activation_swap="attention", optimizer=False)
    assert len(plan_memory(tiny(3), SHAPE, activation_swap="attention").layers) == 3
    eager = tiny()
    eager._experts_implementation = "eager"  # private: not in the config's JSON
    with pytest.raises(PlanSettingError, match="experts_implementation"):
        plan_memory(eager, SHAPE, activation_swap="attention")
    assert len(traces) == 5


def test_a_refused_plan_is_refused_again(traces: list[StepTrace]) -> None:
    config = tiny()
    for _ in range(2):
        with pytest.raises(PlanSettingError, match="tp_size"):
            plan_memory(config, dataclasses.replace(SHAPE, tp_size=3), activation_swap="attention")
    assert traces == []


def test_a_fit_in_less_memory_traces_nothing(traces: list[StepTrace]) -> None:
    config = tiny()
    roomy = fit_sequence(config, SHAPE, modes=("attention",))
    assert len(traces) == len(roomy.traced) > 1
    peak = roomy.modes[0].points[1].peak_bytes
    tight = fit_sequence(config, SHAPE, memory_bytes=peak, modes=("attention",))
    assert len(traces) == len(roomy.traced)
    assert tight.modes[0].seq_len == 1024 < roomy.modes[0].seq_len  # type: ignore[operator]
