"""One forward call's swap: pack decisions, offload, the lag fence, prefetch, load, release.

One of the four modules of the swap manager (``_manager.py`` lists them). Here: the
saved tensors of one forward call of one wrapped module (``_Forward``, which is also that
forward's pack hook: it decides at each pack whether a tensor stays or goes) and what
the manager does with them (``_ForwardOps``, a base of ``SwapManager``): copy a tensor
to host, fence offloads at module boundaries ``offload_lag`` forwards later, prefetch
the forwards before it when its backward begins, issue reloads. A handle's death frees
the source and the host buffer at the end (``_Swapped.__del__``).
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch

from graphswap.runtime._engines import AcceleratorCopyEngine, CopyEngine, NoOpAccelerator
from graphswap.runtime._handles import Kept, _Entry, _Swapped, layout_in
from graphswap.runtime._pool import TYPED_VIEWS, HostBuffer
from graphswap.runtime._slot import _bad_decision, _Slot
from graphswap.runtime._stats import GroupStats
from graphswap.runtime.policy import (
    CheckpointPolicy,
    _is_parameter,
    is_parameter_like,
    local_tensor,
)

if TYPE_CHECKING:
    from graphswap.runtime._manager import SwapManager

_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter
_STRIDED = torch.strided
_MUST_SWAP = CheckpointPolicy.MUST_SWAP
_MUST_SAVE = CheckpointPolicy.MUST_SAVE
"""Read once here, not looked up through their module at every pack."""


class _Forward:
    """The saved tensors of one forward call of one wrapped module, and its pack hook.

    The object itself is the pack hook autograd calls (``__call__``): no bound method or
    partial is made per forward, and nothing but the forward is kept from it to backward.
    """

    __slots__ = (
        "__weakref__",
        "entries",
        "keep",
        "manager",
        "prev",
        "protected",
        "queued",
        "saves",
        "seq",
        "slot",
        "stats",
        "task",
    )

    def __init__(
        self,
        manager: SwapManager,
        slot: _Slot,
        seq: int,
        stats: GroupStats,
        keep: bool,
        prev: _Forward | None,
    ) -> None:
        self.manager = manager  # the manager that recorded it: offloads, its lock, hooks
        self.slot = slot  # the wrapped module this forward ran
        self.seq = seq  # the manager's forward count when it opened: offload_lag's clock
        self.stats = stats  # the slot's stats, counted into by every pack and reload
        self.keep = keep  # the end of a linked chain (keep_last): nothing is swapped
        self.prev = prev
        """The forward its prev module ran last: the one this forward's backward prefetches."""
        self.protected: set[int] | None = None
        """Storages of the module's parameters and buffers, never swapped; found when the
        first tensor that may share one is about to be swapped: one without autograd
        history (a parameter or buffer, or what ``.detach()`` or ``.data`` made of one), a
        view, or one changed in place (a buffer updated under grad). Others are this
        step's activations, the usual case, and a forward that saves only them pays
        nothing; one that a module also holds (a buffer assigned an activation) swaps as
        any activation another reference keeps: counted as copied but not freed."""
        self.entries: dict[int, _Entry] = {}  # host copies, by storage key, in saving order
        self.queued = False  # in the manager's in-flight queue (``_in_flight``)
        self.saves = 0
        """Pack calls so far in this forward (parameters and aliases too)."""
        self.task = -1
        """The autograd graph task whose backward reached this forward last (-1: none)."""

    def __call__(self, t: torch.Tensor) -> Any:
        """The pack hook: keep ``t`` on device or swap it, as the policy decides."""
        index = self.saves
        self.saves = index + 1
        if type(t) is _TENSOR:  # the usual case: ``is_parameter_like(t)`` inline
            local = t
            base = t._base
            if (
                t.layout is not _STRIDED
                or t.is_meta
                or getattr(t, "_is_param", False)
                or (base is not None and (type(base) is _PARAMETER or _is_parameter(base)))
            ):
                return (t.detach(), t._version, self)
        else:
            local = local_tensor(t)
            if (
                type(local) is not _TENSOR
                or local.layout is not _STRIDED
                or local.is_meta
                or is_parameter_like(t)
            ):
                return (t.detach(), t._version, self)
            base = t._base
        storage = local.untyped_storage()
        key = storage._cdata
        version = t._version
        entry = self.entries.get(key)
        if entry is None or entry.buf is None:  # none, or every handle of its copy died
            slot = self.slot
            decide = slot.decide
            decision = slot.policy(t) if decide is None else decide(t, index)
            if decision is not _MUST_SWAP:
                if decision is not _MUST_SAVE:
                    raise _bad_decision(slot, decision)
                return (t.detach(), version, self)
            protected = self.protected
            if protected is None and (base is not None or version or t.is_leaf):
                protected = self.protected = _state_storages(slot.module)
            if protected is not None and key in protected:
                return (t.detach(), version, self)
            entry = self.manager._offload(self, local, storage)
            if entry is None:
                return (t.detach(), version, self)
            entry.version = version
            return _Swapped(self, entry, t, local, entry.first)
        if version != entry.version:
            return self.manager._keep_changed(self, t, entry)
        assert entry.host is not None  # a live handle's entry holds its host copy
        return _Swapped(self, entry, t, local, layout_in(local, entry.host))

    @property
    def name(self) -> str:
        return self.slot.name


