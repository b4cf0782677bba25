"""The clock contract replayed on a traced step: what the runtime's swap does to time
and device memory, for one choice of what is swapped.

Rules (``notes/clock_contract.md``; ``graphswap.runtime._manager`` is what they model):
operators run on the compute stream back to back; each wrapped module's forward is one
group, and at both ends of it the offloads of groups ``offload_lag`` or more back are
fenced (compute waits) and their sources released, then the finished ones in issue
order, a batch at a time (the offloads issued between two boundaries end together, at
their batch's last copy); a swapped storage is copied to host once per group, on one device-to-host
queue, after the compute that made it; the last group keeps everything; a group's
backward begins at its first unpack, which first runs a boundary and then issues the
reloads of the ``prefetch_depth`` groups before it, each group's in reverse saving
order, on one host-to-device queue, each after its offload; an unpack waits for its
reload. A storage's device memory is held by its other references (until the trace
saw it die), by every save kept on device (until autograd released it) and by its
offload (until the source is released); a reload's destination is allocated when it
is issued and freed when autograd has released every save that uses it. An offload
takes a host buffer of its size class (a power of two when pinned) from a pool capped
at the host budget; one the cap refuses stays on device, and a buffer goes back when
autograd has released every save of its storage.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from graphswap.planning._settings import SwapSchedule
from graphswap.planning._trace import BlockKind, Event, StepTrace
from graphswap.planning._windows import group_of
from graphswap.runtime._pool import size_class
from graphswap.runtime.timeline import EMBED_LABEL, OPTIMIZER_LABEL, StepTimeline


@dataclass(frozen=True)
class SwapChoice:
    """What one swap mode hands the runtime: the wrapped modules and the saves whose
    policy answers ``MUST_SWAP``."""

    scope: str | None
    """``attention`` or ``layer``: which modules are wrapped; ``None``: none (no swap)."""
    swaps: frozenset[int]
    """Indices into :attr:`StepTrace.saves`. As in the runtime, a storage is copied at
    the first of its saves in a group that swaps, and every later save of it in the
    group shares that copy."""


@dataclass(frozen=True)
class GroupReplay:
    """What one wrapped module's copies did in the replayed step."""

    offloaded_bytes: int
    """Copied to host during its forward."""
    reloaded_bytes: int
    """Copied back during its backward."""
    forward_stall: float
    """Seconds compute waited for its offloads (the fence; a release in backward)."""
    backward_stall: float
    """Seconds compute waited for its reloads."""
    refused_bytes: int = 0
    """Chosen for swap but kept on device: the host budget had no room (each save the
    pool refused counts its storage)."""


@dataclass(frozen=True)
class Replay:
    """One step of one swap choice, on the device the trace was timed for."""

    timeline: StepTimeline
    """The step's time, stalls and device memory, as a clocked run reports them."""
    groups: tuple[GroupReplay, ...]
    """Per decoder layer, its wrapped module (all zero when nothing is wrapped)."""
    host_peak_bytes: int = 0
    """The most pinned host memory the swap held at once, in the pool's size classes."""


class _Batch:
    """The offloads issued between two module boundaries: seen done together."""

    __slots__ = ("end",)

    def __init__(self) -> None:
        self.end = 0.0
        """When its last copy ends (the copy queue runs in order)."""


class _Entry:
    """One storage copied to host by one wrapped layer's forward (the runtime's ``_Entry``)."""

    __slots__ = (
        "active",
        "batch",
        "block",
        "dsts",
        "gen",
        "group",
        "host",
        "load_end",
        "nbytes",
        "offload_end",
        "refs",
        "source_held",
        "waiting",
    )

    def __init__(
        self, group: int, block: int, nbytes: int, host: int, offload_end: float, batch: _Batch
    ) -> None:
        self.group = group
        self.block = block
        self.nbytes = nbytes
        self.host = host
        """Its host buffer's size class."""
        self.offload_end = offload_end
        self.batch = batch
        batch.end = offload_end
        self.source_held = True
        self.refs = 0
        """Saves of it autograd still holds."""
        self.active = False
        """A reload is issued and not every save has consumed it."""
        self.load_end = 0.0
        self.waiting = 0
        self.gen = 0
        """Reloads issued so far."""
        self.dsts = 0
        """Reload destinations allocated and not yet freed."""


