"""``auto``: per decoder layer, the saved tensors whose copies hide in both windows.

A layer's offloads must be done by the fence ``swap_offload_lag`` layers later, and each
of its reloads, issued when backward reaches the layer ``swap_prefetch_depth`` links
later, before the unpack that needs it. Both queues are first in, first out, across
layers. The choice simulates both on the traced step's compute times with the link at
``1 - swap_hide_margin`` of its bandwidth (so no copy fills more than that share of its
window): forward, layer by layer, largest first, every tensor that still meets the
fence; then backward, layer by layer from the last, of those the largest that still
meet their unpacks. The plan is then replayed under the contract at the full link; a
layer that still stalls gives up its smallest tensor until no replay stalls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from graphswap.planning._replay import Replay, SwapChoice, replay
from graphswap.planning._settings import SwapSchedule
from graphswap.planning._trace import StepTrace
from graphswap.planning._windows import StepTimes, step_times
from graphswap.planning.saved_tensors import LAYER_SCOPE, SavedTensor, SavedTensorTrace
from graphswap.runtime._pool import size_class


@dataclass(frozen=True)
class SwapCandidate:
    """One storage ``layer`` swap would move: its bytes and every save of it."""

    nbytes: int
    """The storage's size: what its copy moves."""
    saves: tuple[SavedTensor, ...]
    """In saving order; their ``index`` is what the runtime policy is told."""


def layer_candidates(trace: SavedTensorTrace) -> dict[str, list[SwapCandidate]]:
    """Per layer, the storages whole-layer swap moves, in order of first save.

    A storage qualifies when the policy swaps its first save and all its saves are in
    this layer's forward, where the runtime hands later saves of it (views the policy
    would keep included) the first one's copy: a copy frees nothing while a save
    elsewhere keeps the storage (the rotary cos/sin that every layer saves).
    """
    scopes: dict[int, set[str]] = {}
    first_swaps: dict[int, bool] = {}
    for scope, saves in trace.scopes().items():
        for save in saves:
            scopes.setdefault(save.storage, set()).add(scope)
            first_swaps.setdefault(save.storage, save.policy_swaps)
    candidates: dict[str, list[SwapCandidate]] = {}
    for layer in trace.layers:
        by_storage: dict[int, list[SavedTensor]] = {}
        for save in layer.saves:
            by_storage.setdefault(save.storage, []).append(save)
        candidates[layer.name] = [
            SwapCandidate(saves[0].storage_nbytes, tuple(saves))
            for storage, saves in by_storage.items()
            if first_swaps[storage] and scopes[storage] == {layer.name}
        ]
    return candidates


def swap_choice(trace: StepTrace, chosen: Sequence[Sequence[SwapCandidate]]) -> SwapChoice:
    """Whole-layer wrapping that swaps exactly the saves of ``chosen`` (per layer)."""
    planned = {(layer, s.index) for layer, cs in enumerate(chosen) for c in cs for s in c.saves}
    return SwapChoice(
        LAYER_SCOPE,
        frozenset(i for i, s in enumerate(trace.saves) if (s.layer, s.save.index) in planned),
    )


@dataclass(frozen=True)
class AutoPlan:
    """What ``auto`` swaps, and the replay that shows it never stalls."""

    chosen: tuple[tuple[SwapCandidate, ...], ...]
    """Per decoder layer, the storages swapped, in saving order (the last: none)."""
    replay: Replay
    """The step with ``chosen`` swapped, at the full link: no stall."""
    times: StepTimes
    """The whole-layer windows it was planned in."""
    dropped: int
    """Tensors the verifying replays took back (0: the simulated queues were exact)."""


@dataclass(frozen=True)
class _Timed:
    """A candidate with the times its copies are bound by."""

    candidate: SwapCandidate
    """The storage and its saves."""
    first: int
    """Index of its first save in the layer's forward."""
    issued: float
    """Its offload is issued (its first save)."""
    needed: float
    """Its reload must be back (its first unpack)."""
    host: int
    """Its host buffer's size class: what it takes of the host budget."""


def _fifo(
    items: Sequence[_Timed],
    queue: float,
    ready: Callable[[_Timed], float],
    deadline: Callable[[_Timed], float],
    rate: float,
    ends: dict[int, float] | None = None,
) -> float | None:
    """Run ``items`` in order on a queue free from ``queue``; the time it is free again,
    or ``None`` when one ends after its deadline. ``ends`` receives each item's end."""
    for item in items:
        queue = max(queue, ready(item)) + item.candidate.nbytes / rate
        if queue > deadline(item):
            return None
        if ends is not None:
            ends[id(item)] = queue
    return queue


def _greedy(pool: Sequence[_Timed], fits: Callable[[list[_Timed]], bool]) -> list[_Timed]:
    chosen: list[_Timed] = []
    for item in sorted(pool, key=lambda i: (-i.candidate.nbytes, i.first)):
        if fits([*chosen, item]):
            chosen.append(item)
    return chosen


