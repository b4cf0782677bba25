"""The planner on a traced training step: the whole step is seen, memory is everything on
the device, both copy windows bind, ``auto`` never plans a stall, and ``fit_sequence``."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from graphswap.hf.presets import qwen3_moe_config
from graphswap.planning import MemoryPlan, fit_sequence, plan_memory
from graphswap.planning._auto import plan_auto
from graphswap.planning._trace import BlockKind, Event
from graphswap.planning._windows import step_times
from graphswap.planning.saved_tensors import LAYER_SCOPE, build_meta_model
from graphswap.planning.trace import (
    StepShape,
    StepTrace,
    SwapSchedule,
    layer_candidates,
    plan_step,
    replay,
    swap_choice,
    trace_step,
)
from graphswap.runtime.profile import device_profile

GIB = 1 << 30


def test_the_trace_sees_forward_backward_and_the_optimizer(tiny_trace: StepTrace) -> None:
    labels = [payload for event, payload in tiny_trace.events if event is Event.LABEL]
    steps = [label for label in labels if label != "head"]  # "head" also between layers
    assert steps == [
        "embed",
        *(f"F{i}" for i in range(4)),
        *(f"B{i}" for i in reversed(range(4))),
        "optimizer",
    ]
    assert labels[labels.index("F3") + 1] == "head"
    counts = collections.Counter(event for event, _ in tiny_trace.events)
    saves = len(tiny_trace.saves)
    assert counts[Event.PACK] == counts[Event.UNPACK] == counts[Event.RELEASE] == saves > 0
    assert counts[Event.ALLOC] == counts[Event.FREE]  # a steady step: nothing outlives it
    kinds = collections.Counter(block.kind for block in tiny_trace.blocks)
    assert kinds[BlockKind.GRADIENT] == 47 and kinds[BlockKind.OPTIMIZER] > 0
    # Both scopes' boundaries, for every layer.
    for scope in ("attention", "layer"):
        for event in (Event.ENTER, Event.EXIT):
            assert [p[1] for e, p in tiny_trace.events if e is event and p[0] == scope] == [
                0,
                1,
                2,
                3,
            ]


def test_the_base_is_parameters_buffers_and_adamw_state(tiny_trace: StepTrace) -> None:
    config = qwen3_moe_config("tiny")
    params = tiny_trace.parameter_bytes
    assert tiny_trace.optimizer_state_bytes == 2 * params  # exp_avg, exp_avg_sq in float32
    plan = plan_step(config, tiny_trace, activation_swap="layer")
    for timeline in (plan.timeline, plan.baseline):
        assert timeline.base_bytes == 3 * params + tiny_trace.buffer_bytes
        assert timeline.memory[0] == (0.0, timeline.base_bytes)
        assert timeline.memory[-1][1] == timeline.base_bytes  # everything the step made is gone
    assert plan.timeline.peak_bytes < plan.baseline.peak_bytes


def test_state_shards_divide_parameters_gradients_and_the_optimizer(tiny_trace: StepTrace) -> None:
    config = qwen3_moe_config("tiny")
    one = plan_step(config, tiny_trace, activation_swap="none")
    two = plan_step(
        config, tiny_trace, schedule=SwapSchedule(state_shards=2), activation_swap="none"
    )
    state = tiny_trace.parameter_bytes + tiny_trace.optimizer_state_bytes
    assert one.baseline.base_bytes - two.baseline.base_bytes == state // 2
    gradients = sum(b.nbytes for b in tiny_trace.blocks if b.kind is BlockKind.GRADIENT)
    computed = _compute_by_label(tiny_trace)
    backward_done = sum(seconds for seconds, label in computed if label != "optimizer")
    # When the optimizer starts, what the step holds beyond the state is the gradients.
    held = [
        _held_at(plan.baseline.memory, backward_done) - plan.baseline.base_bytes
        for plan in (one, two)
    ]
    assert held[0] >= gradients and held[0] - held[1] == pytest.approx(gradients / 2, abs=64)
    optimizer = sum(seconds for seconds, label in computed if label == "optimizer")
    assert one.baseline.compute_seconds - two.baseline.compute_seconds == pytest.approx(
        optimizer / 2
    )
    assert any("FSDP-style over 2 ranks" in text for text in two.assumptions)


def _held_at(memory: list[tuple[float, int]], seconds: float) -> int:
    return [nbytes for t, nbytes in memory if t <= seconds * (1 + 1e-9)][-1]


def _compute_by_label(trace: StepTrace) -> list[tuple[float, str]]:
    label, out = "", []
    for event, payload in trace.events:
        if event is Event.LABEL:
            label = payload
        elif event is Event.COMPUTE:
            out.append((payload, label))
    return out


@pytest.fixture(scope="module")
def qwen3_30b() -> tuple[StepTrace, MemoryPlan, MemoryPlan]:
    """Qwen3-30B-A3B at seq 8192, bf16, flash, on the H200 profile (50 GB/s, 400 TFLOP/s),
    its state sharded over 8 ranks: one trace of the 48 layers, planned with attention
    swap and with auto."""
    config = qwen3_moe_config("qwen3-30b-a3b")
    meta = build_meta_model(config, StepShape(seq_len=8192))
    trace = trace_step(meta, device_profile("h200"))
    attention = plan_step(
        config, trace, schedule=SwapSchedule(state_shards=8), activation_swap="attention"
    )
    auto = plan_step(config, trace, schedule=SwapSchedule(state_shards=8), activation_swap="auto")
    return trace, attention, auto


def test_attention_swap_of_qwen3_30b_stalls_the_forward(
    qwen3_30b: tuple[StepTrace, MemoryPlan, MemoryPlan],
) -> None:
    """393 MiB a layer copies in 8.2 ms, a layer's forward lasts 6.5 ms: each layer's
    fence waits; the backward (15 ms) hides the reload."""
    _, attention, _ = qwen3_30b
    for layer in attention.layers[:-1]:
        assert layer.swappable_bytes == 393 << 20
        assert layer.copy_seconds == pytest.approx(8.24e-3, rel=1e-3)
        assert layer.forward_window < layer.copy_seconds < layer.backward_window
        assert layer.forward_stall > 1e-3 and layer.backward_stall == 0
        assert layer.verdict() == "STALLS" and not layer.hides
    # The step is longer by its stalls, and they are a real share of it (6% on torch
    # 2.13, 5% on 2.9, whose meta kernels run other elementwise operators).
    extra = attention.timeline.step_seconds - attention.baseline.step_seconds
    assert extra == pytest.approx(attention.timeline.stall_seconds, rel=1e-6)
    assert attention.timeline.stall_seconds > 0.03 * attention.baseline.step_seconds
    forward_labels = {label for label in attention.timeline.stalls if label.startswith("F")}
    assert len(forward_labels) == 47


def test_auto_on_qwen3_30b_hides_both_windows_and_swaps_as_much_as_fits(
    qwen3_30b: tuple[StepTrace, MemoryPlan, MemoryPlan],
) -> None:
    trace, _, auto = qwen3_30b
    assert auto.timeline.stall_seconds == 0 and auto.step_ratio <= 1.01
    assert all(layer.hides for layer in auto.layers) and auto.all_hide
    assert auto.swapped_bytes > 0 and auto.timeline.peak_label == auto.baseline.peak_label == "head"
    assert auto.timeline.peak_bytes < auto.baseline.peak_bytes
    # As much as fits: in a middle layer, any tensor more would stall with the link at
    # (1 - margin) of its bandwidth, which is what each copy may fill.
    margin = auto.swap_hide_margin
    assert margin == 0.1
    narrower = dataclasses.replace(
        trace, profile=trace.profile.with_figures(link_gbps=(1 - margin) * 50)
    )
    candidates = layer_candidates(trace.saved)
    plan = [
        [c for c in candidates[layer.name] if c.saves[0] in layer.swapped_saves]
        for layer in auto.layers
    ]
    at_lag = SwapSchedule(swap_offload_lag=auto.swap_offload_lag)
    assert replay(narrower, swap_choice(trace, plan), at_lag).timeline.stalls == {}
    middle = auto.layers[24]
    left = [c for c in candidates[middle.name] if c.saves[0] not in middle.swapped_saves]
    assert left
    for extra in left:
        more = [list(cs) for cs in plan]
        more[24].append(extra)
        stalled = replay(narrower, swap_choice(trace, more), at_lag)
        assert stalled.timeline.stall_seconds > 0


def test_a_plan_budgeted_against_backward_alone_stalls_in_forward(
    qwen3_30b: tuple[StepTrace, MemoryPlan, MemoryPlan],
) -> None:
    """The old rule: per layer, largest first, what copies in 90% of the backward it
    overlaps (the window of its prefetch). Replayed, every fence waits."""
    trace, _, auto = qwen3_30b
    windows = step_times(trace, LAYER_SCOPE, SwapSchedule()).groups
    candidates = layer_candidates(trace.saved)
    plan = []
    for i, layer in enumerate(auto.layers):
        budget = 0.0 if layer.kept else 0.9 * windows[i].backward_window * 50e9
        chosen, used = [], 0
        for c in sorted(candidates[layer.name], key=lambda c: -c.nbytes):
            if used + c.nbytes <= budget:
                chosen.append(c)
                used += c.nbytes
        plan.append(chosen)
    old = replay(trace, swap_choice(trace, plan))
    assert sum(len(c) for c in plan) > sum(len(layer.swapped_saves) > 0 for layer in auto.layers)
    assert all(g.forward_stall > 0 for g in old.groups[:-1])
    assert old.timeline.step_seconds > 1.05 * auto.baseline.step_seconds


def test_longer_lag_and_depth_widen_the_windows(
    qwen3_30b: tuple[StepTrace, MemoryPlan, MemoryPlan],
) -> None:
    trace, attention, _ = qwen3_30b
    config = qwen3_moe_config("qwen3-30b-a3b")
    lagged = plan_step(
        config,
        trace,
        schedule=SwapSchedule(swap_offload_lag=2, swap_prefetch_depth=2, state_shards=8),
        activation_swap="attention",
    )
    middle, wider = attention.layers[10], lagged.layers[10]
    assert wider.forward_window == pytest.approx(2 * middle.forward_window, rel=1e-6)
    assert wider.backward_window == pytest.approx(2 * middle.backward_window, rel=1e-2)
    # The link still moves 8.2 ms a layer in 6.5 ms of forward: the backlog stalls, less.
    assert 0 < lagged.timeline.stall_seconds < attention.timeline.stall_seconds


def test_auto_takes_back_what_the_replay_shows_stalling(
    slow_compute_at: Callable[[float], StepTrace],
) -> None:
    """Planned at twice the link (a margin of -1), the simulated queues overbook; the
    verifying replays drop tensors until the step at the real link stalls nowhere."""
    trace = slow_compute_at(2.0)
    saved = trace.saved
    candidates = layer_candidates(saved)
    overbooked = SwapSchedule()
    object.__setattr__(overbooked, "swap_hide_margin", -1.0)  # below what a user may set
    auto = plan_auto(trace, [candidates[layer.name] for layer in saved.layers], overbooked)
    assert auto.dropped > 0
    assert auto.replay.timeline.stalls == {}
    assert any(auto.chosen[:-1])


def test_the_state_of_qwen3_30b_does_not_fit_one_h200_and_the_fix_is_named() -> None:
    fit = fit_sequence(qwen3_moe_config("qwen3-30b-a3b"))
    assert not fit.state_fits and fit.modes == () and fit.traced == ()
    assert fit.optimizer_state_bytes == 2 * fit.parameter_bytes == 2 * fit.gradient_bytes
    assert fit.state_bytes > fit.memory_bytes == 141 * 10**9
    assert fit.shards_needed == 2


def test_with_the_state_sharded_auto_fits_longer_than_none_at_no_cost() -> None:
    config = qwen3_moe_config("qwen3-30b-a3b", num_hidden_layers=4)
    tight = fit_sequence(config, memory_bytes=20 * GIB, modes=("none", "auto"))
    assert not tight.state_fits and tight.shards_needed == 2
    sharded = SwapSchedule(state_shards=4)
    fit = fit_sequence(config, memory_bytes=24 * GIB, schedule=sharded, modes=("none", "auto"))
    none, auto = fit.modes
    assert fit.state_fits and none.seq_len is not None and auto.seq_len is not None
    assert auto.seq_len > none.seq_len and auto.plan is not None and auto.plan.step_ratio <= 1.01
    assert auto.plan.timeline.peak_bytes <= fit.memory_bytes
    assert not auto.capped and auto.seq_len % fit.seq_step == 0
    assert none.plan is not None and none.plan.seq_len == none.seq_len
    longer = plan_memory(
        config,
        StepShape(seq_len=none.seq_len + fit.seq_step),
        activation_swap="none",
        schedule=SwapSchedule(state_shards=4),
    )
    assert longer.timeline.peak_bytes > fit.memory_bytes  # the next step does not fit


def test_a_model_that_fits_at_its_longest_sequence_says_so() -> None:
    config = qwen3_moe_config("tiny", num_hidden_layers=1)
    step = StepShape(seq_len=512, dtype=torch.float32, device="cpu")
    fit = fit_sequence(config, step, modes=("none",))
    (none,) = fit.modes
    assert none.capped and none.seq_len == fit.max_seq == 2048


def test_a_step_without_the_optimizer_holds_parameters_and_buffers_only(
    tiny_trace: StepTrace,
) -> None:
    """The benchmark's step (zero-grad, forward, backward): no AdamW state before it and no
    optimizer label in it; the default step (``tiny_trace``, the same shape) is unchanged."""
    config = qwen3_moe_config("tiny")
    shape: dict[str, Any] = {
        "seq_len": 512,
        "batch_size": 2,
        "dtype": torch.float32,
        "device": "cpu",
    }
    plan = plan_memory(config, StepShape(**shape), optimizer=False, activation_swap="attention")
    meta = build_meta_model(config, StepShape(**shape))
    trace = trace_step(meta, device_profile("h200"), optimizer=False)
    assert trace.optimizer_state_bytes == 0 and not trace.optimizer
    held = trace.parameter_bytes + trace.buffer_bytes
    for timeline in (plan.timeline, plan.baseline):
        assert timeline.base_bytes == held
        assert "optimizer" not in timeline.stalls
        assert timeline.peak_label != "optimizer"
    labels = {payload for event, payload in trace.events if event is Event.LABEL}
    assert "optimizer" not in labels
    assert not any(block.kind is BlockKind.OPTIMIZER for block in trace.blocks)
    assert "without optimizer" in plan.assumptions[0]
    with_optimizer = plan_step(config, tiny_trace, activation_swap="attention")
    assert with_optimizer.baseline.base_bytes == held + 2 * trace.parameter_bytes
    assert with_optimizer.baseline.step_seconds > plan.baseline.step_seconds
    # What leaves the device does not depend on the optimizer.
    assert with_optimizer.swapped_bytes == plan.swapped_bytes > 0
