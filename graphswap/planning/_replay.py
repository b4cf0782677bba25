"""The clock contract replayed on a traced step: what the runtime's swap does to time
and device memory, for one choice of what is swapped.

Rules (``notes/clock_contract.md``; ``graphswap.runtime._manager`` is what they model):
operators run on the compute stream back to back; each wrapped module's forward is one
group, and at both ends of it the offloads of groups ``swap_offload_lag`` or more back are
fenced (compute waits) and their sources released, then the finished ones in issue
order, a batch at a time (the offloads issued between two boundaries end together, at
their batch's last copy); a swapped storage is copied to host once per group, on one device-to-host
queue, after the compute that made it; the last group keeps everything; a group's
backward begins at its first unpack, which first runs a boundary and then issues the
reloads of the ``swap_prefetch_depth`` groups before it, each group's in reverse saving
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

from graphswap import _compat
from graphswap.planning._settings import DEFAULT_SCHEDULE, SwapSchedule
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


@_compat.schedule_keywords
def replay(
    trace: StepTrace, choice: SwapChoice, schedule: SwapSchedule = DEFAULT_SCHEDULE
) -> Replay:
    """Replay ``trace`` with ``choice`` swapped, under ``schedule``: the runtime's
    ``swap_offload_lag`` (unset: 1) and ``swap_prefetch_depth``, the host pool's cap
    (``max_host_bytes``; unset: the profile's node's share) and the ``state_shards``
    that parameters, gradients and the optimizer's state and work are divided over
    (FSDP-style). Buffers are pinned on a CUDA device, as the runtime's engine pins them
    there. The schedule's fields as keywords of their own (``offload_lag=1,
    prefetch_depth=1, host_budget=...``) warn and work until 0.3."""
    return StepReplay(trace, choice, schedule).run()


class StepReplay:
    """One step replayed as the runtime's ``SwapManager`` runs it, on a clock.

    Its words are the runtime's: a wrapped module's forward *offloads* the storages its
    policy swaps (one device-to-host queue); a module ``swap_offload_lag`` later *fences*
    them (compute waits for the copies, then their sources are *freed*); backward
    entering a module *prefetches* the ``swap_prefetch_depth`` modules before it, each
    storage *reloaded* on one host-to-device queue; an unpack *waits* for its reload;
    autograd *releases* a save, and a storage's last release frees its host buffer and
    its reloads. Every state field below is the replay's, per step."""

    def __init__(
        self, trace: StepTrace, choice: SwapChoice, schedule: SwapSchedule = DEFAULT_SCHEDULE
    ) -> None:
        profile, layers, scope = trace.profile, trace.num_layers, choice.scope
        state_shards = schedule.state_shards
        self.trace = trace
        """The traced step: its events, saves and blocks."""
        self.scope = scope
        """The wrapped modules' scope (``None``: nothing wrapped)."""
        self.swaps = choice.swaps
        """The saves the policy swaps, by index into the trace's saves."""
        self.swap_offload_lag = schedule.lag()
        """The ``SwapManager``'s: a module's offloads are fenced that many modules later."""
        self.swap_prefetch_depth = schedule.swap_prefetch_depth
        """The ``SwapManager``'s: modules reloaded ahead of the one backward enters."""
        self.state_shards = state_shards
        """Ranks the state and the optimizer's work are divided over."""
        self.max_host_bytes = schedule.max_host_bytes_on(profile)
        """The host pool's cap."""
        self.pinned = trace.device == "cuda"
        """Host buffers are pinned (their size classes are powers of two)."""
        self.d2h_rate = profile.d2h_gbps * 1e9
        """Offload bytes per second."""
        self.h2d_rate = profile.h2d_gbps * 1e9
        """Reload bytes per second."""
        self.groups = [None if scope is None else group_of(save, scope) for save in trace.saves]
        """Per save, the wrapped module it is saved in (``None``: outside every one)."""
        self.kept_group = layers - 1 if layers > 1 else -1
        """The module kept on device: the last in forward order."""
        activation = BlockKind.ACTIVATION
        self.sizes = [
            nbytes if kind is activation else -(-nbytes // state_shards)
            for nbytes, kind in trace.blocks
        ]
        """Per block, its bytes on this rank (the state's: one shard)."""
        self.holders = [0] * len(self.sizes)
        """Per block, what holds its device memory (references, kept saves, an offload)."""
        self.handles: list[_Entry | None] = [_KEPT] * len(trace.saves)
        """Per save, the offload autograd holds instead of the tensor (``None``: kept)."""
        self.consumed = [-1] * len(trace.saves)
        """Per save, the reload generation its unpack consumed."""
        self.entries: list[dict[int, _Entry]] = [{} for _ in range(layers)]
        """Per module, its offloads by block."""
        self.in_flight: collections.deque[_Entry] = collections.deque()
        """Offloads whose sources are not yet freed, in issue order."""
        self.begun = [False] * layers
        """Per module, its backward has begun (its prefetch was issued)."""
        self.forward_stall = [0.0] * layers
        """Per module, compute's wait for its offloads."""
        self.backward_stall = [0.0] * layers
        """Per module, compute's wait for its reloads."""
        self.offloaded = [0] * layers
        """Per module, bytes offloaded."""
        self.reloaded = [0] * layers
        """Per module, bytes reloaded."""
        self.refused = [0] * layers
        """Per module, bytes the host budget kept on device."""
        self.host = 0
        """Host pool bytes held now."""
        self.host_peak = 0
        """The most host pool bytes held at once."""
        self.stalls: dict[str, float] = {}
        """Compute's waits per timeline label."""
        self.base = state_bytes(trace, state_shards)
        """Device bytes before the step: the state's shard and the buffers."""
        self.mem = self.base
        """Device bytes held now."""
        self.peak = self.base
        """The most device bytes held at once."""
        self.t = 0.0
        """The compute stream's clock."""
        self.d2h = 0.0
        """When the device-to-host queue is free."""
        self.h2d = 0.0
        """When the host-to-device queue is free."""
        self.compute = 0.0
        """Compute seconds run."""
        self.d2h_busy = 0.0
        """Seconds the device-to-host queue copied."""
        self.h2d_busy = 0.0
        """Seconds the host-to-device queue copied."""
        self.label = EMBED_LABEL
        """The timeline label the step is in."""
        self.peak_label = EMBED_LABEL
        """The label the peak fell in."""
        self.peak_seconds = 0.0
        """When the peak fell."""
        self.memory: list[tuple[float, int]] = [(0.0, self.base)]
        """Device bytes over the step: (seconds, bytes) at every change."""
        self.last_seq = 0
        """The module sequence number of the last forward entered."""
        self.batch = _Batch()
        """The offloads issued since the last module boundary."""

    def _changed(self) -> None:
        self.memory.append((self.t, self.mem))
        if self.mem > self.peak:
            self.peak, self.peak_label, self.peak_seconds = self.mem, self.label, self.t

    def free(self, block: int) -> None:
        """One holder of ``block`` lets go; the last frees its device memory."""
        self.holders[block] -= 1
        if self.holders[block] == 0:
            self.mem -= self.sizes[block]
            self.memory.append((self.t, self.mem))  # a drop never raises the peak

    def wait(self, end: float, stall: list[float], group: int) -> None:
        """Compute waits for a copy that ends at ``end``, counted as ``group``'s stall."""
        if end > self.t:
            label = self.label
            self.stalls[label] = self.stalls.get(label, 0.0) + (end - self.t)
            stall[group] += end - self.t
            self.t = end

    def free_source(self, entry: _Entry) -> None:
        """An offloaded storage's device source is freed (once)."""
        if entry.source_held:
            entry.source_held = False
            self.free(entry.block)

    def fence(self, seq: int) -> None:
        """A module boundary: offloads of modules ``swap_offload_lag`` or more back are
        waited for and their sources freed; then the finished ones, in issue order."""
        self.batch = _Batch()
        limit = seq - self.swap_offload_lag
        in_flight = self.in_flight
        while in_flight:
            entry = in_flight[0]
            if entry.group + 1 <= limit:
                self.wait(entry.offload_end, self.forward_stall, entry.group)
            elif entry.batch.end > self.t:
                break
            self.free_source(entry)
            in_flight.popleft()

    def reload(self, entry: _Entry) -> None:
        """Issue ``entry``'s reload: a destination allocated, a copy queued after its
        offload."""
        self.mem += entry.nbytes
        entry.dsts += 1
        self._changed()
        seconds = entry.nbytes / self.h2d_rate
        self.h2d = max(self.h2d, self.t, entry.offload_end) + seconds
        self.h2d_busy += seconds
        self.reloaded[entry.group] += entry.nbytes
        entry.load_end = self.h2d
        entry.active = True
        entry.waiting = entry.refs
        entry.gen += 1

    def prefetch(self, group: int) -> None:
        """Backward enters ``group``: a boundary, then the reloads of the
        ``swap_prefetch_depth`` modules before it, each's in reverse saving order."""
        self.fence(self.last_seq)
        for target in range(group - 1, max(group - 1 - self.swap_prefetch_depth, -1), -1):
            for entry in reversed(self.entries[target].values()):
                if not entry.active and entry.refs:
                    self.reload(entry)

    def offload(self, group: int, block: int) -> _Entry | None:
        """The policy swaps a save of ``block`` in ``group``'s forward: its storage is
        copied to host, unless the host budget refuses its buffer (``None``: kept)."""
        nbytes = self.sizes[block]
        buffer = size_class(nbytes, pinned=self.pinned)
        if self.host + buffer > self.max_host_bytes:
            self.refused[group] += nbytes
            return None
        self.host += buffer
        self.host_peak = max(self.host_peak, self.host)
        seconds = nbytes / self.d2h_rate
        self.d2h = max(self.d2h, self.t) + seconds
        self.d2h_busy += seconds
        self.offloaded[group] += nbytes
        entry = _Entry(group, block, nbytes, buffer, self.d2h, self.batch)
        self.entries[group][block] = entry
        self.holders[block] += 1
        self.in_flight.append(entry)
        return entry

    def pack(self, index: int) -> None:
        """Autograd saves ``index``: kept, or handed an offload (a storage's first swapped
        save in a module offloads it; later saves share that copy)."""
        traced = self.trace.saves[index]
        block, group = traced.block, self.groups[index]
        entry = None
        if group is not None and block is not None and not traced.save.parameter:
            entry = self.entries[group].get(block)
            if entry is None and index in self.swaps and group != self.kept_group:
                entry = self.offload(group, block)
        if entry is None:
            if block is not None:
                self.holders[block] += 1
        else:
            entry.refs += 1
            self.handles[index] = entry

    def unpack(self, index: int) -> None:
        """Autograd unpacks ``index``: the first unpack of a module prefetches; a swapped
        save waits for its reload (issued now if it was not)."""
        group = self.groups[index]
        if group is not None and not self.begun[group]:
            self.begun[group] = True
            self.prefetch(group)
        entry = self.handles[index]
        if entry is not None:
            if not entry.active:
                self.reload(entry)
            self.wait(entry.load_end, self.backward_stall, entry.group)
            self.consumed[index] = entry.gen
            entry.waiting -= 1
            if entry.waiting == 0:
                entry.active = False

    def release(self, index: int) -> None:
        """Autograd releases the swapped save ``index`` (:meth:`run` frees a kept one's
        block): the offload's last release frees its source, its host buffer and its
        reloads."""
        entry = self.handles[index]
        assert entry is not None, "a kept save's release frees its block in run()"
        entry.refs -= 1
        if entry.active and self.consumed[index] != entry.gen:
            entry.waiting -= 1
            if entry.waiting == 0:
                entry.active = False
                self.wait(entry.load_end, self.backward_stall, entry.group)
        if entry.refs == 0:
            if entry.source_held:
                self.wait(entry.offload_end, self.forward_stall, entry.group)
                self.free_source(entry)
            self.host -= entry.host
            entry.host = 0
            if entry.dsts:
                self.mem -= entry.nbytes * entry.dsts
                entry.dsts = 0
                self._changed()

    def run(self) -> Replay:
        """Play every event of the step; the :class:`Replay` it makes."""
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
        holders, sizes, append, scope = self.holders, self.sizes, self.memory.append, self.scope
        shards, handles, saves = self.state_shards, self.handles, self.trace.saves
        # The clock, the memory and its peak as locals in the loop, the fields in the
        # methods: handed over around each call (a pack moves no memory, only reads the
        # clock).
        t, mem, peak, compute, optimizer = self.t, self.mem, self.peak, 0.0, False
        for event, payload in self.trace.events:
            if event is alloc:
                holders[payload] += 1
                mem += sizes[payload]
                append((t, mem))
                if mem > peak:
                    peak, self.peak_label, self.peak_seconds = mem, self.label, t
            elif event is free:
                holders[payload] -= 1
                if holders[payload] == 0:
                    mem -= sizes[payload]
                    append((t, mem))
            elif event is compute_event:
                seconds = payload / shards if optimizer else payload
                t += seconds
                compute += seconds
            elif event is pack:
                self.t = t
                self.pack(payload)
            elif event is release and handles[payload] is None:
                # A kept save: its release frees its block like any reference (the
                # commonest release, handled here rather than in release()).
                block = saves[payload].block
                if block is not None:
                    holders[block] -= 1
                    if holders[block] == 0:
                        mem -= sizes[block]
                        append((t, mem))
            elif event is unpack or event is release:
                self.t, self.mem, self.peak = t, mem, peak
                (self.unpack if event is unpack else self.release)(payload)
                t, mem, peak = self.t, self.mem, self.peak
            elif event is label_event:
                self.label = payload
                optimizer = payload == OPTIMIZER_LABEL
            elif scope is not None and payload[0] == scope:  # ENTER or EXIT
                seq = payload[1] + 1
                if event is Event.ENTER:
                    self.last_seq = seq
                self.t, self.mem, self.peak = t, mem, peak
                self.fence(seq)
                t, mem, peak = self.t, self.mem, self.peak
        self.t, self.mem, self.peak, self.compute = t, mem, peak, compute
        return self.result()

    def result(self) -> Replay:
        """The step as replayed so far: its timeline and each module's copies."""
        timeline = StepTimeline(
            step_seconds=max(self.t, self.d2h, self.h2d),
            compute_seconds=self.compute,
            stalls=self.stalls,
            d2h_seconds=self.d2h_busy,
            h2d_seconds=self.h2d_busy,
            base_bytes=self.base,
            peak_bytes=self.peak,
            peak_label=self.peak_label,
            peak_seconds=self.peak_seconds,
            memory=self.memory,
        )
        groups = tuple(
            GroupReplay(
                self.offloaded[g],
                self.reloaded[g],
                self.forward_stall[g],
                self.backward_stall[g],
                self.refused[g],
            )
            for g in range(self.trace.num_layers)
        )
        return Replay(timeline, groups, self.host_peak)


def replay_without_swap(trace: StepTrace, schedule: SwapSchedule) -> Replay:
    """The step with nothing swapped: what every mode's step ratio is taken against
    (``swap_offload_lag`` unset: 1, as the modes other than ``auto`` take it)."""
    return replay(trace, SwapChoice(None, frozenset()), schedule)