def plan_auto(
    trace: StepTrace, candidates: Sequence[Sequence[SwapCandidate]], schedule: SwapSchedule
) -> AutoPlan:
    """Choose, per layer, from ``candidates`` (per layer, :func:`layer_candidates`), under
    ``schedule`` at its lag (:meth:`~SwapSchedule.lag`); its host cap
    (:meth:`~SwapSchedule.max_host_bytes_on`) is what the chosen storages' host buffers
    may hold together (every offload of a step is alive at the end of its forward)."""
    times = step_times(trace, LAYER_SCOPE, schedule)
    hide_margin = schedule.swap_hide_margin
    max_host_bytes = schedule.max_host_bytes_on(trace.profile)
    index = {(s.layer, s.save.index): i for i, s in enumerate(trace.saves)}
    layers = trace.num_layers
    pinned = trace.device == "cuda"
    timed = [
        [
            _Timed(
                c,
                c.saves[0].index,
                times.pack_seconds[index[g, c.saves[0].index]],
                min(times.unpack_seconds[index[g, s.index]] for s in c.saves),
                size_class(c.nbytes, pinned=pinned),
            )
            for c in candidates[g]
        ]
        for g in range(layers - 1)  # the last layer is kept on device
    ]
    d2h_rate = (1 - hide_margin) * trace.profile.d2h_gbps * 1e9
    h2d_rate = (1 - hide_margin) * trace.profile.h2d_gbps * 1e9

    offload_ends: dict[int, float] = {}
    forward = _offloads_that_hide(timed, times, d2h_rate, max_host_bytes, offload_ends)
    backward = _reloads_that_hide(forward, times, h2d_rate, offload_ends)

    chosen_sets = [sorted(items, key=lambda i: i.first) for items in backward] + [[]]
    dropped = 0
    while True:
        plan = [[i.candidate for i in items] for items in chosen_sets]
        replayed = replay(trace, swap_choice(trace, plan), schedule)
        stalled = [
            g
            for g, group in enumerate(replayed.groups)
            if (group.forward_stall or group.backward_stall) and chosen_sets[g]
        ]
        if not stalled:
            return AutoPlan(tuple(tuple(cs) for cs in plan), replayed, times, dropped)
        for g in stalled:
            smallest = min(chosen_sets[g], key=lambda i: (i.candidate.nbytes, -i.first))
            chosen_sets[g].remove(smallest)
            dropped += 1


def _offloads_that_hide(
    timed: Sequence[Sequence[_Timed]],
    times: StepTimes,
    d2h_rate: float,
    max_host_bytes: int,
    offload_ends: dict[int, float],
) -> list[list[_Timed]]:
    """Forward, layer by layer, largest first: per layer the candidates whose offloads
    still meet its fence on the queue left by the layers before, within the host
    budget; ``offload_ends`` receives each chosen offload's end."""
    forward: list[list[_Timed]] = []
    queue = 0.0
    host = 0
    for g, pool in enumerate(timed):
        fence = times.groups[g].fence_seconds
        start = queue
        held = host

        def offloads(
            items: list[_Timed], start: float = start, fence: float = fence
        ) -> float | None:
            order = sorted(items, key=lambda i: i.issued)
            return _fifo(order, start, lambda i: i.issued, lambda i: fence, d2h_rate, offload_ends)

        def fits(items: list[_Timed], held: int = held) -> bool:
            if held + sum(t.host for t in items) > max_host_bytes:
                return False
            return offloads(items) is not None

        chosen = _greedy(pool, fits)
        forward.append(chosen)
        free = offloads(chosen)
        assert free is not None
        queue = free
        host += sum(t.host for t in chosen)
    return forward


def _reloads_that_hide(
    forward: Sequence[Sequence[_Timed]],
    times: StepTimes,
    h2d_rate: float,
    offload_ends: dict[int, float],
) -> list[list[_Timed]]:
    """Backward, layer by layer from the last: of each layer's ``forward`` choice, the
    largest whose reloads, first needed first back, still meet their unpacks."""
    backward: list[list[_Timed]] = [[] for _ in forward]
    queue = 0.0
    for g in range(len(forward) - 1, -1, -1):
        trigger = times.groups[g].trigger_seconds
        if trigger is None:
            continue
        start = queue

        def reloads(
            items: list[_Timed], start: float = start, trigger: float = trigger
        ) -> float | None:
            order = sorted(items, key=lambda i: -i.first)  # first needed, first back
            return _fifo(
                order,
                start,
                lambda i: max(trigger, offload_ends[id(i)]),
                lambda i: i.needed,
                h2d_rate,
            )

        backward[g] = _greedy(forward[g], lambda items: reloads(items) is not None)
        free = reloads(backward[g])
        assert free is not None
        queue = free
    return backward
