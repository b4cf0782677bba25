"""The run-time state every forward of one manager shares, and the module boundary.

One of the runtime's objects (``_manager.py`` lists them): ``_Context`` holds what
the forwards (``_forward._Forward``) and the handles (``_handles``) of one
``SwapManager`` share, the copy engines, the host pool, the offloads in flight, the
lock and the capture flag, and runs the module boundary, where offloads are fenced
``swap_offload_lag`` forwards later and their sources dropped. It knows forwards only as
``InFlight`` (what a boundary asks of one), so it imports neither of their modules.
"""

from __future__ import annotations

import collections
import threading
import warnings
import weakref
from typing import Protocol

import torch

from graphswap.runtime._engines import AcceleratorCopyEngine, CopyEngine, NoOpAccelerator
from graphswap.runtime._pool import HostPool
from graphswap.runtime._stats import GroupStats


class InFlight(Protocol):
    """A forward with offloads whose device sources may still be held
    (``_forward._Forward``): what a module boundary and ``synchronize`` ask of it."""

    @property
    def seq(self) -> int:
        """The manager's forward count when it opened: ``swap_offload_lag``'s clock."""

    def fence_newest(self) -> None:
        """Order the producing stream after its newest offload (and all before it)."""

    def release(self, due: bool) -> bool:
        """Drop the sources of its offloads (fenced first when ``due``); False when one
        is still in flight and not ``due``."""

    def synchronize(self) -> None:
        """Block until its offloads completed, and drop their sources."""


class _Context:
    """What one manager's forwards and handles share; the manager owns one.

    Guarded by ``lock`` where a hook changes it (the pool, the in-flight queue, an
    entry's copies, the stats); the capture flag and the engine tables are written at
    module boundaries and at a device's first offload only.
    """

    __slots__ = (
        "capturing",
        "device_engines",
        "engine_override",
        "engines",
        "in_flight",
        "lock",
        "pool",
        "seq",
        "sole_engine",
        "swap_offload_lag",
        "swap_prefetch_depth",
        "warned_not_freed",
    )

    def __init__(
        self,
        pool: HostPool,
        engine: CopyEngine | None,
        swap_prefetch_depth: int,
        swap_offload_lag: int,
    ) -> None:
        self.pool = pool  # pinned host buffers the offloads copy into, capped
        self.engine_override = engine  # the manager's ``engine`` option; None: each device's own
        self.swap_prefetch_depth = swap_prefetch_depth  # earlier forwards a backward begin reloads
        self.swap_offload_lag = swap_offload_lag  # forwards after which an offload is fenced
        self.engines: dict[str, CopyEngine] = {}  # the copy engine per device type met
        self.sole_engine: CopyEngine | None = None  # the one engine, while only one was met
        # Per device met, its engine and the one device object its entries name.
        self.device_engines: dict[torch.device, tuple[CopyEngine, torch.device]] = {}
        self.in_flight: collections.deque[weakref.ref[InFlight]] = collections.deque()
        """Forwards with offloads whose source may still be held (an entry not
        ``released``), in the order of their first offload (dead once its graph died,
        which released the sources)."""
        self.capturing = False
        """What the capture query of the last module boundary answered: every call
        until the next boundary goes by it (one query per boundary, not per tensor)."""
        self.warned_not_freed = False  # the copied-but-not-freed warning was given
        self.seq = 0  # forwards run so far under the hooks: the last forward's ``seq``
        self.lock = threading.RLock()  # guards stats, the pool, the in-flight queue, entries

    def first_engine(self, device: torch.device) -> tuple[CopyEngine, torch.device]:
        """The engine of a device met for the first time (one per device type), and the
        device object its entries name from now on (one per device: compared by identity)."""
        engine = self.engines.get(device.type)
        if engine is None:
            if self.engine_override is not None:
                engine = self.engine_override
            elif device.type == "cpu":
                engine = NoOpAccelerator()  # nothing to order: tests ask for the simulator
            else:
                engine = AcceleratorCopyEngine()
            self.engines[device.type] = engine
            self.sole_engine = engine if len(self.engines) == 1 else None
            self.capturing = self.capturing or engine.capturing()
        where = self.device_engines[device] = (engine, device)
        return where

    def boundary(self, seq: int) -> None:
        """A module boundary: the one capture query until the next; the offloads since
        the last boundary are closed as a batch; offloads of forwards ``swap_offload_lag``
        forwards back are fenced (their producing stream waits for the newest of them,
        which ends all before it) and their sources dropped; finished ones too."""
        sole = self.sole_engine
        if sole is not None:  # the usual case: the query and the tick in one call
            capturing = self.capturing = sole.boundary()
        else:
            engines = self.engines.values()
            capturing = False
            for engine in engines:
                if engine.capturing():  # every engine is asked: one query each per boundary
                    capturing = True
            self.capturing = capturing
            if not capturing:
                for engine in engines:
                    engine.tick()
        if capturing:
            return
        queue = self.in_flight
        if not queue:
            return
        limit = seq - self.swap_offload_lag
        self.lock.acquire()  # not ``with``: it makes two bound methods a call
        try:
            newest = None
            for ref in queue:
                fwd = ref()
                if fwd is not None:
                    if fwd.seq > limit:
                        break
                    newest = fwd
            if newest is not None:
                newest.fence_newest()
            while queue:
                fwd = queue[0]()
                # None: its graph died, which released its sources. False: it and all
                # after it stay until a later boundary.
                if fwd is not None and not fwd.release(fwd.seq <= limit):
                    return
                queue.popleft()
        finally:
            self.lock.release()

    def synchronize(self) -> None:
        """Block until every offload in flight completed, and free their sources."""
        with self.lock:
            forwards = [ref() for ref in self.in_flight]
            self.in_flight.clear()
            for fwd in forwards:
                if fwd is not None:
                    fwd.synchronize()

    def not_freed(self, stats: GroupStats, nbytes: int, name: str) -> None:
        """Another reference kept ``nbytes`` that ``name`` offloaded on device from their
        release until their reload was issued or their graph died: count them as copied
        but not freed, and warn once (I12)."""
        stats.offloaded_not_freed_bytes += nbytes
        if not self.warned_not_freed:
            self.warned_not_freed = True
            warnings.warn(
                f"graphswap: {nbytes:,} bytes that {name!r} copied to host"
                " stayed on device until backward: another reference holds the tensor, so the"
                " copy frees nothing (counted in stats.offloaded_not_freed_bytes). Likely"
                " holders: a key/value cache the model returns (pass use_cache=False, which"
                " graphswap.rewrite sets in train mode for Hugging Face models), autocast's"
                " weight cache (torch.autocast(..., cache_enabled=False)),"
                " output_attentions=True or output_hidden_states=True, or a tensor your code"
                " keeps until backward",
                RuntimeWarning,
                stacklevel=2,
            )
