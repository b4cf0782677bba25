"""The clock contract replayed on hand-made traces: each rule of the runtime the planner
models, checked on a step small enough to work out by hand.

Two decoder layers, the link at 1 GB/s (1 MB copies in 1 ms), whole layers wrapped:
layer 0 saves storages that swap, layer 1 is the kept last layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from graphswap.planning._trace import Block, BlockKind, Event, TracedSave
from graphswap.planning._windows import step_times
from graphswap.planning.saved_tensors import LAYER_SCOPE, LayerTrace, SavedTensor, SavedTensorTrace
from graphswap.planning.trace import StepTrace, SwapChoice, SwapSchedule, replay
from graphswap.runtime.profile import device_profile

MB = 10**6
MS = 1e-3
LINK = device_profile("h200,link_gbps=1")


def _save(layer: int, index: int, block: int, nbytes: int) -> TracedSave:
    save = SavedTensor(
        index=index,
        shape=(nbytes // 4,),
        dtype=torch.float32,
        nbytes=nbytes,
        storage=block,
        storage_nbytes=nbytes,
        parameter=False,
        in_attention=False,
        policy_swaps=True,
    )
    return TracedSave(save, layer, block)


def _trace(
    events: Sequence[tuple[Event, Any]], saves: Sequence[TracedSave], sizes: Sequence[int]
) -> StepTrace:
    layers = tuple(
        LayerTrace(f"model.layers.{i}", False, tuple(s.save for s in saves if s.layer == i))
        for i in range(2)
    )
    return StepTrace(
        seq_len=1,
        batch_size=1,
        dtype=torch.float32,
        attn_implementation="eager",
        loss_head="full",
        loss_head_chunk_size=None,
        device="cpu",
        events=tuple(events),
        blocks=tuple(Block(n, BlockKind.ACTIVATION) for n in sizes),
        saves=tuple(saves),
        saved=SavedTensorTrace((), layers, (), None, None, 1),  # type: ignore[arg-type]
        policy="test",
        profile=LINK,
        parameter_bytes=0,
        buffer_bytes=0,
        optimizer_state_bytes=0,
    )


def _forward(layer: int, *body: tuple[Event, Any]) -> list[tuple[Event, Any]]:
    return [
        (Event.LABEL, f"F{layer}"),
        (Event.ENTER, (LAYER_SCOPE, layer)),
        *body,
        (Event.EXIT, (LAYER_SCOPE, layer)),
    ]


def _one_swapped_storage() -> StepTrace:
    """Layer 0 saves 2 MB after 1 ms and runs 1 ms more; layer 1 saves 2 MB (kept);
    the head runs 1 ms and drops the forward's own references; each backward 2 ms."""
    events = [
        *_forward(0, (Event.COMPUTE, MS), (Event.ALLOC, 0), (Event.PACK, 0), (Event.COMPUTE, MS)),
        *_forward(1, (Event.COMPUTE, MS), (Event.ALLOC, 1), (Event.PACK, 1)),
        (Event.LABEL, "head"),
        (Event.COMPUTE, MS),
        (Event.FREE, 0),
        (Event.FREE, 1),
        (Event.LABEL, "B1"),
        (Event.UNPACK, 1),
        (Event.COMPUTE, 2 * MS),
        (Event.RELEASE, 1),
        (Event.LABEL, "B0"),
        (Event.UNPACK, 0),
        (Event.COMPUTE, 2 * MS),
        (Event.RELEASE, 0),
    ]
    return _trace(events, [_save(0, 0, 0, 2 * MB), _save(1, 0, 1, 2 * MB)], [2 * MB, 2 * MB])


SWAP_BOTH = SwapChoice(LAYER_SCOPE, frozenset({0, 1}))


def test_compute_waits_for_the_offload_where_the_next_layer_begins() -> None:
    run = replay(_one_swapped_storage(), SWAP_BOTH)
    timeline = run.timeline
    # Copy 1..3 ms; layer 1 begins at 2 ms and waits 1 ms, in its own label.
    assert timeline.stalls == {"F1": pytest.approx(MS)}
    assert run.groups[0].forward_stall == pytest.approx(MS)
    assert run.groups[0].backward_stall == 0
    assert timeline.compute_seconds == pytest.approx(8 * MS)
    assert timeline.step_seconds == pytest.approx(9 * MS)
    # The kept last layer copies nothing; layer 0 comes back once.
    assert [g.offloaded_bytes for g in run.groups] == [2 * MB, 0]
    assert [g.reloaded_bytes for g in run.groups] == [2 * MB, 0]
    assert (timeline.d2h_seconds, timeline.h2d_seconds) == (pytest.approx(2 * MS),) * 2


def test_a_longer_offload_lag_moves_the_fence_and_the_stall_goes() -> None:
    run = replay(_one_swapped_storage(), SWAP_BOTH, SwapSchedule(swap_offload_lag=2))
    assert run.timeline.stalls == {} and run.timeline.step_seconds == pytest.approx(8 * MS)