_KEPT = None


def state_bytes(trace: StepTrace, state_shards: int) -> int:
    """Device memory before the step: one shard of the parameters and the optimizer
    state, and the buffers (replicated)."""
    sharded = trace.parameter_bytes + trace.optimizer_state_bytes
    return -(-sharded // state_shards) + trace.buffer_bytes


def replay(
    trace: StepTrace,
    choice: SwapChoice,
    *,
    offload_lag: int,
    prefetch_depth: int,
    state_shards: int = 1,
    host_budget: int | None = None,
) -> Replay:
    """Replay ``trace`` with ``choice`` swapped, under the runtime's ``offload_lag`` and
    ``prefetch_depth``. ``state_shards``: parameters, gradients and the optimizer's
    state and work are divided over that many ranks (FSDP-style). ``host_budget``: the
    host pool's cap (``max_host_bytes``), None for none; buffers are pinned on a CUDA
    device, as the runtime's engine pins them there."""
    profile = trace.profile
    pinned = trace.device == "cuda"
    d2h_rate = profile.d2h_gbps * 1e9
    h2d_rate = profile.h2d_gbps * 1e9
    layers = trace.num_layers
    scope = choice.scope
    swaps = choice.swaps
    saves = trace.saves
    groups = [None if scope is None else group_of(save, scope) for save in saves]
    kept_group = layers - 1 if layers > 1 else -1
    activation = BlockKind.ACTIVATION
    sizes = [
        nbytes if kind is activation else -(-nbytes // state_shards)
        for nbytes, kind in trace.blocks
    ]
    holders = [0] * len(sizes)
    handles: list[_Entry | None] = [_KEPT] * len(saves)
    consumed = [-1] * len(saves)
    entries: list[dict[int, _Entry]] = [{} for _ in range(layers)]
    in_flight: collections.deque[_Entry] = collections.deque()
    begun = [False] * layers
    forward_stall = [0.0] * layers
    backward_stall = [0.0] * layers
    offloaded = [0] * layers
    reloaded = [0] * layers
    refused = [0] * layers
    host = host_peak = 0
    stalls: dict[str, float] = {}

    base = state_bytes(trace, state_shards)
    mem = peak = base
    t = d2h = h2d = compute = d2h_busy = h2d_busy = 0.0
    label = EMBED_LABEL
    peak_label, peak_seconds = label, 0.0
    memory: list[tuple[float, int]] = [(0.0, base)]
    last_seq = 0
    batch = _Batch()

    def changed() -> None:
        nonlocal peak, peak_label, peak_seconds
        memory.append((t, mem))
        if mem > peak:
            peak, peak_label, peak_seconds = mem, label, t

    def drop(block: int) -> None:
        nonlocal mem
        holders[block] -= 1
        if holders[block] == 0:
            mem -= sizes[block]
            memory.append((t, mem))  # a drop never raises the peak

    def wait(end: float, stall: list[float], group: int) -> None:
        nonlocal t
        if end > t:
            stalls[label] = stalls.get(label, 0.0) + (end - t)
            stall[group] += end - t
            t = end

    def release_source(entry: _Entry) -> None:
        if entry.source_held:
            entry.source_held = False
            drop(entry.block)

    def boundary(seq: int) -> None:
        nonlocal batch
        batch = _Batch()
        limit = seq - offload_lag
        while in_flight:
            entry = in_flight[0]
            if entry.group + 1 <= limit:
                wait(entry.offload_end, forward_stall, entry.group)
            elif entry.batch.end > t:
                break
            release_source(entry)
            in_flight.popleft()

    def load(entry: _Entry) -> None:
        nonlocal mem, h2d, h2d_busy
        mem += entry.nbytes
        entry.dsts += 1
        changed()
        seconds = entry.nbytes / h2d_rate
        h2d = max(h2d, t, entry.offload_end) + seconds
        h2d_busy += seconds
        reloaded[entry.group] += entry.nbytes
        entry.load_end = h2d
        entry.active = True
        entry.waiting = entry.refs
        entry.gen += 1

    def backward_begins(group: int) -> None:
        boundary(last_seq)
        for target in range(group - 1, max(group - 1 - prefetch_depth, -1), -1):
            for entry in reversed(entries[target].values()):
                if not entry.active and entry.refs:
                    load(entry)

    # The members as locals, the commonest first: an enum member's lookup costs several
    # times the comparison, and a fit replays some 40,000 events a few hundred times.
    alloc, free, compute_event, pack, unpack, release, label_event = (
        Event.ALLOC,
        Event.FREE,
        Event.COMPUTE,
        Event.PACK,
        Event.UNPACK,
        Event.RELEASE,
        Event.LABEL,
    )
    append = memory.append
    optimizer = False
    for event, payload in trace.events:
        if event is alloc:
            holders[payload] += 1
            mem += sizes[payload]
            append((t, mem))
            if mem > peak:
                peak, peak_label, peak_seconds = mem, label, t
        elif event is free:
            holders[payload] -= 1
            if holders[payload] == 0:
                mem -= sizes[payload]
                append((t, mem))
        elif event is compute_event:
            seconds = payload / state_shards if optimizer else payload
            t += seconds
            compute += seconds
        elif event is pack:
            traced = saves[payload]
            block = traced.block
            group = groups[payload]
            entry = None
            if group is not None and block is not None and not traced.save.parameter:
                entry = entries[group].get(block)
                if entry is None and payload in swaps and group != kept_group:
                    nbytes = sizes[block]
                    buffer = size_class(nbytes, pinned=pinned)
                    if host_budget is not None and host + buffer > host_budget:
                        refused[group] += nbytes
                    else:
                        host += buffer
                        host_peak = max(host_peak, host)
                        seconds = nbytes / d2h_rate
                        d2h = max(d2h, t) + seconds
                        d2h_busy += seconds
                        offloaded[group] += nbytes
                        entry = _Entry(group, block, nbytes, buffer, d2h, batch)
                        entries[group][block] = entry
                        holders[block] += 1
                        in_flight.append(entry)
            if entry is None:
                if block is not None:
                    holders[block] += 1
            else:
                entry.refs += 1
                handles[payload] = entry
        elif event is unpack:
            group = groups[payload]
            if group is not None and not begun[group]:
                begun[group] = True
                backward_begins(group)
            entry = handles[payload]
            if entry is not None:
                if not entry.active:
                    load(entry)
                wait(entry.load_end, backward_stall, entry.group)
                consumed[payload] = entry.gen
                entry.waiting -= 1
                if entry.waiting == 0:
                    entry.active = False
        elif event is release:
            entry = handles[payload]
            if entry is None:
                block = saves[payload].block
                if block is not None:
                    drop(block)
                continue
            entry.refs -= 1
            if entry.active and consumed[payload] != entry.gen:
                entry.waiting -= 1
                if entry.waiting == 0:
                    entry.active = False
                    wait(entry.load_end, backward_stall, entry.group)
            if entry.refs == 0:
                if entry.source_held:
                    wait(entry.offload_end, forward_stall, entry.group)
                    release_source(entry)
                host -= entry.host
                entry.host = 0
                if entry.dsts:
                    mem -= entry.nbytes * entry.dsts
                    entry.dsts = 0
                    changed()
        elif event is label_event:
            label = payload
            optimizer = label == OPTIMIZER_LABEL
        elif scope is not None and payload[0] == scope:  # ENTER or EXIT
            seq = payload[1] + 1
            if event is Event.ENTER:
                last_seq = seq
            boundary(seq)
    timeline = StepTimeline(
        step_seconds=max(t, d2h, h2d),
        compute_seconds=compute,
        stalls=stalls,
        d2h_seconds=d2h_busy,
        h2d_seconds=h2d_busy,
        base_bytes=base,
        peak_bytes=peak,
        peak_label=peak_label,
        peak_seconds=peak_seconds,
        memory=memory,
    )
    return Replay(
        timeline,
        tuple(
            GroupReplay(offloaded[g], reloaded[g], forward_stall[g], backward_stall[g], refused[g])
            for g in range(layers)
        ),
        host_peak,
    )


def replay_without_swap(trace: StepTrace, schedule: SwapSchedule) -> Replay:
    """The step with nothing swapped: what every mode's step ratio is taken against
    (``swap_offload_lag`` unset: 1, as the modes other than ``auto`` take it)."""
    return replay(
        trace,
        SwapChoice(None, frozenset()),
        offload_lag=schedule.lag(),
        prefetch_depth=schedule.swap_prefetch_depth,
        state_shards=schedule.state_shards,
    )
