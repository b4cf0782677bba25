"""The planner's prediction against a clocked run of the real runtime (invariant I13).

The same tiny Qwen3-MoE step (forward, backward, AdamW) is planned on the meta device
and run for real on CPU over the simulated accelerator with the same device profile;
step time, stalls, the device-memory peak and the host pool's peak must agree within
3% in every mode and at two offload lags, with eager attention (every score computed)
and with sdpa's causal kernel (half of them). The profile's compute is slow enough that
attention and layer swap stall at ``offload_lag`` 1, and ``auto`` must then plan no
stall at all. Each step is traced once (neither the mode nor the lag changes what
runs), and each clocked run is made once for the tests that assert on it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch
from transformers import PretrainedConfig

import graphswap
from graphswap.hf.checkpoints import build_model, decoder_layers
from graphswap.hf.presets import qwen3_moe_config
from graphswap.passes.plan_executor import PlanExecutor
from graphswap.passes.specs import SWAP_RULES
from graphswap.passes.swap import apply_swap
from graphswap.planning import MemoryPlan, SwapMode
from graphswap.planning._budget import BudgetError, plan_budget
from graphswap.planning._settings import DEFAULT_HIDE_MARGIN
from graphswap.planning._units import RECOMPUTE_LEVELS, RecomputeKind
from graphswap.planning.saved_tensors import build_meta_model
from graphswap.planning.trace import StepShape, StepTrace, SwapSchedule, plan_step, trace_step
from graphswap.runtime import SwapManager
from graphswap.runtime.profile import device_profile
from graphswap.runtime.sim import SimulatedAccelerator
from graphswap.runtime.timeline import OPTIMIZER_LABEL, StepTimeline
from graphswap.train.trainer import state_bytes

PROFILE = device_profile("h200,tflops=60,hbm_gbps=1980")
"""At these figures the tiny model's 2 MiB attention probabilities copy in about as
long as a layer's forward: attention and layer swap stall at offload_lag 1."""
SEQ, BATCH = 256, 2
CAUSAL_SEQ = 512
"""sdpa saves q, k, v and the output, not the probabilities: at 512 tokens they reach the
1 MiB swap threshold."""
TOLERANCE = 0.03


@pytest.fixture(scope="module")
def config() -> PretrainedConfig:
    return qwen3_moe_config("tiny", attn_implementation="eager")


def _trace(
    config: PretrainedConfig, seq: int, recompute: tuple[RecomputeKind, ...] = ()
) -> StepTrace:
    meta = build_meta_model(
        config,
        StepShape(
            seq_len=seq,
            batch_size=BATCH,
            dtype=torch.float32,
            attn_implementation=config._attn_implementation,
            device="cpu",
        ),
        recompute=recompute,
    )
    return trace_step(meta, PROFILE)


@pytest.fixture(scope="module")
def trace(config: PretrainedConfig) -> StepTrace:
    return _trace(config, SEQ)


def predict(
    config: PretrainedConfig, trace: StepTrace, mode: SwapMode, offload_lag: int
) -> MemoryPlan:
    return plan_step(
        config, trace, schedule=SwapSchedule(swap_offload_lag=offload_lag), activation_swap=mode
    )


