"""Copy engines: move whole storages between a compute device and host buffers.

A copy is asynchronous. The manager drives it through four calls, and the order
of those calls is what keeps memory correct:

- ``done()`` asks, without blocking, whether the copy has completed;
- ``fence()`` orders a stream after the copy (a stream wait, the host does not
  block): for an offload, the stream that produced the source, so that the caching
  allocator may hand the source's memory out again on it; for a reload, the current
  stream, which reads the result;
- ``release_source()`` drops the offload's reference to its device source; legal
  only after ``done()`` answered True or after ``fence()``;
- ``synchronize()`` blocks the host until the copy completed (never in the hot path).

``AcceleratorCopyEngine`` is written once against the device interface of
``graphswap.runtime._device``: on a GPU it drives torch's streams and events;
``SimulatedAccelerator`` (:mod:`graphswap.runtime.sim`, loaded only where asked for)
is the same engine over a simulated device on CPU tensors that lags a chosen number of
module boundaries behind the host, turns every call in the wrong order into a
``HazardError``, and, given a device profile, keeps a clock: the CPU test suite runs
the engine a GPU runs (invariant I11). ``NoOpAccelerator`` is
the same engine over a device whose copies are done when issued (``NoOpDevice``): no
hazard to check, nothing to simulate, the engine's own host time only.
"""

from __future__ import annotations

import abc
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from graphswap import _compat
from graphswap.errors import GraphswapTypeError
from graphswap.runtime._device import (
    Device,
    Event,
    HazardError,
    NoOpDevice,
    Stream,
    TorchDevice,
)

_use_count = torch._C._storage_Use_Count
"""References to a storage: read once here, not through ``torch._C`` at every release."""
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
"""What ``torch.no_grad()`` sets, without its object and four Python calls per group."""

GROUP_BYTES = 64 << 10
"""Copies smaller than this share their ordering: the runtime's offloads wait in the
lane until this many bytes are pending (or the module boundary) and go as one group,
after one wait for the stream that produced them; a batch of reloads records one event
per this many bytes, not one per copy. 64 KiB cross a PCIe 5 link (about 50 GB/s) in
about 1.3 us, less than the host time of the two driver calls (an event record and a
stream wait) that order a copy alone: below it, waiting for a neighbour's copy costs
less than ordering each on its own; from it on, every copy is ordered on its own."""

__all__ = [
    "AcceleratorCopyEngine",
    "Copy",
    "CopyEngine",
    "HazardError",
    "NoOpAccelerator",
]


class Copy(abc.ABC):
    """One asynchronous copy: an offload (device to host) or a reload (host to device)."""

    __slots__ = ()

    @abc.abstractmethod
    def done(self) -> bool: ...

    @abc.abstractmethod
    def fence(self) -> None: ...

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    @abc.abstractmethod
    def release_source(self) -> weakref.ref[torch.UntypedStorage] | None:
        """Drop the offload's reference to its device source. None when that frees it (or
        there is none); else a weak reference to the source, which another reference
        still keeps on device (a storage's Python object lives as long as the storage)."""

    @abc.abstractmethod
    def result(self) -> torch.Tensor:
        """The device tensor a reload filled; legal only after ``fence()``."""

    def fenced_result(self) -> torch.Tensor:
        """``fence()``, then ``result()``: what an unpack does with its reload, one call."""
        self.fence()
        return self.result()


