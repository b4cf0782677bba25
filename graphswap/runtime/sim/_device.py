"""The simulated accelerator: the device interface on CPU tensors, with every hazard checked.

Compute streams (the default stream, and those user code makes with
``SimulatedAccelerator.stream()``) run on the host: an operator issued on one is
done at once. Copy streams (the engine's) are queues the simulated device works
through on its own, ``lag`` module boundaries behind the host, in order, each item
after the events it waits for; a compute stream that waits for a copy makes the
device finish it there.

Ordering is tracked as a real device's would be, with vector clocks: each stream
knows which position of every other stream it has waited for, and each storage its
allocation stream, its last writer and the copies that read it since. Any access a
real device could run out of order raises :class:`HazardError`: a copy that reads
bytes its stream has not waited for, a host buffer rewritten while a copy still
reads it, a source dropped before its allocation stream waited for the copy that
reads it (the caching allocator's rule), a reload read before the reading stream
waited for it, and anything at all while ``capture()`` is active.

Given a :class:`DeviceProfile`, the device also keeps the clock the planner replays:
an :class:`OpTape` times every operator on the current stream, copies take bytes
over link bandwidth on theirs, waits idle the waiting stream (a stall when it is the
current one), the host sees a copy done once compute reached its end, and the
timeline records compute, copies, stalls and memory.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from graphswap.errors import SwapStateError
from graphswap.runtime._device import Device, HazardError
from graphswap.runtime.profile import DeviceProfile, OpCost
from graphswap.runtime.timeline import OpTape, StepTimeline

Point = tuple["SimStream", int]
"""A position on a stream: what an event marks, a write or a read happened at."""


class SimEvent:
    """A point on a simulated stream, and the positions of other streams it follows.

    Like ``torch.Event`` it can be recorded again: a wait or query uses the record
    current when it is made (a queued wait keeps the point it waits for)."""

    __slots__ = ("device", "epoch", "position", "role", "stream", "time", "waited")

    def __init__(self, device: SimDevice, role: str) -> None:
        self.device = device
        """The device that answers queries about the event."""
        self.role = role
        """What the event orders (``offload``, ``reload``, ``user``): its calls count there."""
        self.stream: SimStream | None = None
        """The stream the event was last recorded on (None: never recorded)."""
        self.position = 0
        """The last item queued on ``stream`` before the record."""
        self.waited: dict[SimStream, int] = {}
        """What ``stream`` had waited for at the record: a stream that waits for the event
        has waited for all of it too."""
        self.time = 0.0
        """The clock's ``stream.busy_until`` at record (0 without a clock)."""
        self.epoch = 0
        """The clocked step of the record: from an earlier one, it is at 0."""

    def query(self) -> bool:
        return self.device.query(self)

    def synchronize(self) -> None:
        self.device.synchronize(self)


class SimStream:
    """A simulated stream: ``torch.Stream``'s methods, and ``with stream:`` makes it current."""

    __slots__ = (
        "__weakref__",
        "busy_until",
        "copies",
        "device",
        "done",
        "issued",
        "name",
        "observed",
        "queue",
        "waited",
    )

    def __init__(self, device: SimDevice, name: str, *, copies: bool) -> None:
        self.device = device
        """The device that runs the stream's work."""
        self.name = name
        """How hazard messages call it."""
        self.copies = copies
        """A copy stream, worked through by the device; else a compute stream, run by
        the host."""
        self.issued = 0
        """Items queued so far (copies and waits on a copy stream, writing operators on
        a compute stream): the position of the last one."""
        self.done = 0
        """The position the device has completed; a compute stream's is ``issued``."""
        self.observed = 0
        """The position the host has seen completed (a query that answered True, a
        synchronize): the host may free what work up to there read."""
        self.queue: collections.deque[_Wait | _Copy] = collections.deque()
        """A copy stream's items not yet completed, in order."""
        self.waited: dict[SimStream, int] = {}
        """The position of each other stream this stream has waited for."""
        self.busy_until = 0.0
        """Clock: when the work queued on this stream so far ends, seconds into the step."""

    def __repr__(self) -> str:
        return self.name

    def wait_event(self, event: SimEvent) -> None:
        self.device.wait(self, event)

    def wait_stream(self, stream: SimStream) -> None:
        self.device.wait(self, stream.record_event())

    def record_event(self) -> SimEvent:
        return self.device.record(self, self.device.new_event("user"))

    def __enter__(self) -> SimStream:
        self.device.enter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.device.leave()


