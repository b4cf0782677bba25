"""SwapManager: per-forward swap groups, layer-to-layer prefetch, host-buffer lifetimes.

Lifetimes follow autograd's own: a packed handle lives exactly as long as the
saved-tensor slot that holds it. When the last handle of a copied storage dies
(the graph was freed after backward, or a forward raised), the host buffer goes
back to the pool. Nothing is kept per step, so memory is flat across steps.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from graphswap.policy import CheckpointPolicy, SwapPolicy, is_parameter_like, policy_name
from graphswap.runtime.engines import (
    AcceleratorCopyEngine,
    CopyEngine,
    CpuCopyEngine,
    LoadTicket,
    Ticket,
)
from graphswap.runtime.pool import HostPool
from graphswap.runtime.stats import GroupStats, SwapStats

TRACE_LIMIT = 100_000


class SwapIntegrityError(RuntimeError):
    """A tensor saved for backward changed after it was packed: its gradient would be wrong."""


@dataclass(frozen=True)
class GroupInfo:
    """What the prefetch graph needs to know about one wrapped module."""

    name: str
    index: int
    module_type: str
    policy: str
    keep_on_device: bool


@dataclass
class _Slot:
    module: torch.nn.Module
    name: str
    index: int
    policy: SwapPolicy
    module_type: str


class _Entry:
    """One storage copied to host: shared by every handle that aliases it."""

    __slots__ = (
        "device",
        "host",
        "load",
        "manager",
        "name",
        "nbytes",
        "offload",
        "refs",
        "storage_ref",
        "unpacked",
    )

    def __init__(
        self, manager: SwapManager, name: str, storage: torch.UntypedStorage, host: torch.Tensor
    ) -> None:
        self.manager = manager
        self.name = name
        self.device = storage.device
        self.nbytes = storage.nbytes()
        self.host: torch.Tensor | None = host
        self.storage_ref = StorageWeakRef(storage)
        self.offload: Ticket | None = None
        self.load: LoadTicket | None = None
        self.refs = 0
        self.unpacked = 0


class _Packed:
    """What autograd stores instead of a swapped tensor."""

    __slots__ = ("dtype", "entry", "offset", "size", "source", "stride", "version")

    def __init__(self, entry: _Entry, t: torch.Tensor) -> None:
        self.entry = entry
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.version = t._version
        self.source = weakref.ref(t)
        entry.refs += 1

    def __del__(self) -> None:
        entry = self.entry
        entry.refs -= 1
        if entry.refs == 0:
            entry.manager._release(entry)


class _Group:
    """The saved tensors of one forward call of one wrapped module."""

    def __init__(
        self, slot: _Slot, *, keep: bool, prev: _Group | None, protected: set[int]
    ) -> None:
        self.slot = slot
        self.keep = keep
        self.prev = prev
        """The group its prev module opened last: the one this group's backward prefetches."""
        self.protected = protected
        """Storages of the module's parameters and buffers: never swapped."""
        self.entries: dict[int, _Entry] = {}

    @property
    def name(self) -> str:
        return self.slot.name


