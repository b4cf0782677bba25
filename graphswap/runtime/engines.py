"""Copy engines: move whole storages between a compute device and host buffers.

A copy is asynchronous. The manager drives it through four calls, and the order
of those calls is what keeps memory correct:

- ``done()`` asks, without blocking, whether the copy has completed;
- ``fence()`` orders the compute stream after the copy (a stream wait, the host
  does not block): from then on compute may reuse the source's memory or read a
  reload's result;
- ``release_source()`` drops the offload's reference to its device source; legal
  only after ``done()`` answered True or after ``fence()``;
- ``synchronize()`` blocks the host until the copy completed (never in the hot path).

``AcceleratorCopyEngine`` runs copies on side streams of a real accelerator.
``SimulatedAccelerator`` runs the same protocol on CPU tensors with a device that
lags a chosen number of module boundaries behind the host, and turns every call in
the wrong order into a ``HazardError``: the CPU test suite exercises the schedule
a GPU runs (invariant I11).
"""

from __future__ import annotations

import abc
import collections
import contextlib
from collections.abc import Iterator, Sequence

import torch


class HazardError(RuntimeError):
    """An asynchronous copy was used in an order a real accelerator would corrupt."""


class Copy(abc.ABC):
    """One asynchronous copy: an offload (device to host) or a load (host to device)."""

    @abc.abstractmethod
    def done(self) -> bool: ...

    @abc.abstractmethod
    def fence(self) -> None: ...

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    @abc.abstractmethod
    def release_source(self) -> None: ...

    @abc.abstractmethod
    def result(self) -> torch.Tensor:
        """The device tensor a load filled; legal only after ``fence()``."""


class CopyEngine(abc.ABC):
    """Issues copies for every device the manager meets."""

    pin: bool
    """Whether host buffers for this engine are pinned (page-locked)."""

    @abc.abstractmethod
    def offload(self, src: torch.Tensor, host: torch.Tensor, after: Sequence[Copy]) -> Copy:
        """Copy ``src`` (a contiguous device tensor) into ``host`` (a host tensor of its
        dtype and shape) once every copy in ``after`` (earlier users of the host buffer)
        has completed. ``src`` may be the saved tensor itself (the pack hook runs
        without grad): the copy keeps its storage, never its autograd graph."""

    @abc.abstractmethod
    def load(self, host: torch.Tensor, device: torch.device, after: Sequence[Copy]) -> Copy:
        """Copy ``host`` into a new tensor of its dtype and shape on ``device`` after
        ``after``."""

    @abc.abstractmethod
    def tick(self) -> None:
        """A module boundary on the host; a simulated device advances here."""

    @abc.abstractmethod
    def capturing(self) -> bool:
        """True while the current stream captures a graph: no copy, query or wait is legal."""


class _EventCopy(Copy):
    __slots__ = ("_device", "_event", "_hold", "_out")

    def __init__(
        self,
        event: torch.Event,
        device: torch.device,
        *,
        hold: torch.UntypedStorage | None = None,
        out: torch.Tensor | None = None,
    ) -> None:
        self._event = event
        self._device = device
        self._hold = hold
        self._out = out

    def done(self) -> bool:
        return self._event.query()

    def fence(self) -> None:
        torch.accelerator.current_stream(self._device).wait_event(self._event)

    def synchronize(self) -> None:
        self._event.synchronize()

    def release_source(self) -> None:
        self._hold = None

    def result(self) -> torch.Tensor:
        assert self._out is not None, "result() of an offload"
        return self._out