class _Wait:
    """A copy stream's wait: later items start once ``stream`` completed ``until``."""

    __slots__ = ("position", "stream", "until")

    def __init__(self, stream: SimStream, until: int, position: int) -> None:
        self.stream = stream
        """The stream waited for."""
        self.until = until
        """Its position waited for (the event's at the wait: a later record changes nothing)."""
        self.position = position
        """The wait's own position on its stream."""


class _Copy:
    """A copy queued on a copy stream; references dropped once it executed."""

    __slots__ = ("dst", "due", "hazard", "position", "src")

    def __init__(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        due: int,
        position: int,
        hazard: str | None,
    ) -> None:
        self.src: torch.Tensor | None = src
        """What the copy reads (a detached alias, once queued)."""
        self.dst: torch.Tensor | None = dst
        """What the copy writes."""
        self.due = due
        """The tick from which the device may execute it (issue tick + lag)."""
        self.position = position
        """The copy's position on its stream."""
        self.hazard = hazard
        """Why executing it corrupts bytes, found when it was queued (None: it does not);
        raised when it executes, where a real device would read or write the wrong bytes."""


class _Storage:
    """What the device knows of one storage that a side stream or a copy touched."""

    __slots__ = ("alloc", "readers", "writer")

    def __init__(self, alloc: SimStream) -> None:
        self.alloc = alloc
        """The stream current when it was allocated: the caching allocator's pool it
        returns to."""
        self.writer: Point | None = None
        """The last write (None: none seen, as for what the default stream computes)."""
        self.readers: list[Point] = []
        """Copies that read it since that write."""


def _follows(stream: SimStream, point: Point) -> bool:
    """Whether work queued on ``stream`` from now on is ordered after ``point``."""
    other, position = point
    return other is stream or stream.waited.get(other, 0) >= position


def _after(stream: SimStream, point: Point) -> bool:
    """Whether work queued on ``stream`` from now on runs after ``point``: ordered by its
    waits, or completed where the host saw it (a query that answered True, a synchronize),
    which comes before whatever the host queues next."""
    return point[0].observed >= point[1] or _follows(stream, point)


_SET = torch.ops.aten.set_
"""Changes a tensor's storage, writes none."""


class _Tracking(TorchDispatchMode):
    """While a stream other than the default one is current: the storages operators
    allocate and write are attributed to it (the default stream needs no record)."""

    def __init__(self, device: SimDevice) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode unannotated
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        device = self.device
        stream = device.current
        if device.own or stream is device.default or func.is_view or func._overloadpacket is _SET:
            return out
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs:
            return out
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.layout is torch.strided
        }
        stream.issued += 1
        stream.done = stream.issued
        for t in outputs:
            storage = t.untyped_storage()
            born = storage._cdata not in inputs
            record = device.record_of(storage, stream if born else device.default)
            record.writer = (stream, stream.issued)
            record.readers = []
        return out