class CopyEngine(abc.ABC):
    """Issues copies for every device the manager meets."""

    pin: bool
    """Whether host buffers for this engine are pinned (page-locked)."""

    _fills_records = False
    """Whether the runtime may call ``_offload_into`` (the built-in engine's, internal)
    instead of ``offload``: a user's engine is asked through ``offload`` only."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """An engine written for 0.1.0 implements ``loads``: it serves as ``reloads``,
        with a warning, until 0.3."""
        super().__init_subclass__(**kwargs)
        _compat.renamed_override(cls, "loads", "reloads")

    @abc.abstractmethod
    def offload(self, src: torch.Tensor, host: torch.Tensor, after: Sequence[Copy]) -> Copy:
        """Copy ``src`` (a contiguous device tensor) into ``host`` (a host tensor of its
        dtype and shape) once every copy in ``after`` (earlier users of the host buffer)
        has completed. ``src`` may be the saved tensor itself (the pack hook runs
        without grad): the copy keeps its storage, never its autograd graph."""

    @abc.abstractmethod
    def reloads(
        self, device: torch.device, items: Sequence[tuple[torch.Tensor, Sequence[Copy]]]
    ) -> list[Copy]:
        """Per ``(host, after)`` of ``items``, copy ``host`` into a new tensor of its dtype
        and shape on ``device`` after ``after``: one batch, in the order given."""

    loads = _compat.Renamed("reloads")  # 0.1.0's name, until 0.3

    @abc.abstractmethod
    def host_buffer(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` bytes (uint8) for copies to and from ``device``."""

    @abc.abstractmethod
    def free_host_buffer(self, device: torch.device, host: torch.Tensor) -> None:
        """Drop ``host``, a buffer of ``host_buffer(device, ...)``."""

    @abc.abstractmethod
    def tick(self) -> None:
        """A module boundary on the host: the offloads issued since the last one are
        closed as one batch (a simulated device also advances here)."""

    @abc.abstractmethod
    def capturing(self) -> bool:
        """True while the current stream captures a graph: no copy, query or wait is legal."""

    def boundary(self) -> bool:
        """A module boundary of a manager with this engine alone: ``capturing()``, and
        ``tick()`` unless it captures; one call a boundary."""
        if self.capturing():
            return True
        self.tick()
        return False


class _Mark:
    """A pooled event recorded on a copy stream: the end of the copies before it.

    Made open (``seq`` 0, no event), handed to the copies it will end as they are issued,
    and recorded after the last of them: one object per group, no pass over its copies.
    Its event goes back to the pool when the last copy that refers to it dies; a wait
    made before keeps the point it waited for, so the event can be recorded again."""

    __slots__ = ("event", "free", "seq")

    event: Event
    """Recorded on the copy stream right after the copies it ends (set then)."""

    def __init__(self, free: list[Event]) -> None:
        self.free = free
        """The pool the event returns to."""
        self.seq = 0
        """Marks recorded on its stream before it, plus one: a later mark ends more; 0
        while open."""

    def __del__(self) -> None:
        if self.seq:  # an open mark holds no event
            self.free.append(self.event)


class _Progress:
    """What the host knows of one copy stream without asking the device: the marks
    recorded on it, and the newest one it saw completed (which ends every earlier one)."""

    __slots__ = ("done", "marks")

    def __init__(self) -> None:
        self.marks = 0
        """Marks recorded on the stream so far: the ``seq`` of the newest."""
        self.done = 0
        """The newest mark the host saw completed."""

    def finished(self, mark: _Mark) -> bool:
        """Whether the copies before ``mark`` completed; asks the device only when the
        host does not know yet."""
        if self.done >= mark.seq:
            return True
        if not mark.event.query():
            return False
        self.done = mark.seq
        return True

    def synchronize(self, mark: _Mark) -> None:
        if self.done < mark.seq:
            mark.event.synchronize()
            self.done = mark.seq