class AcceleratorCopyEngine(CopyEngine):
    """Side streams per device and direction, events, pinned host buffers.

    Offload: the d2h stream waits for compute and for the host buffer's last users,
    copies, records an event; the source stays referenced until the manager releases
    it after a fence or a completed query. Load: the destination is allocated on the
    compute stream; the h2d stream waits for compute (the block may still be in use by
    queued kernels) and for the offload, copies, records an event that compute waits on
    before reading.
    """

    pin = True

    def __init__(self) -> None:
        self._streams: dict[torch.device, tuple[torch.Stream, torch.Stream]] = {}

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return AcceleratorCopyEngine, ()

    def _streams_of(self, device: torch.device) -> tuple[torch.Stream, torch.Stream]:
        streams = self._streams.get(device)
        if streams is None:
            streams = (torch.Stream(device=device), torch.Stream(device=device))
            self._streams[device] = streams
        return streams

    def _issue(self, stream: torch.Stream, device: torch.device, after: Sequence[Copy]) -> None:
        stream.wait_stream(torch.accelerator.current_stream(device))
        for copy in after:
            if isinstance(copy, _EventCopy):
                stream.wait_event(copy._event)

    def offload(self, src: torch.Tensor, host: torch.Tensor, after: Sequence[Copy]) -> Copy:
        device = src.device
        d2h, _ = self._streams_of(device)
        self._issue(d2h, device, after)
        with d2h:
            host.copy_(src, non_blocking=True)
        return _EventCopy(d2h.record_event(), device, hold=src.untyped_storage())

    def load(self, host: torch.Tensor, device: torch.device, after: Sequence[Copy]) -> Copy:
        _, h2d = self._streams_of(device)
        dst = torch.empty(host.shape, dtype=host.dtype, device=device)
        self._issue(h2d, device, after)
        with h2d:
            dst.copy_(host, non_blocking=True)
        return _EventCopy(h2d.record_event(), device, out=dst)

    def tick(self) -> None:
        """Copies progress on their own streams; nothing to drive from the host."""

    def capturing(self) -> bool:
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class _SimCopy(Copy):
    __slots__ = (
        "_engine",
        "after",
        "conflicts",
        "dst",
        "due",
        "executed",
        "fenced",
        "hold",
        "key",
        "kind",
        "src",
    )

    def __init__(
        self,
        engine: SimulatedAccelerator,
        kind: str,
        src: torch.Tensor,
        dst: torch.Tensor | None,
        after: Sequence[Copy],
    ) -> None:
        self._engine = engine
        self.kind = kind
        self.src: torch.Tensor | None = src
        """Read when the copy executes."""
        self.hold = src.untyped_storage() if kind == "offload" else None
        """An offload's device memory, held until ``release_source``."""
        self.dst = dst
        """A load's destination is made when the load executes: on CPU, when it is
        allocated changes no ordering."""
        self.after = after
        self.due = engine.now + engine.lag
        self.executed = False
        self.fenced = False
        self.key = 0
        """The host buffer this copy writes (offload) or reads (load); set when queued."""
        self.conflicts: list[_SimCopy] | None = None
        """Copies in flight when this one was queued that touch the same host buffer the
        other way (None: never queued, or completed)."""

    def done(self) -> bool:
        if self._engine._capturing:
            self._engine._illegal("an event query")
        return self.executed

    def fence(self) -> None:
        if self._engine._capturing:
            self._engine._illegal("a stream wait")
        if not self.executed:
            self._engine._force(self)
        self.fenced = True

    def synchronize(self) -> None:
        if self._engine._capturing:
            self._engine._illegal("a synchronize")
        if not self.executed:
            self._engine._force(self)

    def release_source(self) -> None:
        if not self.executed:
            raise HazardError(
                f"the source of a {self.kind} was released before its copy completed:"
                " the allocator could hand its memory to compute while the copy reads it"
            )
        self.hold = None

    def result(self) -> torch.Tensor:
        if not self.fenced:
            raise HazardError(
                "a reload was read before compute waited for its copy: it may hold stale bytes"
            )
        assert self.dst is not None, "result() of an offload"
        return self.dst