def test_memory_follows_the_sources_the_reloads_and_autograds_releases() -> None:
    run = replay(_one_swapped_storage(), SWAP_BOTH)
    # 2 MB at 1 ms; 4 MB at 4 ms (layer 1's save, after the 1 ms stall); the head drops
    # layer 0's source (fenced already) at 5 ms and its reload is allocated at once;
    # layer 1's save is released at 7 ms, the reload when layer 0's save is, at 9 ms.
    assert run.timeline.memory == [
        (0.0, 0),
        (pytest.approx(1 * MS), 2 * MB),
        (pytest.approx(4 * MS), 4 * MB),
        (pytest.approx(5 * MS), 2 * MB),
        (pytest.approx(5 * MS), 4 * MB),
        (pytest.approx(7 * MS), 2 * MB),
        (pytest.approx(9 * MS), 0),
    ]
    assert (run.timeline.peak_bytes, run.timeline.peak_label) == (4 * MB, "F1")
    assert run.timeline.peak_seconds == pytest.approx(4 * MS)  # first reached


def test_without_swap_a_saved_storage_lives_until_autograd_releases_it() -> None:
    run = replay(_one_swapped_storage(), SwapChoice(None, frozenset()))
    memory = [nbytes for _, nbytes in run.timeline.memory]
    assert memory == [0, 2 * MB, 4 * MB, 2 * MB, 0]  # the frees at 4 ms drop nothing
    assert run.timeline.stalls == {} and run.timeline.step_seconds == pytest.approx(8 * MS)
    assert run.groups[0].offloaded_bytes == 0


def test_a_source_another_reference_holds_stays_on_device_after_its_copy() -> None:
    """The head keeps layer 0's storage (no FREE until after backward): the offload
    releases its reference, the memory stays."""
    trace = _one_swapped_storage()
    events = [e for e in trace.events if e != (Event.FREE, 0)] + [(Event.FREE, 0)]
    kept = _trace(events, trace.saves, [2 * MB, 2 * MB])
    run = replay(kept, SWAP_BOTH)
    assert max(nbytes for _, nbytes in run.timeline.memory) == 6 * MB  # both, and the reload


def _two_storages(unpack_order: Sequence[int]) -> StepTrace:
    """Layer 0 saves A (1 MB) then B (1 MB) with 2 ms between its first save and the
    next layer; layer 1's backward runs 1 ms, then layer 0's unpacks come 1 ms apart."""
    events = [
        *_forward(
            0,
            (Event.ALLOC, 0),
            (Event.PACK, 0),
            (Event.ALLOC, 1),
            (Event.PACK, 1),
            (Event.COMPUTE, 2 * MS),
        ),
        *_forward(1, (Event.ALLOC, 2), (Event.PACK, 2)),
        (Event.LABEL, "head"),
        (Event.FREE, 0),
        (Event.FREE, 1),
        (Event.FREE, 2),
        (Event.LABEL, "B1"),
        (Event.UNPACK, 2),
        (Event.COMPUTE, MS),
        (Event.RELEASE, 2),
        (Event.LABEL, "B0"),
    ]
    for save in unpack_order:
        events += [(Event.UNPACK, save), (Event.COMPUTE, MS), (Event.RELEASE, save)]
    saves = [_save(0, 0, 0, MB), _save(0, 1, 1, MB), _save(1, 0, 2, MB)]
    return _trace(events, saves, [MB, MB, MB])


def test_reloads_come_back_first_needed_first() -> None:
    """Backward reads the last save first: B's reload is issued first and is back when
    layer 0's backward begins; A's by the time it is read. In saving order B would wait."""
    swap = SwapChoice(LAYER_SCOPE, frozenset({0, 1}))
    run = replay(_two_storages([1, 0]), swap)
    assert run.timeline.stalls == {}
    assert run.groups[0].reloaded_bytes == 2 * MB


def test_an_unpack_waits_for_its_own_reload_only() -> None:
    """Read in saving order, A waits for B's reload ahead of it on the queue (1 ms)."""
    swap = SwapChoice(LAYER_SCOPE, frozenset({0, 1}))
    run = replay(_two_storages([0, 1]), swap)
    assert run.timeline.stalls == {"B0": pytest.approx(MS)}
    assert run.groups[0].backward_stall == pytest.approx(MS)


def test_windows_are_the_compute_between_issue_and_need() -> None:
    times = step_times(_one_swapped_storage(), LAYER_SCOPE, SwapSchedule())
    first = times.groups[0]
    assert first.forward_window == pytest.approx(2 * MS)  # layer 0's forward, to layer 1's start
    assert first.backward_window == pytest.approx(2 * MS)  # layer 1's backward
    assert times.pack_seconds == (pytest.approx(MS), pytest.approx(3 * MS))
    last = step_times(_one_swapped_storage(), LAYER_SCOPE, SwapSchedule()).groups[1]
    assert last.trigger_seconds is None and last.backward_window == 0
    # Past the last layer the fence is the first backward boundary.
    assert last.fence_seconds == pytest.approx(4 * MS)