def _default_max_host_bytes() -> int:
    """Half of physical memory: enough for any layer stack that fits on a GPU."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


class SwapManager:
    """Owns the swap groups of one model: links, copy engines, host pool, stats.

    ``prefetch_depth``: how many earlier layers start coming back when a layer's
    backward begins. ``keep_last``: the end of a linked chain keeps its tensors on
    device, since its backward starts right after forward. ``max_host_bytes``:
    cap of the host pool (default: half of physical memory); past it tensors stay
    on device and ``pool_exhausted`` counts them. ``trace``: record events.

    Every forward of a wrapped module opens its own group, linked to the group its
    prev module opened last, so several forwards before one backward (gradient
    accumulation with all graphs alive) prefetch within their own pass.
    """

    def __init__(
        self,
        *,
        prefetch_depth: int = 1,
        keep_last: bool = True,
        max_host_bytes: int | None = None,
        trace: bool = False,
    ) -> None:
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        self.prefetch_depth = prefetch_depth
        self.keep_last = keep_last
        self._pool = HostPool(
            _default_max_host_bytes() if max_host_bytes is None else max_host_bytes
        )
        self._slots: dict[torch.nn.Module, _Slot] = {}
        self._registered = 0
        self._prev: dict[torch.nn.Module, torch.nn.Module] = {}
        self._next: dict[torch.nn.Module, torch.nn.Module] = {}
        self._latest: dict[torch.nn.Module, _Group] = {}
        self._engines: dict[torch.device, CopyEngine] = {}
        self._pending: collections.deque[_Entry] = collections.deque()
        self._stats: dict[str, GroupStats] = {}
        self._lock = threading.RLock()
        self.events: collections.deque[tuple[str, str]] | None = (
            collections.deque(maxlen=TRACE_LIMIT) if trace else None
        )

    def register(self, module: torch.nn.Module, name: str | None, policy: SwapPolicy) -> None:
        """Called by ``swap_wrapper``; ``name`` defaults to the class name and a counter."""
        cls = type(module)
        name = name or f"{cls.__name__}_{self._registered}"
        if module in self._slots:
            raise ValueError(f"module {name!r} is already registered with this SwapManager")
        if any(slot.name == name for slot in self._slots.values()):
            raise ValueError(f"a module named {name!r} is already registered; pass a unique name")
        self._slots[module] = _Slot(
            module, name, self._registered, policy, f"{cls.__module__}.{cls.__qualname__}"
        )
        self._registered += 1
        self._stats[name] = GroupStats()

    def unregister(self, module: torch.nn.Module) -> None:
        slot = self._slots.pop(module)
        for a, b in list(self._next.items()):
            if module in (a, b):
                del self._next[a], self._prev[b]
        self._latest.pop(module, None)
        del self._stats[slot.name]

    def set_forward_prefetch_layer(self, prev: torch.nn.Module, next: torch.nn.Module) -> None:
        """When the backward of ``next`` begins, ``prev``'s tensors start coming back."""
        for role, module in (("prev", prev), ("next", next)):
            if module not in self._slots:
                raise ValueError(
                    f"{role} module {type(module).__name__} is not swap-wrapped by this manager;"
                    " call swap_wrapper(module, manager=manager) first"
                )
        if prev is next:
            raise ValueError("a module cannot prefetch itself")
        if prev in self._next or next in self._prev:
            taken = self._slots[prev if prev in self._next else next].name
            raise ValueError(f"{taken!r} is already linked; each module has one prev and one next")
        walk: torch.nn.Module | None = prev
        while walk is not None:
            if walk is next:
                raise ValueError("this link would close a cycle in the prefetch chain")
            walk = self._prev.get(walk)
        self._next[prev] = next
        self._prev[next] = prev

    @property
    def links(self) -> list[tuple[str, str]]:
        order = sorted(self._next.items(), key=lambda kv: self._slots[kv[0]].index)
        return [(self._slots[a].name, self._slots[b].name) for a, b in order]

    def is_kept(self, module: torch.nn.Module) -> bool:
        return self.keep_last and module in self._prev and module not in self._next

    def groups(self) -> list[GroupInfo]:
        return [
            GroupInfo(
                slot.name, slot.index, slot.module_type, policy_name(slot.policy), self.is_kept(m)
            )
            for m, slot in self._slots.items()
        ]

    def prefetch_schedule(self) -> list[tuple[str, str]]:
        """(trigger, target) pairs, each swapped target once, in backward order.

        A target is reloaded by the first backward that reaches it: the furthest
        layer after it within ``prefetch_depth`` links.
        """
        pairs = []
        for target, slot in self._slots.items():
            if self.is_kept(target) or target not in self._next:
                continue
            trigger = target
            for _ in range(self.prefetch_depth):
                if trigger not in self._next:
                    break
                trigger = self._next[trigger]
            pairs.append((self._slots[trigger].index, slot.index, trigger, target))
        pairs.sort(key=lambda p: (-p[0], -p[1]))
        return [(self._slots[t].name, self._slots[g].name) for _, _, t, g in pairs]

    @property
    def stats(self) -> SwapStats:
        with self._lock:
            snapshot = SwapStats(
                peak_host_bytes=self._pool.peak_in_use_bytes,
                host_reserved_bytes=self._pool.reserved_bytes,
                host_in_use_bytes=self._pool.in_use_bytes,
                per_group={k: dataclasses.replace(v) for k, v in self._stats.items()},
            )
        for group_stats in snapshot.per_group.values():
            snapshot.add(group_stats)
        return snapshot

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = {name: GroupStats() for name in self._stats}
            self._pool.peak_in_use_bytes = self._pool.in_use_bytes

    def synchronize(self) -> None:
        """Wait for every offload in flight; their sources are freed when this returns."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                entry = self._pending.popleft()
            if entry.offload is not None:
                entry.offload.synchronize()

    def run_forward(
        self, module: torch.nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any:
        """Run ``forward`` of a wrapped module under this manager's saved-tensor hooks."""
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        prev = self._prev.get(module)
        group = _Group(
            self._slots[module],
            keep=self.is_kept(module),
            prev=self._latest.get(prev) if prev is not None else None,
            protected={
                t.untyped_storage()._cdata for t in (*module.parameters(), *module.buffers())
            },
        )
        self._latest[module] = group
        self._poll()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(group, t), self._unpack):
            out = forward(*args, **kwargs)
        for engine in list(self._engines.values()):
            engine.progress()
        self._poll()
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda _grad: self._backward_begins(group), mode="any"
            )
        return out

    def _trace(self, event: str, group: _Group) -> None:
        if self.events is not None:
            self.events.append((event, group.name))

    def _engine(self, device: torch.device) -> CopyEngine:
        engine = self._engines.get(device)
        if engine is None:
            engine = CpuCopyEngine() if device.type == "cpu" else AcceleratorCopyEngine(device)
            self._engines[device] = engine
        return engine

    def _pack(self, group: _Group, t: torch.Tensor) -> Any:
        if type(t) is not torch.Tensor or t.device.type == "meta" or t.layout is not torch.strided:
            return t
        storage = t.untyped_storage()
        key = storage._cdata
        if key in group.protected or is_parameter_like(t):
            return t
        entry = group.entries.get(key)
        if entry is None:
            if group.slot.policy(t) is not CheckpointPolicy.MUST_SWAP:
                return t
            entry = None if group.keep else self._offload(group, storage, t.device)
            if entry is None:
                with self._lock:
                    stats = self._stats[group.name]
                    stats.kept_tensors += 1
                    stats.kept_bytes += storage.nbytes()
                    stats.pool_exhausted += not group.keep
                return t
        return _Packed(entry, t)

    def _offload(
        self, group: _Group, storage: torch.UntypedStorage, device: torch.device
    ) -> _Entry | None:
        self._poll()
        engine = self._engine(device)
        host = self._pool.acquire(storage.nbytes(), pin=engine.pin)
        if host is None:
            return None
        entry = _Entry(self, group.name, storage, host)
        src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        entry.offload = engine.offload(src, host)
        group.entries[storage._cdata] = entry
        with self._lock:
            self._pending.append(entry)
            stats = self._stats[group.name]
            stats.offloaded_tensors += 1
            stats.offloaded_bytes += entry.nbytes
        self._trace("offload", group)
        return entry

    def _poll(self) -> None:
        """Drop the sources of finished offloads so their device memory is freed."""
        with self._lock:
            while self._pending and (
                self._pending[0].offload is None or self._pending[0].offload.done()
            ):
                self._pending.popleft()

    def _backward_begins(self, group: _Group) -> None:
        self._trace("backward_begin", group)
        self._poll()
        target = group.prev
        for _ in range(self.prefetch_depth):
            if target is None:
                break
            self._prefetch(target)
            target = target.prev

    def _prefetch(self, group: _Group) -> None:
        issued = False
        with self._lock:
            for entry in group.entries.values():
                if entry.load is None and entry.host is not None:
                    self._load(entry)
                    issued = True
        if issued:
            self._trace("prefetch", group)

    def _load(self, entry: _Entry) -> None:
        assert entry.host is not None and entry.offload is not None
        entry.load = self._engine(entry.device).load(entry.host, entry.offload, entry.device)
        entry.unpacked = 0
        stats = self._stats[entry.name]
        stats.reloaded_tensors += 1
        stats.reloaded_bytes += entry.nbytes

    def _unpack(self, packed: Any) -> Any:
        if not isinstance(packed, _Packed):
            return packed
        entry = packed.entry
        source = packed.source()
        if source is not None and source._version != packed.version:
            raise SwapIntegrityError(
                f"a tensor of shape {tuple(packed.size)} saved for backward by {entry.name!r}"
                " was modified by an in-place operation after it was swapped out; clone it"
                " before modifying it, or exclude it from the swap policy"
            )
        with self._lock:
            if entry.load is None:
                self._stats[entry.name].prefetch_misses += 1
                self._load(entry)
            elif entry.unpacked == 0:
                self._stats[entry.name].prefetch_hits += 1
            load = entry.load
            entry.unpacked += 1
            if entry.unpacked >= entry.refs:
                entry.load = None
        if self.events is not None:
            self.events.append(("unpack", entry.name))
        load.wait()
        out = torch.empty(0, dtype=packed.dtype, device=entry.device)
        return out.set_(load.result().untyped_storage(), packed.offset, packed.size, packed.stride)

    def _release(self, entry: _Entry) -> None:
        """The last handle died: wait for copies touching the buffer, then pool it."""
        host, entry.host = entry.host, None
        if host is None:
            return
        for ticket in (entry.offload, entry.load):
            if ticket is not None:
                ticket.synchronize()
        entry.load = None
        self._pool.release(host)