class SimulatedAccelerator(CopyEngine):
    """An accelerator's side streams on CPU tensors, lagging ``lag`` module boundaries.

    A copy completes when the simulated device reaches it: ``lag`` ticks after it was
    issued (0: at once), in issue order per direction and after the copies it waits
    for, or earlier when compute fences it. Sources are held until the manager
    releases them. Every ordering hazard raises ``HazardError``: a source released
    before its copy completed, a reload read without a fence, a host buffer written
    while a copy still reads it or read before its offload wrote it, and any copy,
    query or wait while ``capture()`` is active.
    """

    pin = False

    def __init__(self, lag: int = 0) -> None:
        if not isinstance(lag, int) or isinstance(lag, bool) or lag < 0:
            raise ValueError(f"lag must be an int >= 0, got {lag!r}")
        self.lag = lag
        self.now = 0
        self._d2h: collections.deque[_SimCopy] = collections.deque()
        self._h2d: collections.deque[_SimCopy] = collections.deque()
        self._touching: dict[int, list[_SimCopy]] = collections.defaultdict(list)
        self._capturing = False

    def __repr__(self) -> str:
        return f"SimulatedAccelerator(lag={self.lag})"

    def __reduce__(self) -> tuple[type, tuple[int]]:
        """A copy is a fresh device with the same lag, nothing in flight."""
        return SimulatedAccelerator, (self.lag,)

    def offload(self, src: torch.Tensor, host: torch.Tensor, after: Sequence[Copy]) -> Copy:
        if self._capturing:
            self._illegal("a device-to-host copy")
        return self._submit(_SimCopy(self, "offload", src, host, after), self._d2h)

    def load(self, host: torch.Tensor, device: torch.device, after: Sequence[Copy]) -> Copy:
        """``device`` is the CPU: the simulated device's memory is host memory."""
        if self._capturing:
            self._illegal("a host-to-device copy")
        return self._submit(_SimCopy(self, "load", host, None, after), self._h2d)

    def tick(self) -> None:
        self.now += 1
        if self._d2h or self._h2d:
            self._advance()

    def capturing(self) -> bool:
        return self._capturing

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Behave as if the current stream captured a graph."""
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def pending(self) -> int:
        """Copies issued and not yet completed."""
        return len(self._d2h) + len(self._h2d)

    def _submit(self, copy: _SimCopy, stream: collections.deque[_SimCopy]) -> _SimCopy:
        if copy.due <= self.now and not self._d2h and not self._h2d:
            # Nothing in flight: nothing to order against; the copy completes now.
            self._execute(copy)
            return copy
        self._issue(copy)
        stream.append(copy)
        self._advance()
        return copy

    def _issue(self, copy: _SimCopy) -> None:
        assert copy.src is not None
        if copy.kind == "offload":
            # Queued, the copy may outlive the forward: it keeps the bytes, not the graph.
            copy.src = copy.src.detach()
            host = copy.dst
        else:
            host = copy.src
        assert host is not None
        copy.key = host.data_ptr()
        touching = self._touching[copy.key]
        copy.conflicts = [c for c in touching if c.kind != copy.kind]
        touching.append(copy)

    def _illegal(self, what: str) -> None:
        raise HazardError(f"{what} while the current stream captures a graph")

    def _advance(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            for stream in (self._h2d, self._d2h):
                while (
                    stream
                    and stream[0].due <= self.now
                    and all(isinstance(a, _SimCopy) and a.executed for a in stream[0].after)
                ):
                    self._execute(stream.popleft())
                    progressed = True

    def _force(self, copy: _SimCopy) -> None:
        stream = self._d2h if copy.kind == "offload" else self._h2d
        while not copy.executed:
            head = stream.popleft()
            for dep in head.after:
                if isinstance(dep, _SimCopy) and not dep.executed:
                    self._force(dep)
            self._execute(head)

    def _execute(self, copy: _SimCopy) -> None:
        assert copy.src is not None
        if copy.conflicts and any(not c.executed for c in copy.conflicts):
            raise HazardError(
                "a host buffer was rewritten while a reload still reads it;"
                " an offload must wait for the buffer's last use"
                if copy.kind == "offload"
                else "a reload read a host buffer before its offload filled it"
            )
        if copy.conflicts is not None:
            touching = self._touching[copy.key]
            touching.remove(copy)
            if not touching:
                del self._touching[copy.key]
        copy.conflicts = None
        if copy.dst is None:
            copy.dst = copy.src.clone()
        else:
            copy.dst.copy_(copy.src)
        copy.src = None
        copy.executed = True