def _state_storages(module: torch.nn.Module) -> set[int]:
    """Storages of the parameters and buffers of ``module`` and its submodules.

    Read from the modules' own tables on every forward (parameters may be replaced
    between forwards); ``Module.parameters()`` would also build every submodule's name.
    Like ``state_dict``, this assumes a tree without cycles; a shared submodule is
    simply read twice.
    """
    keys: set[int] = set()
    modules = [module]
    for m in modules:
        for table in (m._parameters, m._buffers):
            for t in table.values():
                if t is not None:
                    if type(t) is not torch.nn.Parameter and type(t) is not torch.Tensor:
                        t = local_tensor(t)
                    keys.add(t.untyped_storage()._cdata)
        for sub in m._modules.values():
            if sub is not None:
                modules.append(sub)
    return keys


class _ForwardOps:
    """What ``SwapManager`` does with the forwards it records, from offload to reload.

    A base of ``SwapManager`` (methods moved, not wrapped; the pack hook is the forward's
    record itself, ``_Forward.__call__``, which calls ``_offload`` here); the state it
    uses is ``SwapManager``'s, commented there.
    """

    def _first_engine(self, device: torch.device) -> tuple[CopyEngine, torch.device]:
        """The engine of a device met for the first time (one per device type), and the
        device object its entries name from now on (one per device: compared by identity)."""
        engine = self._engines.get(device.type)
        if engine is None:
            if self._engine_override is not None:
                engine = self._engine_override
            elif device.type == "cpu":
                engine = NoOpAccelerator()  # nothing to order: tests ask for the simulator
            else:
                engine = AcceleratorCopyEngine()
            self._engines[device.type] = engine
            self._sole_engine = engine if len(self._engines) == 1 else None
            self._capturing = self._capturing or engine.capturing()
        where = self._device_engines[device] = (engine, device)
        return where

    def _boundary(self, seq: int) -> None:
        """A module boundary: the one capture query until the next; the offloads since
        the last boundary are closed as a batch; offloads of forwards ``offload_lag``
        forwards back are fenced (their producing stream waits for the newest of them,
        which ends all before it) and their sources dropped; finished ones too."""
        sole = self._sole_engine
        if sole is not None:  # the usual case: the query and the tick in one call
            capturing = self._capturing = sole.boundary()
        else:
            engines = self._engines.values()
            capturing = False
            for engine in engines:
                if engine.capturing():  # every engine is asked: one query each per boundary
                    capturing = True
            self._capturing = capturing
            if not capturing:
                for engine in engines:
                    engine.tick()
        if capturing:
            return
        queue = self._in_flight
        if not queue:
            return
        limit = seq - self.offload_lag
        self._lock.acquire()  # not ``with``: it makes two bound methods a call
        try:
            newest = None
            for ref in queue:
                fwd = ref()
                if fwd is not None:
                    if fwd.seq > limit:
                        break
                    newest = fwd
            if newest is not None:
                next(reversed(newest.entries.values())).offload.fence()
            while queue:
                fwd = queue[0]()
                if fwd is not None:  # else its graph died, which released its sources
                    due = fwd.seq <= limit
                    for entry in fwd.entries.values():  # in order of first save
                        if not entry.released:
                            offload = entry.offload
                            if due:
                                offload.fence()  # ordered already, unless another producer
                            elif not offload.done():
                                return  # it and all after it stay until a later boundary
                            entry.released = True
                            entry.held = offload.release_source()
                    fwd.queued = False
                queue.popleft()
        finally:
            self._lock.release()

    def _release_source(self, entry: _Entry) -> None:
        """Drop the offload's device source (ordered already); one that another reference
        keeps on device is watched until its reload (``_Entry.held``)."""
        if entry.released:
            return
        entry.released = True
        entry.held = entry.offload.release_source()

    def _not_freed(self, entry: _Entry) -> None:
        """Another reference kept ``entry``'s source on device from its release until its
        reload was issued or its graph died (``_Entry.held``): count it as copied but not
        freed, and warn once."""
        entry.stats.offloaded_not_freed_bytes += entry.nbytes
        if not self._warned_not_freed:
            self._warned_not_freed = True
            warnings.warn(
                f"graphswap: {entry.nbytes:,} bytes that {entry.name!r} copied to host"
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

    def _keep_changed(self, fwd: _Forward, t: torch.Tensor, entry: _Entry) -> Kept:
        """A storage saved again after an in-place change since its copy was issued: that
        copy may hold either version, so this save keeps its own bytes on device."""
        with self._lock:
            stats = fwd.stats
            stats.kept_tensors += 1
            stats.kept_bytes += entry.nbytes
            stats.kept_changed += 1
        return (t.detach(), t._version, fwd)

    def _offload(
        self, fwd: _Forward, local: torch.Tensor, storage: torch.UntypedStorage
    ) -> _Entry | None:
        nbytes = storage.nbytes()
        device = local.device
        engine, device = self._device_engines.get(device) or self._first_engine(device)
        stats = fwd.stats
        lock = self._lock
        # One acquisition: the pool, the copy's issue and its records.
        lock.acquire()  # not ``with``: it makes two bound methods a call
        try:
            if fwd.keep or self._capturing:
                self._count_kept(stats, nbytes, "kept_last_layer" if fwd.keep else "kept_capturing")
                return None
            buf = self._pool.acquire(device, nbytes, engine)
            if type(buf) is not HostBuffer:  # a ``Refusal``
                self._count_kept(stats, nbytes, buf.value)
                return None
            dtype = local.dtype
            if (
                dtype in TYPED_VIEWS
                and local.storage_offset() == 0
                and local.nbytes == nbytes
                and local.is_contiguous()
            ):
                src = local
                size = local.size()
                host = buf.view(dtype, size, nbytes)
                stride = local.stride()  # a size-1 dimension may have any stride
                first = None if stride == host.stride() else (0, dtype, size, stride)
            else:
                src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
                host = buf.view(torch.uint8, src.size(), nbytes)
                first = layout_in(local, host)
            copy = engine.offload(src, host, buf.last_use)
            entry = _Entry(
                self, fwd.slot.name, stats, device, engine, nbytes, buf, host, copy, first
            )  # ``device``: the one object of its device (``_first_engine``)
            fwd.entries[storage._cdata] = entry
            if not fwd.queued:
                fwd.queued = True
                self._in_flight.append(weakref.ref(fwd))  # ``_latest``'s: no new object
            stats.offloaded_tensors += 1
            stats.offloaded_bytes += nbytes
        finally:
            lock.release()
        return entry

    @staticmethod
    def _count_kept(stats: GroupStats, nbytes: int, reason: str) -> None:
        """A tensor the policy chose to swap stays on device, for ``reason`` (a field of
        ``stats``); called under the manager's lock."""
        stats.kept_tensors += 1
        stats.kept_bytes += nbytes
        setattr(stats, reason, getattr(stats, reason) + 1)

    def _prefetch(self, fwd: _Forward) -> None:
        """Reload ``fwd``'s swapped storages as one batch, first needed first: backward
        consumes them in reverse saving order, and each waits only for its own copy."""
        if not fwd.entries:
            return
        self._lock.acquire()  # not ``with``: it makes two bound methods a call
        try:
            due = [
                entry
                for entry in reversed(fwd.entries.values())
                if entry.load is None and entry.buf is not None and entry.refs
            ]
            if due:
                self._load(due, prefetched=True)
        finally:
            self._lock.release()

    def _load(self, entries: list[_Entry], *, prefetched: bool) -> None:
        """Issue the reloads of ``entries``, all of one forward (per device, one batch),
        for the live handles that have not consumed one; ``prefetched``: ahead of their
        first unpack."""
        first = entries[0]
        engine, device = first.engine, first.device  # one object per device: ``is``
        batch = entries
        if len(self._device_engines) > 1:  # entries of several devices: a batch each
            for entry in entries:
                if entry.engine is not engine or entry.device is not device:
                    batch = [e for e in entries if e.engine is engine and e.device is device]
                    self._load([e for e in entries if e not in batch], prefetched=prefetched)
                    break
        loads = engine.loads(device, [(entry.host, (entry.offload,)) for entry in batch])
        nbytes = 0
        for entry, load in zip(batch, loads, strict=True):
            entry.load = load
            entry.gen += 1
            entry.waiting = entry.refs
            entry.prefetched = prefetched
            nbytes += entry.nbytes
            held = entry.held
            if held is not None:
                entry.held = None
                if held() is not None:
                    self._not_freed(entry)
        stats = first.stats  # the forward's
        stats.reloaded_tensors += len(batch)
        stats.reloaded_bytes += nbytes
