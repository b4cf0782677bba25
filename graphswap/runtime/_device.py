"""The device interface the copy engine is written against, and torch's accelerator.

The engine needs little of a device: its current stream, new streams, events it
records again and again (created once, pooled), waits, asynchronous copies in both
directions, device and host allocations, and a word when it lets go of a source a
copy read. Waits and queries are made through the methods ``torch.Stream`` and
``torch.Event`` have, so on a GPU the engine holds torch's own objects and calls
them directly; everything else goes through a :class:`Device`. :class:`TorchDevice`
is torch's accelerator API; the simulated device (``graphswap.runtime.sim``)
is the same interface on CPU, with every ordering hazard checked, so the engine a GPU
runs is the engine CI runs; :class:`NoOpDevice` is the interface with nothing to
order: each copy is done when its call returns, so streams, events and waits are no-ops.
"""

from __future__ import annotations

import abc
from typing import Any, Generic, Protocol, TypeVar

import torch

from graphswap.errors import GraphswapError


class HazardError(GraphswapError, RuntimeError):
    """An asynchronous copy was used in an order a real accelerator would corrupt."""


class Event(Protocol):
    """A point on a stream (``torch.Event``)."""

    def query(self) -> bool:
        """True once the work before the point completed; never blocks."""
        ...

    def synchronize(self) -> None:
        """Block the host until the work before the point completed."""
        ...


class Stream(Protocol):
    """An ordered queue of device work (``torch.Stream``); ``with stream:`` makes it current."""

    def wait_event(self, event: Any) -> None:
        """Work queued later on this stream starts after ``event``; the host does not block."""
        ...

    def wait_stream(self, stream: Any) -> None:
        """Work queued later on this stream starts after all work queued on ``stream``."""
        ...

    def record_event(self) -> Any:
        """An event at the end of what is queued on this stream now."""
        ...

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: Any, exc: Any, tb: Any, /) -> Any: ...


S = TypeVar("S", bound=Stream)
E = TypeVar("E", bound=Event)