class _Lane:
    """One device as the engine drives it: its interface, the engine's two streams, their
    event pools, and what the host knows of their order without asking the device.

    What the host knows lets it skip a call: a stream that waited for a mark has waited
    for every earlier one of that stream (each stream runs in order); a mark the host
    saw completed ends every earlier one."""

    __slots__ = (
        "batch",
        "d2h",
        "d2h_after_h2d",
        "device",
        "fenced",
        "h2d",
        "h2d_after_d2h",
        "loaded",
        "offload_events",
        "offloads",
        "pending",
        "pending_bytes",
        "pending_reload",
        "pending_seq",
        "producer",
        "reload_events",
        "reloads",
    )

    def __init__(self, device: Device[Any, Any]) -> None:
        self.device = device
        """The device's interface: torch's accelerator or the simulated device."""
        self.d2h = device.new_stream("offload")
        """Offloads, in issue order."""
        self.h2d = device.new_stream("reload")
        """Reloads, in issue order: both directions run at once."""
        self.offload_events: list[Event] = []
        """Idle events for the offload side: the producer waits and the batch marks."""
        self.reload_events: list[Event] = []
        """Idle events for the reload side: the allocation waits and the reload marks."""
        self.batch: _Batch | None = None
        """Offloads issued since the last module boundary, not yet marked."""
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Offloads of the open batch not yet queued, as ``(src, host)``: a group under
        ``GROUP_BYTES`` waiting for more (``issue``)."""
        self.pending_bytes = 0
        """The bytes of ``pending``."""
        self.pending_reload: _Mark | None = None
        """The newest reload mark a host buffer of ``pending`` was last read by, unless
        ``d2h`` is known to be ordered after it: the group's one wait for ``h2d`` (which
        runs in order, so it covers every older one). Held, so its event is not reused."""
        self.pending_seq = 0
        """``pending_reload``'s ``seq``, or the newest ``h2d`` mark ``d2h`` was known to be
        ordered after when the group began: a reload up to it needs no wait."""
        self.producer: Stream | None = None
        """The stream that produced ``pending``'s sources (current when they were saved)."""
        self.offloads = _Progress()
        """What the host knows of ``d2h``."""
        self.reloads = _Progress()
        """What the host knows of ``h2d``."""
        self.fenced: dict[Stream, int] = {}
        """Per compute stream, the newest ``d2h`` mark it waited for (an offload fence)."""
        self.loaded: dict[Stream, int] = {}
        """Per compute stream, the newest ``h2d`` mark it waited for (a reload fence)."""
        self.h2d_after_d2h = 0
        """The newest ``d2h`` mark ``h2d`` is ordered after (directly or through compute)."""
        self.d2h_after_h2d = 0
        """The newest ``h2d`` mark ``d2h`` is ordered after (directly or through compute)."""

    def event(self, free: list[Event], role: str) -> Event:
        """An idle event of ``free``, made when none is (the first steps only)."""
        return free.pop() if free else self.device.new_event(role)

    def follow(self, waiter: Stream, stream: Stream, role: str) -> None:
        """Order the work queued on ``waiter`` from now on after what ``stream`` queued."""
        free = self.offload_events if role == "offload" else self.reload_events
        event = self.event(free, role)
        waiter.wait_event(self.device.record(stream, event))
        free.append(event)

    def issue(self) -> None:
        """Queue the pending offloads on ``d2h``, after one wait for the stream that
        produced them and one for the newest reload of their host buffers, unless implied:
        per copy, only the copy itself."""
        pending = self.pending
        producer = self.producer
        assert producer is not None  # set with the first pending offload
        device = self.device
        d2h = self.d2h
        free = self.offload_events
        event = free.pop() if free else device.new_event("offload")
        d2h.wait_event(device.record(producer, event))  # the copies read what is queued there
        free.append(event)
        after = self.loaded.get(producer, 0)
        if after < self.d2h_after_h2d:
            after = self.d2h_after_h2d
        mark = self.pending_reload
        if mark is not None:
            # An earlier offload ran on d2h itself, in order; a reload needs a wait.
            seq = mark.seq
            if seq > after and seq > self.reloads.done:
                d2h.wait_event(mark.event)
                after = seq
            self.pending_reload = None
        self.d2h_after_h2d = after
        to_host = device.to_host
        # At a boundary grad is on, and ``src`` may require it: a copy into ``host`` (a view
        # the pack hook made without grad) would be recorded, which autograd refuses.
        grad = _grad_enabled()
        if grad:
            _set_grad_enabled(False)
        try:
            for src, host in pending:
                to_host(d2h, src, host)
        finally:
            if grad:
                _set_grad_enabled(True)
        pending.clear()
        self.pending_bytes = 0
        self.pending_seq = after
        self.producer = None

    def seal(self) -> None:
        """Mark the end of the open batch of offloads, queuing its pending ones first: the
        batch is its own mark."""
        if self.pending:
            self.issue()
        batch = self.batch
        if batch is not None:
            batch.event = self.device.record(self.d2h, self.event(self.offload_events, "offload"))
            self.batch = None
            progress = self.offloads
            progress.marks += 1
            batch.seq = progress.marks


