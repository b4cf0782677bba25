"""A step at any length of a grid from a few traces: interpolated, it is the traced step.

The fit plans every multiple of its step; these tests hold what that rests on: the
interpolated step is what a trace at that length gives (sizes, shapes, the policy's
answers across the 1 MiB threshold, operator times), and a model whose operators change
with the length is traced where they change.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
import torch

from graphswap.hf.presets import qwen3_moe_config
from graphswap.planning._lengths import ELIGIBLE, TraceLengths, _structure
from graphswap.planning._trace import Event
from graphswap.planning._units import RecomputeKind
from graphswap.planning.saved_tensors import build_meta_model
from graphswap.planning.trace import StepShape, StepTrace, trace_step
from graphswap.runtime import _handles
from graphswap.runtime.policy import MIN_SWAP_TENSOR_BYTES, SwapPolicy, swap_large_activations
from graphswap.runtime.profile import device_profile

PROFILE = device_profile("h200")
GRID = [64 * k for k in range(1, 17)]
"""64 to 1024 tokens: the tiny model's attention tensors cross 1 MiB inside it."""


def _tracer(
    layers: Callable[[int], int], attn: str, recompute: tuple[RecomputeKind, ...] = ()
) -> Callable[[int, SwapPolicy], StepTrace]:
    def trace(seq: int, policy: SwapPolicy) -> StepTrace:
        config = qwen3_moe_config("tiny", num_hidden_layers=layers(seq), attn_implementation=attn)
        meta = build_meta_model(
            config,
            StepShape(
                seq_len=seq,
                batch_size=2,
                dtype=torch.float32,
                attn_implementation=attn,
                device="cpu",
            ),
            recompute=recompute,
        )
        return trace_step(meta, PROFILE, policy)

    return trace


def _lengths(trace: Callable[[int, SwapPolicy], StepTrace]) -> TraceLengths:
    return TraceLengths(trace, GRID, min_bytes=MIN_SWAP_TENSOR_BYTES, name="swap_large_activations")


def _assert_same_step(made: StepTrace, traced: StepTrace) -> None:
    assert made.seq_len == traced.seq_len and made.policy == traced.policy
    assert [(e, p) for e, p in made.events if e is not Event.COMPUTE] == [
        (e, p) for e, p in traced.events if e is not Event.COMPUTE
    ]
    made_compute = [p for e, p in made.events if e is Event.COMPUTE]
    traced_compute = [p for e, p in traced.events if e is Event.COMPUTE]
    assert made_compute == pytest.approx(traced_compute, rel=1e-9)
    assert made.blocks == traced.blocks
    assert [(s.layer, s.block, s.save) for s in made.saves] == [
        (s.layer, s.block, s.save) for s in traced.saves
    ]
    assert made.saved.layers == traced.saved.layers
    assert (made.saved.embed, made.saved.head) == (traced.saved.embed, traced.saved.head)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_an_interpolated_step_is_the_traced_step(attn: str, one_thread: None) -> None:
    """Four traces serve the sixteen lengths; eager's probabilities grow as seq², sdpa's
    causal kernel's time too; saves cross the swap threshold between the traces."""
    trace = _tracer(lambda seq: 2, attn)
    lengths = _lengths(trace)
    assert len(lengths.traced) == 4
    untraced = [seq for seq in GRID if seq not in lengths.traced]
    crossing = 0
    for seq in (untraced[0], untraced[len(untraced) // 2], untraced[-1]):
        made, traced = lengths(seq), trace(seq, swap_large_activations)
        _assert_same_step(made, traced)
        crossing += sum(s.save.policy_swaps for s in traced.saves)
    first = lengths(GRID[0])
    assert not any(s.save.policy_swaps for s in first.saves)  # all under 1 MiB at 64
    assert crossing > 0


def test_a_model_whose_operators_change_is_traced_where_they_change(one_thread: None) -> None:
    """From 640 tokens on the step has a third layer: no range spans the change, and
    every length is still its own traced step."""
    trace = _tracer(lambda seq: 2 if seq < 640 else 3, "sdpa")
    lengths = _lengths(trace)
    assert 4 < len(lengths.traced) < len(GRID)
    assert {576, 640} <= set(lengths.traced)
    for seq in GRID:
        made = lengths(seq)
        assert made.num_layers == (2 if seq < 640 else 3)
        if seq not in lengths.traced:
            _assert_same_step(made, trace(seq, swap_large_activations))


def test_a_length_off_the_grid_is_refused(one_thread: None) -> None:
    lengths = _lengths(_tracer(lambda seq: 2, "sdpa"))
    with pytest.raises(ValueError, match="not a length of this grid"):
        lengths(GRID[-1] + 64)


def test_a_recompute_level_takes_the_checked_ranges_from_three_traces(one_thread: None) -> None:
    """A step with recompute runs again operators the step without it runs: the ranges
    the latter checked serve it from three traces, and each length is still its trace."""
    plain = _lengths(_tracer(lambda seq: 2, "sdpa"))
    trace = _tracer(lambda seq: 2, "sdpa", ("norms", "mlp_memory_bound"))
    lengths = TraceLengths(
        trace, GRID, min_bytes=MIN_SWAP_TENSOR_BYTES, name="swap_large_activations", like=plain
    )
    assert len(lengths.traced) == 3
    for seq in (GRID[1], GRID[9], GRID[-2]):
        made = lengths(seq)
        _assert_same_step(made, trace(seq, swap_large_activations))
        assert made.recomputed_bytes == trace(seq, swap_large_activations).recomputed_bytes


def test_the_first_recompute_step_of_a_process_is_traced_as_every_later_one(
    one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime makes one empty tensor per device, once per process, when a recompute
    first keeps a version alias: no traced step counts it as its own storage. Were it
    counted, the first step traced in a fresh process (a user's ``--fit``) would hold a
    storage no later one holds, and a range checked without it would be traced length
    by length."""
    monkeypatch.setattr(_handles, "_NO_BYTES", {})  # as a fresh process has it
    trace = _tracer(lambda seq: 2, "sdpa", ("norms",))
    first, again = trace(GRID[0], ELIGIBLE), trace(GRID[0], ELIGIBLE)
    assert _structure(first) == _structure(again)
    assert first.blocks == again.blocks
    counts = collections.Counter(event for event, _ in first.events)
    assert counts[Event.ALLOC] == counts[Event.FREE]  # every storage of the step dies in it
