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
``SimulatedAccelerator`` is the same engine over a simulated device on CPU tensors
that lags a chosen number of module boundaries behind the host, turns every call in
the wrong order into a ``HazardError``, and, given a device profile, keeps a clock:
the CPU test suite runs the engine a GPU runs (invariant I11).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence

import torch

from graphswap.runtime._device import Device, Event, HazardError, Stream, TorchDevice
from graphswap.runtime._simdevice import Clock, SimDevice, SimStream
from graphswap.runtime.profile import DeviceProfile, device_profile
from graphswap.runtime.tape import step_labels

__all__ = [
    "AcceleratorCopyEngine",
    "Copy",
    "CopyEngine",
    "HazardError",
    "SimulatedAccelerator",
]


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
    def host_buffer(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` bytes (uint8) for copies to and from ``device``."""

    @abc.abstractmethod
    def tick(self) -> None:
        """A module boundary on the host; a simulated device advances here."""

    @abc.abstractmethod
    def capturing(self) -> bool:
        """True while the current stream captures a graph: no copy, query or wait is legal."""


class _EventCopy(Copy):
    """A copy of this engine: the device it runs on and the event that ends it."""

    __slots__ = ("_device", "_event")

    def __init__(self, device: Device, event: Event) -> None:
        self._device = device
        """The device interface the copy was issued through."""
        self._event = event
        """Recorded on the copy stream right after the copy: it completes with it."""

    def done(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()


class _Offload(_EventCopy):
    __slots__ = ("_hold", "_producer")

    def __init__(
        self, device: Device, event: Event, producer: Stream, hold: torch.UntypedStorage
    ) -> None:
        super().__init__(device, event)
        self._producer = producer
        """The stream current when the source was saved: the one that produced it, and
        the allocation stream whose pool its memory returns to."""
        self._hold: torch.UntypedStorage | None = hold
        """The source's device memory, held until ``release_source``."""

    def fence(self) -> None:
        self._producer.wait_event(self._event)

    def release_source(self) -> None:
        hold = self._hold
        if hold is not None:
            self._device.drop(hold, self._event)
            self._hold = None

    def result(self) -> torch.Tensor:
        raise TypeError("result() of an offload: an offload fills a host buffer")


class _Load(_EventCopy):
    __slots__ = ("_out",)

    def __init__(self, device: Device, event: Event, out: torch.Tensor) -> None:
        super().__init__(device, event)
        self._out = out
        """The destination, allocated on the stream current at issue."""

    def fence(self) -> None:
        self._device.current_stream().wait_event(self._event)

    def release_source(self) -> None:
        """A load holds no source: its host buffer is the pool's, which orders its reuse."""

    def result(self) -> torch.Tensor:
        return self._device.read(self._out, self._event)


class _Lane:
    """One device as the engine drives it: its interface and the engine's two streams."""

    __slots__ = ("d2h", "device", "h2d")

    def __init__(self, device: Device) -> None:
        self.device = device
        """The device's interface: torch's accelerator or the simulated device."""
        self.d2h = device.new_stream()
        """Offloads, in issue order."""
        self.h2d = device.new_stream()
        """Reloads, in issue order: both directions run at once."""


class AcceleratorCopyEngine(CopyEngine):
    """Side streams per device and direction, events, pinned host buffers.

    Offload: the d2h stream waits for the stream that produced the source (the current
    stream when it is saved) and for the host buffer's last users, copies, records an
    event; the source stays referenced until the manager releases it after a fence
    (which makes the producing stream wait) or a completed query. Load: the destination
    is allocated on the current stream; the h2d stream waits for it (the block may still
    be in use by queued kernels) and for the offload, copies, records an event that the
    reading stream waits on before reading.
    """

    pin = True

    def __init__(self) -> None:
        self._lanes: dict[torch.device, _Lane] = {}
        """Per device met, its interface and copy streams."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return AcceleratorCopyEngine, ()

    def _open(self, device: torch.device) -> Device:
        """The device interface for ``device``, met for the first time."""
        return TorchDevice(device)

    def _lane(self, device: torch.device) -> _Lane:
        lane = self._lanes.get(device)
        if lane is None:
            lane = self._lanes[device] = _Lane(self._open(device))
        return lane

    def offload(self, src: torch.Tensor, host: torch.Tensor, after: Sequence[Copy]) -> Copy:
        lane = self._lanes.get(src.device) or self._lane(src.device)
        device = lane.device
        producer = device.current_stream()
        d2h = lane.d2h
        d2h.wait_stream(producer)
        for copy in after:
            if isinstance(copy, _EventCopy):
                d2h.wait_event(copy._event)
        device.to_host(d2h, src, host)
        return _Offload(device, d2h.record_event(), producer, src.untyped_storage())

    def load(self, host: torch.Tensor, device: torch.device, after: Sequence[Copy]) -> Copy:
        lane = self._lanes.get(device) or self._lane(device)
        interface = lane.device
        dst = interface.empty(host.shape, host.dtype)
        h2d = lane.h2d
        h2d.wait_stream(interface.current_stream())
        for copy in after:
            if isinstance(copy, _EventCopy):
                h2d.wait_event(copy._event)
        interface.to_device(h2d, host, dst)
        return _Load(interface, h2d.record_event(), dst)

    def host_buffer(self, device: torch.device, nbytes: int) -> torch.Tensor:
        return self._lane(device).device.host_empty(nbytes)

    def tick(self) -> None:
        """Copies progress on their own streams; nothing to drive from the host."""

    def capturing(self) -> bool:
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class SimulatedAccelerator(AcceleratorCopyEngine):
    """The accelerator engine over a simulated device on CPU tensors.

    ``lag``: a copy completes when the device reaches it, ``lag`` ticks (module
    boundaries) after it was issued (0: at once), in issue order per stream and after
    what it waits for, or earlier when a compute stream waits for it. Sources are held
    until the manager releases them. Every ordering hazard raises ``HazardError``: a
    source released before the stream that allocated it waited for its copy (or the
    host saw it completed), a reload read before the reading stream waited for it, a
    copy that reads bytes its stream has not waited for (a tensor written on another
    stream, a host buffer before its offload filled it), a host buffer rewritten while
    a reload still reads it, and any copy, query or wait while ``capture()`` is active.

    User code makes streams with ``stream()`` and runs on one under ``with stream:``,
    as it would with ``torch.Stream``; ``current_stream()`` is the one it runs on.

    ``profile``: a device profile (a preset name such as ``"h200"``, with figures
    optionally replaced, or a ``DeviceProfile``); with one, ``clock()`` measures a step.
    """

    pin = False

    def __init__(self, lag: int = 0, profile: str | DeviceProfile | None = None) -> None:
        if not isinstance(lag, int) or isinstance(lag, bool) or lag < 0:
            raise ValueError(f"lag must be an int >= 0, got {lag!r}")
        super().__init__()
        self.lag = lag
        """Module boundaries a copy trails the host by."""
        self.profile = None if profile is None else device_profile(profile)
        """What the clock costs work with (None: no clock)."""
        self._sim = SimDevice(lag, self.profile)
        """The one simulated device, whatever ``torch.device`` its tensors name."""

    def __repr__(self) -> str:
        if self.profile is None:
            return f"SimulatedAccelerator(lag={self.lag})"
        return f"SimulatedAccelerator(lag={self.lag}, profile={self.profile.name!r})"

    def __reduce__(self) -> tuple[type, tuple[int, DeviceProfile | None]]:  # type: ignore[override]
        """A copy is a fresh device with the same lag and profile, nothing in flight."""
        return SimulatedAccelerator, (self.lag, self.profile)

    def _open(self, device: torch.device) -> Device:
        return self._sim

    def tick(self) -> None:
        self._sim.tick()

    def capturing(self) -> bool:
        return self._sim.capturing

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Behave as if the current stream captured a graph."""
        with self._sim.capture():
            yield

    def pending(self) -> int:
        """Copies issued and not yet completed."""
        return self._sim.pending()

    def stream(self) -> SimStream:
        """A new stream for user code (``torch.Stream()`` on a GPU)."""
        return self._sim.compute_stream()

    def current_stream(self) -> SimStream:
        """The stream operators run on now (``torch.accelerator.current_stream()``)."""
        return self._sim.current

    @contextlib.contextmanager
    def clock(
        self, layers: Sequence[torch.nn.Module] = (), *, base_bytes: int = 0
    ) -> Iterator[Clock]:
        """Measure one step run inside: ``clock.timeline`` is filled when it ends.

        ``layers``: the decoder layers, in forward order, that label the timeline
        (``F<i>``, ``B<i>``); ``base_bytes``: device memory already held when the step
        begins (parameters, gradients, optimizer state), counted in every figure of
        memory. ``clock.label("optimizer")`` names what runs next.
        """
        if self.profile is None:
            raise ValueError(
                "SimulatedAccelerator(profile=None) keeps no clock; pass a device profile,"
                " e.g. SimulatedAccelerator(profile='h200') or a DeviceProfile"
            )
        if not isinstance(base_bytes, int) or isinstance(base_bytes, bool) or base_bytes < 0:
            raise ValueError(f"base_bytes must be an int >= 0, got {base_bytes!r}")
        clock = self._sim.start_clock(base_bytes)
        try:
            with clock.tape, step_labels(layers, clock.tape):
                yield clock
        finally:
            self._sim.stop_clock()