class _Batch(_Mark):
    """Offloads issued on one lane between two module boundaries: one mark ends them all,
    so the lag fence, the completion query and the source release are a call per batch.

    The batch is that mark itself (``seq`` 0 until it is sealed): one object per module
    boundary, not two."""

    __slots__ = ("lane",)

    def __init__(self, lane: _Lane) -> None:  # the mark's fields inline: one call a batch
        self.free = lane.offload_events
        self.seq = 0
        self.lane = lane
        """The device and streams the batch's offloads ran on."""

    def sealed(self) -> _Batch:
        """The batch, sealed (its mark recorded) if it was still open."""
        if not self.seq:
            self.lane.seal()
        return self

    def done(self) -> bool:
        return self.lane.offloads.finished(self.sealed())

    def synchronize(self) -> None:
        self.lane.offloads.synchronize(self.sealed())


_RECORDS: set[type[Copy]] = set()
"""``_Offload`` and its subclasses: a reload's ``after`` is checked against them by type,
not by ``isinstance`` (an ABC's is a Python call)."""


class _Offload(Copy):
    """A copy to host: its batch, the stream that produced the source, and the source.

    The engine fills these fields (``AcceleratorCopyEngine._offload_into``): of a record
    ``offload`` makes, or of the runtime's own per-storage record (``_handles._Entry``,
    a subclass), so that a swapped storage costs one object, not two."""

    __slots__ = ("_batch", "_hold", "_producer", "nbytes")

    nbytes: int
    """The bytes copied, its host buffer's: a reload after it counts its group's bytes
    with them, not with ``Tensor.nbytes`` (a call)."""
    _batch: _Batch
    """The module boundary's batch: its mark ends this copy."""
    _producer: Stream
    """The stream current when the source was saved: the one that produced it, and the
    allocation stream whose pool its memory returns to."""
    _hold: torch.UntypedStorage | None
    """The source's device memory, held until ``release_source``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _RECORDS.add(cls)

    def done(self) -> bool:
        batch = self._batch
        seq = batch.seq
        if seq and batch.lane.offloads.done >= seq:
            return True  # the host saw its batch, or a later one, completed
        return batch.done()

    def synchronize(self) -> None:
        self._batch.synchronize()

    def fence(self) -> None:
        batch = self._batch
        mark = batch if batch.seq else batch.sealed()
        lane = batch.lane
        producer = self._producer
        if lane.fenced.get(producer, 0) < mark.seq and lane.offloads.done < mark.seq:
            producer.wait_event(mark.event)
            lane.fenced[producer] = mark.seq

    def release_source(self) -> weakref.ref[torch.UntypedStorage] | None:
        hold = self._hold
        if hold is None:
            return None
        self._hold = None
        batch = self._batch
        batch.lane.device.drop(hold, (batch if batch.seq else batch.sealed()).event)
        # This reference and another: the bytes stay on device whatever the swap does.
        if _use_count(hold._cdata) > 1:
            return weakref.ref(hold)
        return None

    def result(self) -> torch.Tensor:
        raise GraphswapTypeError("result() of an offload: an offload fills a host buffer")


_RECORDS.add(_Offload)


class _Reload(Copy):
    """A copy to device, ended by its group's mark: its own when it is ``GROUP_BYTES`` or
    more (an unpack then waits for its own copy only), else one it shares with the
    copies issued beside it up to that many bytes."""

    __slots__ = ("_lane", "_mark", "_out")

    def __init__(self, lane: _Lane, mark: _Mark, out: torch.Tensor) -> None:
        self._lane = lane
        """The device and streams the copy ran on."""
        self._mark = mark
        """Recorded on ``h2d`` after the copy (and the rest of its group)."""
        self._out = out
        """The destination, allocated on the stream current at issue."""

    def done(self) -> bool:
        return self._lane.reloads.finished(self._mark)

    def synchronize(self) -> None:
        self._lane.reloads.synchronize(self._mark)

    def fence(self) -> None:
        lane = self._lane
        mark = self._mark
        stream = lane.device.current_stream()
        if lane.loaded.get(stream, 0) < mark.seq:
            stream.wait_event(mark.event)
            lane.loaded[stream] = mark.seq

    def release_source(self) -> None:
        """A reload holds no source: its host buffer is the pool's, which orders its reuse."""

    def result(self) -> torch.Tensor:
        return self._lane.device.read(self._out, self._mark.event)

    def fenced_result(self) -> torch.Tensor:
        """``fence()`` and ``result()`` inline: every unpack of a swapped tensor calls it."""
        lane = self._lane
        mark = self._mark
        device = lane.device
        stream = device.current_stream()
        if lane.loaded.get(stream, 0) < mark.seq:
            stream.wait_event(mark.event)
            lane.loaded[stream] = mark.seq
        return device.read(self._out, mark.event)