class SimDevice(Device[SimStream, SimEvent]):
    """One simulated accelerator: its streams, the storages they touched, its clock."""

    def __init__(self, lag: int, profile: DeviceProfile | None) -> None:
        self.lag = lag
        """Module boundaries a copy trails the host by before the device executes it."""
        self.profile = profile
        """What the clock costs work with (None: no clock)."""
        self.now = 0
        """Module boundaries the host has passed (``tick``)."""
        self.default = SimStream(self, "the default stream", copies=False)
        self.current = self.default
        """The stream compute runs on now."""
        self._entered: list[tuple[SimStream, _Tracking | None]] = []
        """Per active ``with stream:``, the stream current before and the tracking mode it
        started (None: one was active already, or the stream is the default one)."""
        self._copy_streams: list[SimStream] = []
        """The engine's streams, in creation order (the order the device works them)."""
        self._streams: weakref.WeakSet[SimStream] = weakref.WeakSet([self.default])
        """Every stream alive, for the clock's start and end."""
        self._storages: dict[int, _Storage] = {}
        """Records by storage ``_cdata``, removed when the storage dies."""
        self._made = 0
        """Streams made so far, to name them."""
        self.capturing = False
        """Whether ``capture()`` is active."""
        self.own = 0
        """Depth of the device's own work (executing copies, allocating): not the model's,
        so neither tracked nor timed."""
        self.clock: Clock | None = None
        """The step being clocked, if one is."""
        self.epoch = 0
        """Clocked steps begun: events of earlier ones count as at time 0."""
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        """Accelerator calls made, by (kind, what they serve): ``event_create``,
        ``record``, ``wait``, ``query``, ``synchronize``, ``copy`` for ``offload``,
        ``reload`` or ``user``; ``capture_query``; ``host_alloc`` and ``host_free``."""

    # -- streams and events (called by SimStream and SimEvent) --------------------------

    def current_stream(self) -> SimStream:
        return self.current

    def new_stream(self, role: str) -> SimStream:
        return self._stream(f"{role} copy stream", copies=True)

    def new_event(self, role: str) -> SimEvent:
        self.calls["event_create", role] += 1
        return SimEvent(self, role)

    def compute_stream(self) -> SimStream:
        """A stream for user code: operators issued under ``with stream:`` run on it."""
        return self._stream("stream", copies=False)

    def _stream(self, kind: str, *, copies: bool) -> SimStream:
        self._made += 1
        stream = SimStream(self, f"{kind} {self._made}", copies=copies)
        self._streams.add(stream)
        if copies:
            self._copy_streams.append(stream)
        return stream

    def enter(self, stream: SimStream) -> None:
        tracking = None
        if stream is not self.default and not any(t for _, t in self._entered):
            tracking = _Tracking(self)
            tracking.__enter__()  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode unannotated
        self._entered.append((self.current, tracking))
        self.current = stream

    def leave(self) -> None:
        previous, tracking = self._entered.pop()
        self.current = previous
        if tracking is not None:
            tracking.__exit__(None, None, None)  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode unannotated

    def record(self, stream: SimStream, event: SimEvent) -> SimEvent:
        if self.capturing:
            _illegal("an event record")
        self.calls["record", event.role] += 1
        waited = dict(stream.waited)
        waited[stream] = stream.issued
        event.stream, event.position, event.waited = stream, stream.issued, waited
        event.time = stream.busy_until if self.clock is not None else 0.0
        event.epoch = self.epoch
        return event

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        if self.capturing:
            _illegal("a stream wait")
        self.calls["wait", event.role] += 1
        waited_for = event.stream
        assert waited_for is not None, "a wait for an event never recorded"
        if stream.copies:
            stream.issued += 1
            if stream.queue or waited_for.done < event.position:
                stream.queue.append(_Wait(waited_for, event.position, stream.issued))
            else:
                stream.done = stream.issued
        else:
            # The host runs this stream: it goes on only once the device got there.
            self._force(waited_for, event.position)
        waited = stream.waited
        for other, position in event.waited.items():
            if other is not stream and waited.get(other, 0) < position:
                waited[other] = position
        if self.clock is not None:
            self.clock.wait(stream, event)

    def query(self, event: SimEvent) -> bool:
        if self.capturing:
            _illegal("an event query")
        self.calls["query", event.role] += 1
        stream = event.stream
        assert stream is not None, "a query of an event never recorded"
        if stream.done < event.position:
            return False
        if (
            self.clock is not None
            and event.epoch == self.epoch
            and event.time > self.current.busy_until
        ):
            # The host runs in lockstep with compute: it sees what ended by compute's time.
            return False
        stream.observed = max(stream.observed, event.position)
        return True

    def synchronize(self, event: SimEvent) -> None:
        if self.capturing:
            _illegal("a synchronize")
        self.calls["synchronize", event.role] += 1
        stream = event.stream
        assert stream is not None, "a synchronize of an event never recorded"
        self._force(stream, event.position)
        if self.clock is not None:
            # The host blocks until then, so compute issued after starts no earlier.
            self.clock.wait(self.current, event)
        stream.observed = max(stream.observed, event.position)

    # -- the device interface ---------------------------------------------------------

    def to_host(self, stream: SimStream, src: torch.Tensor, host: torch.Tensor) -> None:
        if self.capturing:
            _illegal("a device-to-host copy")
        self.calls["copy", "offload"] += 1
        stream.issued += 1
        hazard = self._offload_hazard(stream, src, host)
        self._queue(stream, src, host, hazard, to_host=True)

    def to_device(self, stream: SimStream, host: torch.Tensor, dst: torch.Tensor) -> None:
        if self.capturing:
            _illegal("a host-to-device copy")
        self.calls["copy", "reload"] += 1
        stream.issued += 1
        hazard = self._load_hazard(stream, host, dst)
        self._queue(stream, host, dst, hazard, to_host=False)

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        dst: torch.Tensor = self._own(torch.empty, shape, dtype=dtype)
        storage = dst.untyped_storage()
        if self.current is not self.default:
            self.record_of(storage, self.current)
        if self.clock is not None:
            self.clock.tape.track(storage)
        return dst

    def host_empty(self, nbytes: int) -> torch.Tensor:
        self.calls["host_alloc", "host"] += 1
        host: torch.Tensor = self._own(torch.empty, nbytes, dtype=torch.uint8)
        return host

    def host_free(self, host: torch.Tensor) -> None:
        self.calls["host_free", "host"] += 1

    def is_capturing(self) -> bool:
        """The capture query (``cudaStreamIsCapturing``), counted."""
        self.calls["capture_query", "boundary"] += 1
        return self.capturing

    def drop(self, storage: torch.UntypedStorage, event: SimEvent) -> None:
        copy_stream = event.stream
        assert copy_stream is not None, "the engine drops a source after its copy's record"
        if copy_stream.observed >= event.position:
            return
        record = self._storages.get(storage._cdata)
        alloc = self.default if record is None else record.alloc
        if not _follows(alloc, (copy_stream, event.position)):
            raise HazardError(
                f"the source of an offload was released before its copy completed and before"
                f" {alloc} (the stream that allocated it) waited for the copy: the caching"
                f" allocator hands a block freed on its allocation stream to that stream's"
                f" next kernel at once, while {copy_stream} may still read it; fence the"
                f" copy on the stream that produced the tensor, or release it once done()"
                f" answered True"
            )

    def read(self, dst: torch.Tensor, event: SimEvent) -> torch.Tensor:
        assert event.stream is not None, "the engine reads a reload after its copy's record"
        if not _follows(self.current, (event.stream, event.position)):
            raise HazardError(
                f"a reload was read before compute waited for its copy: it may hold stale"
                f" bytes; {self.current} must wait for the copy's event (fence()) before"
                f" reading it"
            )
        return dst

    # -- the device's own work ---------------------------------------------------------

    def _own(self, op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run an operator of the device's own (a copy it executes, an allocation): not
        the model's, so neither tracked nor timed."""
        self.own += 1
        try:
            if self.clock is None:
                return op(*args, **kwargs)
            with self.clock.tape.suspended():
                return op(*args, **kwargs)
        finally:
            self.own -= 1

    def tick(self) -> None:
        self.now += 1
        self._advance()

    def pending(self) -> int:
        return sum(type(item) is _Copy for s in self._copy_streams for item in s.queue)

    def record_of(self, storage: torch.UntypedStorage, alloc: SimStream) -> _Storage:
        """The record of ``storage``, made with allocation stream ``alloc`` if new."""
        key = storage._cdata
        record = self._storages.get(key)
        if record is None:
            record = self._storages[key] = _Storage(alloc)
            weakref.finalize(storage, self._storages.pop, key, None).atexit = False
        return record

    def _offload_hazard(
        self, stream: SimStream, src: torch.Tensor, host: torch.Tensor
    ) -> str | None:
        position = stream.issued
        hazard = None
        record = self._storages.get(src.untyped_storage()._cdata)
        if record is not None and record.writer is not None and not _follows(stream, record.writer):
            hazard = (
                f"an offload read a tensor {record.writer[0]} wrote before {stream} waited for"
                f" that stream: it copies bytes that may not be written yet; the copy stream"
                f" must wait for the stream that produced the tensor (the stream current when"
                f" it was saved)"
            )
        buffer = self.record_of(host.untyped_storage(), self.default)
        if buffer.writer is not None and not _after(stream, buffer.writer):
            hazard = hazard or "a host buffer was rewritten while another offload still writes it"
        if any(not _after(stream, reader) for reader in buffer.readers):
            hazard = hazard or (
                "a host buffer was rewritten while a reload still reads it;"
                " an offload must wait for the buffer's last use"
            )
        buffer.writer = (stream, position)
        buffer.readers = []
        return hazard

    def _load_hazard(self, stream: SimStream, host: torch.Tensor, dst: torch.Tensor) -> str | None:
        position = stream.issued
        hazard = None
        buffer = self.record_of(host.untyped_storage(), self.default)
        if buffer.writer is not None and not _after(stream, buffer.writer):
            hazard = "a reload read a host buffer before its offload filled it"
        buffer.readers.append((stream, position))
        out = self._storages.get(dst.untyped_storage()._cdata)
        if out is not None:
            # Allocated on a side stream; the default stream's reloads need no record, as
            # nothing copies a reload again before compute waited for it.
            out.writer = (stream, position)
            out.readers = []
        return hazard

    def _queue(
        self,
        stream: SimStream,
        src: torch.Tensor,
        dst: torch.Tensor,
        hazard: str | None,
        *,
        to_host: bool,
    ) -> None:
        if self.clock is not None:
            self.clock.copy(stream, src.nbytes, to_host=to_host)
        if not stream.queue and not self.lag:
            # Nothing before it on its stream, no lag: the device executes it now (and no
            # other stream waits for it yet, as no event was recorded after it).
            self._execute(stream, _Copy(src, dst, self.now, stream.issued, hazard))
            return
        # Queued, the copy may outlive the forward: it keeps the bytes, not the graph.
        src = self._own(src.detach)
        stream.queue.append(_Copy(src, dst, self.now + self.lag, stream.issued, hazard))
        self._advance()

    def _advance(self) -> None:
        """Execute, stream by stream, every item that is due and whose waits completed."""
        progressed = True
        while progressed:
            progressed = False
            for stream in self._copy_streams:
                queue = stream.queue
                while queue:
                    item = queue[0]
                    if isinstance(item, _Wait):
                        if item.stream.done < item.until:
                            break
                        queue.popleft()
                        stream.done = item.position
                    else:
                        if item.due > self.now:
                            break
                        queue.popleft()
                        self._execute(stream, item)
                    progressed = True

    def _force(self, stream: SimStream, position: int) -> None:
        """Complete ``stream`` up to ``position`` now, and what its items wait for."""
        while stream.done < position:
            item = stream.queue.popleft()
            if isinstance(item, _Wait):
                self._force(item.stream, item.until)
                stream.done = item.position
            else:
                self._execute(stream, item)

    def _execute(self, stream: SimStream, copy: _Copy) -> None:
        src, dst = copy.src, copy.dst
        assert src is not None and dst is not None
        copy.src = copy.dst = None
        if copy.hazard is not None:
            raise HazardError(copy.hazard)
        self._own(dst.copy_, src)
        stream.done = copy.position

    # -- capture and clock ------------------------------------------------------------

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False

    def start_clock(self, base_bytes: int) -> Clock:
        assert self.profile is not None
        if self.clock is not None:
            raise SwapStateError(
                "this SimulatedAccelerator is clocking a step already; end that"
                " accelerator.clock() block before starting another"
            )
        self.epoch += 1
        for stream in self._streams:
            stream.busy_until = 0.0
        self.clock = Clock(self, self.profile, base_bytes)
        return self.clock

    def stop_clock(self) -> None:
        clock = self.clock
        assert clock is not None
        self.clock = None
        clock.tape.close()
        clock.timeline.step_seconds = max(stream.busy_until for stream in self._streams)


def _illegal(what: str) -> None:
    raise HazardError(f"{what} while the current stream captures a graph")


class Clock:
    """One clocked step: the tape's listener, and the timeline it fills.

    ``label(name)`` names what runs next (``step_labels`` names the layers; the caller
    names the rest, e.g. ``optimizer``). ``timeline`` is complete once the step ends.
    """

    def __init__(self, device: SimDevice, profile: DeviceProfile, base_bytes: int) -> None:
        self._device = device
        """The device whose streams the clock advances."""
        self._d2h_bps = profile.d2h_gbps * 1e9
        """Device-to-host bytes per second."""
        self._h2d_bps = profile.h2d_gbps * 1e9
        """Host-to-device bytes per second."""
        self.tape = OpTape("cpu", profile, self)
        """Times the model's operators and tracks its storages."""
        self.timeline = StepTimeline(base_bytes=base_bytes, peak_bytes=base_bytes)
        self._bytes = base_bytes
        """Device memory held now."""

    def label(self, name: str) -> None:
        self.tape.label = name

    def on_op(self, cost: OpCost | None, seconds: float) -> None:
        self._device.current.busy_until += seconds
        self.timeline.compute_seconds += seconds

    def on_alloc(self, key: int, nbytes: int) -> None:
        self._memory(nbytes)

    def on_free(self, key: int, nbytes: int) -> None:
        self._memory(-nbytes)

    def _memory(self, delta: int) -> None:
        if not delta:
            return
        self._bytes += delta
        now = self._device.current.busy_until
        timeline = self.timeline
        timeline.memory.append((now, self._bytes))
        if self._bytes > timeline.peak_bytes:
            timeline.peak_bytes = self._bytes
            timeline.peak_label = self.tape.label
            timeline.peak_seconds = now

    def copy(self, stream: SimStream, nbytes: int, *, to_host: bool) -> None:
        seconds = nbytes / (self._d2h_bps if to_host else self._h2d_bps)
        stream.busy_until += seconds
        if to_host:
            self.timeline.d2h_seconds += seconds
        else:
            self.timeline.h2d_seconds += seconds

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        if event.epoch != self._device.epoch:
            return
        idle = event.time - stream.busy_until
        if idle <= 0:
            return
        stream.busy_until = event.time
        if stream is self._device.current:
            stalls = self.timeline.stalls
            label = self.tape.label
            stalls[label] = stalls.get(label, 0.0) + idle
