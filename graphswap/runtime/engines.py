"""Copy engines: move whole storages between the compute device and host buffers.

Each copy returns a ticket. ``wait()`` blocks the *consumer* until the copy is
visible to it; the source of an offload is held by the ticket until the copy has
completed and released only then.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch


class Ticket(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> None: ...

    def synchronize(self) -> None: ...


class LoadTicket(Ticket, Protocol):
    def result(self) -> torch.Tensor: ...


class CopyEngine(Protocol):
    pin: bool

    def offload(self, src: torch.Tensor, host: torch.Tensor) -> Ticket: ...

    def load(self, host: torch.Tensor, after: Ticket, device: torch.device) -> LoadTicket: ...


class _FutureTicket:
    def __init__(self, future: Future[torch.Tensor]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()

    synchronize = wait

    def result(self) -> torch.Tensor:
        return self._future.result()


class CpuCopyEngine:
    """For CPU tensors: real copies on a worker thread.

    The copies run asynchronously on purpose, so that a consumer that forgets to
    wait reads an unfinished buffer in tests instead of passing by luck.
    """

    pin = False

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _submit(self, job: _CopyJob) -> _FutureTicket:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="graphswap-copy")
            return _FutureTicket(self._executor.submit(job.run))

    def offload(self, src: torch.Tensor, host: torch.Tensor) -> Ticket:
        return self._submit(_CopyJob(src, host))

    def load(self, host: torch.Tensor, after: Ticket, device: torch.device) -> LoadTicket:
        # One FIFO worker: the offload that filled ``host`` has finished before this runs.
        return self._submit(_CopyJob(host, torch.empty_like(host, device=device)))


class _CopyJob:
    """Holds the source only until the copy ran, so its memory is freed right after."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._src: torch.Tensor | None = src
        self._dst = dst

    def run(self) -> torch.Tensor:
        assert self._src is not None
        self._dst.copy_(self._src)
        self._src = None
        return self._dst


class _EventTicket:
    def __init__(
        self,
        event: torch.Event,
        *,
        hold: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> None:
        self._event = event
        self._hold = hold
        self._out = out

    def done(self) -> bool:
        if self._event.query():
            self._hold = None
            return True
        return False

    def wait(self) -> None:
        """Order the current (compute) stream after the copy; does not block the host."""
        torch.accelerator.current_stream(self._event.device).wait_event(self._event)

    def synchronize(self) -> None:
        self._event.synchronize()
        self._hold = None

    def result(self) -> torch.Tensor:
        assert self._out is not None
        return self._out


class AcceleratorCopyEngine:
    """For accelerator tensors: side streams for each direction, pinned host memory.

    Offload: the d2h stream waits for compute, copies, records an event; the source
    stays referenced until that event completed (polled), so the allocator cannot
    hand its memory to compute while the copy still reads it. Load: the destination
    is allocated on the compute stream, the h2d stream waits for compute (the block
    may have been used by queued kernels) and for the offload event, copies, records
    an event that the consumer's stream waits on before reading.
    """

    pin = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._d2h = torch.Stream(device=device)
        self._h2d = torch.Stream(device=device)

    def offload(self, src: torch.Tensor, host: torch.Tensor) -> Ticket:
        self._d2h.wait_stream(torch.accelerator.current_stream(self.device))
        with self._d2h:
            host.copy_(src, non_blocking=True)
        return _EventTicket(self._d2h.record_event(), hold=src)

    def load(self, host: torch.Tensor, after: Ticket, device: torch.device) -> LoadTicket:
        assert isinstance(after, _EventTicket)
        dst = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        self._h2d.wait_stream(torch.accelerator.current_stream(device))
        self._h2d.wait_event(after._event)
        with self._h2d:
            dst.copy_(host, non_blocking=True)
        return _EventTicket(self._h2d.record_event(), out=dst)