class AcceleratorCopyEngine(CopyEngine):
    """Side streams per device and direction, pooled events, pinned host buffers.

    Offload: the d2h stream waits for the stream that produced the source (the current
    stream when it is saved) and for the host buffer's last reload, copies; copies under
    ``GROUP_BYTES`` wait in the lane until that many bytes are pending or the module
    boundary, and go as a group after one such wait. The offloads issued between two
    module boundaries share one mark, recorded at the second. The source stays
    referenced until the manager releases it after a fence (which makes the producing
    stream wait for the mark) or a completed query. Loads come in batches: their
    destinations are allocated on the current stream, the h2d stream waits for it once
    (the blocks may still be in use by queued kernels) and for the offloads not yet
    ordered, then copies, with a mark per copy of ``GROUP_BYTES`` or more and per group
    of smaller ones, which the reading stream waits on before reading.

    Events are made once and recorded again; every wait the host knows to be implied
    by an earlier one, or by a completion it saw, is skipped. Per swapped tensor that
    leaves, on each side, a copy, an ordering wait and its record, shared by a group of
    small copies; the rest is per module boundary: at most three calls per swapped
    tensor and direction where a module saves two or more small tensors.
    """

    pin = True

    def __init__(self) -> None:
        self._lanes: dict[torch.device, _Lane] = {}
        """Per device met, its interface, copy streams and event pools."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return AcceleratorCopyEngine, ()

    def _open(self, device: torch.device) -> Device[Any, Any]:
        """The device interface for ``device``, met for the first time."""
        return TorchDevice(device)

    def _lane(self, device: torch.device) -> _Lane:
        lane = self._lanes.get(device)
        if lane is None:
            lane = self._lanes[device] = _Lane(self._open(device))
        return lane

    _fills_records = True
    """``_offload_into`` serves for ``offload``: false in a subclass that overrides
    ``offload``, whose offloads the runtime then asks for through it."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._fills_records = cls.offload is AcceleratorCopyEngine.offload

    def offload(self, src: torch.Tensor, host: torch.Tensor, after: Sequence[Copy]) -> Copy:
        """Queued at once, whatever its size (the runtime groups its own, ``_offload_into``)."""
        record = _Offload()
        nbytes = record.nbytes = host.nbytes
        self._offload_into(record, src, host, after, nbytes, src.device, src.untyped_storage())
        lane = record._batch.lane
        if lane.pending:
            lane.issue()
        return record

    def _offload_into(
        self,
        record: _Offload,
        src: torch.Tensor,
        host: torch.Tensor,
        after: Sequence[Copy],
        nbytes: int,
        device: torch.device,
        storage: torch.UntypedStorage,
    ) -> None:
        """``offload``, its fields written into ``record`` (the runtime's entry for the
        storage, whose ``nbytes`` its maker set) rather than into a record of its own, and
        queued with the pending ones once they reach ``GROUP_BYTES`` (else at the latest
        when the batch is sealed).

        ``nbytes`` (``host``'s), ``device`` and ``storage`` (``src``'s) are what the
        caller knows already: read from the tensors, they cost a hundred-odd nanoseconds
        each (``Tensor.nbytes``, ``.device``, ``.untyped_storage()``), more than the rest
        of the grouping."""
        lane = self._lanes.get(device) or self._lane(device)
        producer = lane.device.current_stream()
        if lane.producer is not producer:
            if lane.pending:  # saved on another stream: its group waits for that one
                lane.issue()
            lane.producer = producer
        for copy in after:
            # An earlier offload runs on d2h itself, in order; a reload needs a wait.
            if type(copy) is _Reload:
                mark = copy._mark
                if mark.seq > lane.pending_seq:
                    lane.pending_reload = mark
                    lane.pending_seq = mark.seq
        lane.pending.append((src, host))
        nbytes = lane.pending_bytes = lane.pending_bytes + nbytes
        batch = lane.batch
        if batch is None:
            batch = lane.batch = _Batch(lane)
        record._batch = batch
        record._producer = producer
        record._hold = storage
        if nbytes >= GROUP_BYTES:
            lane.issue()

    def reloads(
        self, device: torch.device, items: Sequence[tuple[torch.Tensor, Sequence[Copy]]]
    ) -> list[Copy]:
        lane = self._lanes.get(device) or self._lane(device)
        interface = lane.device
        empty_like = interface.empty_like
        dsts = [empty_like(host) for host, _ in items]
        h2d = lane.h2d
        current = interface.current_stream()
        lane.follow(h2d, current, "reload")
        fenced = lane.fenced.get(current, 0)
        if fenced > lane.h2d_after_d2h:
            lane.h2d_after_d2h = fenced
        free, progress, record = lane.reload_events, lane.reloads, interface.record
        to_device = interface.to_device
        # ``h2d`` follows the offloads up to here: waited for, or seen completed.
        ordered = lane.offloads.done
        if ordered < lane.h2d_after_d2h:
            ordered = lane.h2d_after_d2h
        group_bytes = GROUP_BYTES
        copies: list[Copy] = []
        append = copies.append
        mark = _Mark(free)  # the open group's, recorded once it holds ``group_bytes``
        nbytes = 0
        for (host, after), dst in zip(items, dsts, strict=True):
            size = -1
            for copy in after:
                if type(copy) in _RECORDS:  # its own record, or an entry it filled
                    size = copy.nbytes  # type: ignore[attr-defined]  # into ``host``
                    batch = copy._batch  # type: ignore[attr-defined]
                    seq = batch.seq or batch.sealed().seq
                    if seq > ordered:
                        h2d.wait_event(batch.event)
                        ordered = lane.h2d_after_d2h = seq
            to_device(h2d, host, dst)
            append(_Reload(lane, mark, dst))
            nbytes += size if size >= 0 else host.nbytes
            if nbytes >= group_bytes:
                mark.event = record(h2d, free.pop() if free else interface.new_event("reload"))
                progress.marks += 1
                mark.seq = progress.marks
                mark = _Mark(free)
                nbytes = 0
        if copies and not copies[-1]._mark.seq:  # type: ignore[attr-defined]
            mark.event = record(h2d, free.pop() if free else interface.new_event("reload"))
            progress.marks += 1
            mark.seq = progress.marks
        return copies

    def host_buffer(self, device: torch.device, nbytes: int) -> torch.Tensor:
        return self._lane(device).device.host_empty(nbytes)

    def free_host_buffer(self, device: torch.device, host: torch.Tensor) -> None:
        self._lane(device).device.host_free(host)

    def tick(self) -> None:
        for lane in self._lanes.values():
            if lane.batch is not None:
                lane.seal()

    def capturing(self) -> bool:
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()

    def boundary(self) -> bool:
        """``capturing()`` and ``tick()`` inline (a subclass that overrides either gets
        the base's ``boundary``)."""
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            return True
        for lane in self._lanes.values():
            if lane.batch is not None:
                lane.seal()
        return False


class NoOpAccelerator(AcceleratorCopyEngine):
    """The accelerator engine over :class:`NoOpDevice`: each copy a plain ``copy_`` done
    when it is issued, streams, events and waits no-ops, host buffers not pinned.

    For a run on CPU, where there is nothing to overlap and no ordering to get wrong:
    the engine's whole protocol runs, no hazard is checked and no call counted. Tests
    and clocked runs want ``SimulatedAccelerator`` instead.
    """

    pin = False

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return NoOpAccelerator, ()

    def _open(self, device: torch.device) -> Device[Any, Any]:
        return NoOpDevice(device)