def measure(
    config: PretrainedConfig,
    plan: MemoryPlan,
    mode: SwapMode,
    offload_lag: int,
    max_host_bytes: int | None = None,
) -> tuple[StepTimeline, float, int]:
    """The second step (the first makes the optimizer state and the host buffers) of the
    real runtime on the clocked simulated accelerator, its loss and the host pool's peak;
    ``max_host_bytes``: the pool's cap (the swap pass's manager takes this node's)."""
    torch.manual_seed(0)
    model = build_model(config, device="cpu", dtype=torch.float32).train()
    sim = SimulatedAccelerator(profile=PROFILE)
    report = None
    if max_host_bytes is not None:
        manager = SwapManager(
            swap_offload_lag=offload_lag, engine=sim, max_host_bytes=max_host_bytes
        )
        report = graphswap.rewrite(model, rules=[SWAP_RULES[mode]], manager=manager)
    elif mode != "none":
        planned = mode in ("auto", "budget")
        auto = PlanExecutor(plan, made_for="the agreement test") if planned else None
        report = apply_swap(
            model, activation_swap=mode, swap_offload_lag=offload_lag, engine=sim, executor=auto
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(
        0, config.vocab_size, (BATCH, plan.seq_len), generator=torch.Generator().manual_seed(0)
    )

    def step() -> float:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.item()

    step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _, layers = decoder_layers(model)
    with sim.clock(layers, base_bytes=state_bytes(model, optimizer)) as clock:
        loss = step()
        clock.label(OPTIMIZER_LABEL)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    host_peak = 0 if report is None else report.manager.stats.peak_host_bytes
    return clock.timeline, loss, host_peak


def assert_agrees(predicted: StepTimeline, measured: StepTimeline) -> None:
    """Step time, compute, stalls and peak within :data:`TOLERANCE`."""
    assert predicted.step_seconds == pytest.approx(measured.step_seconds, rel=TOLERANCE)
    assert predicted.compute_seconds == pytest.approx(measured.compute_seconds, rel=TOLERANCE)
    assert predicted.stall_seconds == pytest.approx(
        measured.stall_seconds, rel=TOLERANCE, abs=TOLERANCE * 1e-2 * measured.step_seconds
    )
    assert predicted.peak_bytes == pytest.approx(measured.peak_bytes, rel=TOLERANCE)


Clocked = Callable[[SwapMode, int], tuple[MemoryPlan, StepTimeline, float, int]]


def _clocked(config: PretrainedConfig, trace: StepTrace) -> Clocked:
    @functools.cache
    def run(mode: SwapMode, offload_lag: int) -> tuple[MemoryPlan, StepTimeline, float, int]:
        plan = predict(config, trace, mode, offload_lag)
        return (plan, *measure(config, plan, mode, offload_lag))

    return run


@pytest.fixture(scope="module")
def clocked(config: PretrainedConfig, trace: StepTrace) -> Clocked:
    """``clocked(mode, offload_lag)``: the plan, and the clocked run of it with its loss
    and host peak."""
    return _clocked(config, trace)


@pytest.fixture(scope="module", params=["eager", "sdpa"])
def attention_clocked(request: pytest.FixtureRequest, clocked: Clocked) -> Clocked:
    """``clocked`` with eager attention at 256 tokens, or sdpa's causal CPU kernel at 512."""
    if request.param == "eager":
        return clocked
    config = qwen3_moe_config("tiny", attn_implementation="sdpa")
    return _clocked(config, _trace(config, CAUSAL_SEQ))


@pytest.mark.parametrize("offload_lag", [1, 2])
@pytest.mark.parametrize("mode", ["none", "attention", "layer", "auto"])
def test_the_plan_agrees_with_the_clocked_runtime(
    attention_clocked: Clocked, mode: SwapMode, offload_lag: int, one_thread: None
) -> None:
    plan, measured, _, host_peak = attention_clocked(mode, offload_lag)
    predicted = plan.timeline
    assert_agrees(predicted, measured)
    assert predicted.peak_label == measured.peak_label
    if mode in ("attention", "layer") and offload_lag == 1:
        assert measured.stall_seconds > 0.05 * measured.compute_seconds, "the case must stall"
    if mode == "auto":
        assert measured.stall_seconds == predicted.stall_seconds == 0.0
    if mode != "none":
        assert predicted.peak_bytes <= plan.baseline.peak_bytes
    assert plan.host_peak_bytes == host_peak


@pytest.mark.parametrize("mode", ["attention", "layer"])
def test_a_full_host_pool_keeps_on_device_what_the_plan_says(
    config: PretrainedConfig, trace: StepTrace, mode: SwapMode, one_thread: None
) -> None:
    """A pool of 5 MiB holds two of the three 2 MiB probabilities swap would move: the
    third stays on device in the run and in the plan, and step, stalls, peak and the
    pool's peak agree."""
    budget = 5 << 20
    plan = plan_step(
        config,
        trace,
        schedule=SwapSchedule(swap_offload_lag=1, max_host_bytes=budget),
        activation_swap=mode,
    )
    measured, _, host_peak = measure(config, plan, mode, 1, max_host_bytes=budget)
    assert plan.refused_bytes > 0 and plan.host_peak_bytes == host_peak <= budget
    predicted = plan.timeline
    assert predicted.step_seconds == pytest.approx(measured.step_seconds, rel=TOLERANCE)
    assert predicted.stall_seconds == pytest.approx(
        measured.stall_seconds, rel=TOLERANCE, abs=TOLERANCE * 1e-2 * measured.step_seconds
    )
    assert predicted.peak_bytes == pytest.approx(measured.peak_bytes, rel=TOLERANCE)
    roomy = plan_step(
        config, trace, schedule=SwapSchedule(swap_offload_lag=1), activation_swap=mode
    )
    assert predicted.peak_bytes > roomy.timeline.peak_bytes


def test_the_causal_kernel_is_timed_on_half_the_scores(attention_clocked: Clocked) -> None:
    """The sdpa plan's attention is timed causal (the eager one computes every score)."""
    plan = attention_clocked("none", 1)[0]
    expected = ("causal",) if plan.attn_implementation == "sdpa" else ()
    assert plan.attention_timing == expected


def test_auto_swaps_part_of_a_layer_stack_without_a_stall_where_layer_stalls(
    config: PretrainedConfig, trace: StepTrace, clocked: Clocked, one_thread: None
) -> None:
    """At offload_lag 2 the first two layers' copies stall (layer 1's by 9 us), the last
    swappable layer's does not: auto takes only what hides, and the run of that choice
    on the clocked device does not stall either."""
    layer = predict(config, trace, "layer", 2)
    auto, measured, *_ = clocked("auto", 2)
    assert 0 < auto.swapped_bytes < layer.swapped_bytes
    assert layer.timeline.stall_seconds > 0 == measured.stall_seconds


def test_losses_are_bitwise_equal_with_and_without_swap_on_the_clocked_device(
    clocked: Clocked, one_thread: None
) -> None:
    losses = {mode: clocked(mode, 1)[2] for mode in ("none", "attention", "layer")}
    assert losses["none"] == losses["attention"] == losses["layer"]


def test_a_plan_budgeted_against_backward_alone_stalls_the_simulated_forward(
    config: PretrainedConfig, trace: StepTrace, one_thread: None
) -> None:
    """The old rule took per layer what copies in 90% of the backward its prefetch
    overlaps. Each tiny layer has one swappable storage, so that rule swaps a layer's
    storage whole or not at all; carried out on the clocked device, its fences stall
    forward, where auto's own plan does not."""
    layer, auto = predict(config, trace, "layer", 1), predict(config, trace, "auto", 1)
    old_layers = tuple(
        dataclasses.replace(
            mine, swapped_saves=whole.swapped_saves, offloaded_bytes=whole.offloaded_bytes
        )
        if whole.copy_seconds <= (1 - DEFAULT_HIDE_MARGIN) * whole.backward_window
        else dataclasses.replace(mine, swapped_saves=(), offloaded_bytes=0)
        for mine, whole in zip(auto.layers, layer.layers, strict=True)
    )
    assert any(old.swapped_saves for old in old_layers)
    old = dataclasses.replace(auto, layers=old_layers)
    measured, *_ = measure(config, old, "auto", 1)
    forward_stall = sum(s for label, s in measured.stalls.items() if label.startswith("F"))
    assert forward_stall > 0.05 * measured.compute_seconds
    assert auto.timeline.stall_seconds == 0.0


@pytest.fixture(scope="module")
def level_traces(
    config: PretrainedConfig, trace: StepTrace
) -> Callable[[tuple[RecomputeKind, ...]], StepTrace]:
    """The step traced at each recompute level, once for the module's budget tests."""
    return functools.cache(lambda kinds: trace if not kinds else _trace(config, SEQ, kinds))


@pytest.fixture(scope="module")
def budget_clocked(
    config: PretrainedConfig,
    level_traces: Callable[[tuple[RecomputeKind, ...]], StepTrace],
    clocked: Clocked,
) -> tuple[MemoryPlan, StepTimeline, float, int]:
    """A budget plan made at 70% of the peak without swap, which takes recompute and swap
    both, and its clocked run."""
    none_plan = clocked("none", 1)[0]
    plan = plan_budget(
        config,
        level_traces,
        schedule=SwapSchedule(
            swap_hide_margin=DEFAULT_HIDE_MARGIN,
            swap_offload_lag=1,
            swap_prefetch_depth=1,
            state_shards=1,
            max_host_bytes=None,
        ),
        budget=int(0.7 * none_plan.timeline.peak_bytes),
    )
    return (plan, *measure(config, plan, "budget", 1))


def test_the_budget_plan_agrees_with_the_clocked_runtime_with_recompute(
    budget_clocked: tuple[MemoryPlan, StepTimeline, float, int], clocked: Clocked, one_thread: None
) -> None:
    plan, measured, loss, host_peak = budget_clocked
    assert plan.recompute and plan.recomputed_bytes > 0, "the case must recompute"
    assert plan.swapped_bytes > 0, "the case must swap"
    predicted = plan.timeline
    assert_agrees(predicted, measured)
    assert measured.peak_bytes <= plan.activation_memory_budget
    assert plan.host_peak_bytes == host_peak
    assert loss == clocked("none", 1)[2], "recompute and swap change no number"


@pytest.mark.parametrize("level", RECOMPUTE_LEVELS[1:])
def test_each_recompute_level_agrees_with_the_clocked_runtime_within_its_budget(
    level: tuple[RecomputeKind, ...],
    config: PretrainedConfig,
    level_traces: Callable[[tuple[RecomputeKind, ...]], StepTrace],
    clocked: Clocked,
    one_thread: None,
) -> None:
    """At the peak of ``level`` swapping what hides: the norms (level 1), the matmul
    outputs saved through the swap (level 2), but for the experts' down projections,
    which run again (level 3), the whole block (level 4), the whole layer recomputed
    inside its swap (level 5). A budget set to the plan's own peak holds to the byte on
    the clock."""
    schedule = SwapSchedule(swap_offload_lag=1)
    with pytest.raises(BudgetError) as info:
        plan_budget(config, level_traces, budget=1, schedule=schedule)
    budget = next(
        o.peak_bytes for o in info.value.options if (o.recompute, o.swap) == (level, "auto")
    )
    plan = plan_budget(config, level_traces, budget=budget, schedule=schedule)
    assert plan.recompute == level and plan.recomputed_bytes > 0
    measured, loss, host_peak = measure(config, plan, "budget", 1)
    assert_agrees(plan.timeline, measured)
    assert measured.peak_bytes <= budget
    assert plan.host_peak_bytes == host_peak
    assert loss == clocked("none", 1)[2], "recompute and swap change no number"