class Device(abc.ABC, Generic[S, E]):
    """One accelerator, as the copy engine uses it."""

    __slots__ = ()

    @abc.abstractmethod
    def current_stream(self) -> S:
        """The stream compute runs on now (``with stream:`` changes it)."""

    @abc.abstractmethod
    def new_stream(self, role: str) -> S:
        """A stream of the engine's own, for copies (``role``: ``offload`` or ``reload``)."""

    @abc.abstractmethod
    def new_event(self, role: str) -> E:
        """An event the engine records again and again; ``role`` says what it orders."""

    @abc.abstractmethod
    def record(self, stream: S, event: E) -> E:
        """Record ``event`` at the end of what is queued on ``stream`` now; a wait made
        before keeps the point it waited for."""

    @abc.abstractmethod
    def to_host(self, stream: S, src: torch.Tensor, host: torch.Tensor) -> None:
        """Queue the copy of device tensor ``src`` into host tensor ``host`` on ``stream``."""

    @abc.abstractmethod
    def to_device(self, stream: S, host: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue the copy of host tensor ``host`` into device tensor ``dst`` on ``stream``."""

    @abc.abstractmethod
    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor allocated on the current stream (the caching allocator's pool
        of that stream)."""

    def empty_like(self, host: torch.Tensor) -> torch.Tensor:
        """``empty`` of ``host``'s shape and dtype: a reload's destination. A device may
        make it in one call (``torch.empty`` parses a shape and three keywords)."""
        return self.empty(host.shape, host.dtype)

    @abc.abstractmethod
    def host_empty(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` bytes for copies to and from this device."""

    @abc.abstractmethod
    def host_free(self, host: torch.Tensor) -> None:
        """The engine drops ``host``, a buffer of ``host_empty``."""

    @abc.abstractmethod
    def drop(self, storage: torch.UntypedStorage, event: E) -> None:
        """The engine lets go of ``storage``, which the copy ending at ``event`` read.

        Legal once the copy completed or the stream that allocated the storage waited
        for ``event``: the caching allocator hands a block freed on its allocation
        stream out again at once, to that stream's next kernel."""

    @abc.abstractmethod
    def read(self, dst: torch.Tensor, event: E) -> torch.Tensor:
        """``dst``, filled by the copy ending at ``event``, for the current stream to
        read; legal once the current stream waited for ``event``."""


class TorchDevice(Device[Stream, Event]):
    """torch's accelerator API (CUDA, ROCm, XPU, ...): nothing here checks anything."""

    __slots__ = ("device",)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        """The accelerator this interface drives."""

    def current_stream(self) -> Stream:
        return torch.accelerator.current_stream(self.device)

    def new_stream(self, role: str) -> Stream:
        return torch.Stream(device=self.device)

    def new_event(self, role: str) -> Event:
        return torch.Event(device=self.device)

    def record(self, stream: Stream, event: Event) -> Event:
        event.record(stream)  # type: ignore[attr-defined]
        return event

    def to_host(self, stream: Stream, src: torch.Tensor, host: torch.Tensor) -> None:
        with stream:
            host.copy_(src, non_blocking=True)

    def to_device(self, stream: Stream, host: torch.Tensor, dst: torch.Tensor) -> None:
        with stream:
            dst.copy_(host, non_blocking=True)

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def empty_like(self, host: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(host, device=self.device)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def host_free(self, host: torch.Tensor) -> None:
        """The block goes back to torch's caching host allocator when the last reference
        dies: no driver call, and its cache is never emptied (other components, a
        DataLoader's ``pin_memory`` among them, keep theirs there)."""

    def drop(self, storage: torch.UntypedStorage, event: Event) -> None:
        """The engine orders the drop (a completed query or a fence); nothing to add."""

    def read(self, dst: torch.Tensor, event: Event) -> torch.Tensor:
        return dst


class _NoOpEvent:
    """An event of :class:`NoOpDevice`: every copy before it is done already."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing is in flight."""


_EVENT = _NoOpEvent()
"""The one event: recording it again changes nothing."""


class _NoOpStream:
    """A stream of :class:`NoOpDevice`: its work runs on the host, in call order."""

    __slots__ = ()

    def wait_event(self, event: Any) -> None:
        """Whatever the event ends is done already."""

    def wait_stream(self, stream: Any) -> None:
        """Whatever the stream queued is done already."""

    def record_event(self) -> Any:
        return _EVENT

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_STREAM = _NoOpStream()
"""The one stream: compute's and both copy streams'."""


class NoOpDevice(Device[Stream, Event]):
    """A device on which every copy is a plain ``copy_`` done when its call returns, so
    nothing needs ordering: streams, events and waits are no-ops and cost a call each.

    What a CPU run needs (its tensors and the host are one memory), and what measures
    the engine's and the manager's own host time, without a simulator's bookkeeping.
    Correct on any device torch copies synchronously to and from, but it overlaps nothing.
    """

    __slots__ = ("device",)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        """Where ``empty`` allocates reloads."""

    def current_stream(self) -> Stream:
        return _STREAM

    def new_stream(self, role: str) -> Stream:
        return _STREAM

    def new_event(self, role: str) -> Event:
        return _EVENT

    def record(self, stream: Stream, event: Event) -> Event:
        return event

    def to_host(self, stream: Stream, src: torch.Tensor, host: torch.Tensor) -> None:
        host.copy_(src)

    def to_device(self, stream: Stream, host: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(host)

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def empty_like(self, host: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(host, device=self.device)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def host_free(self, host: torch.Tensor) -> None:
        """The buffer goes back to the allocator with its last reference."""

    def drop(self, storage: torch.UntypedStorage, event: Event) -> None:
        """The copy that read the storage is done already."""

    def read(self, dst: torch.Tensor, event: Event) -> torch.Tensor:
        return dst
