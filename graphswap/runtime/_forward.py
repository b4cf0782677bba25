"""One forward call of a wrapped module: its pack hook, offloads, release, prefetch.

One of the runtime's objects (``_manager.py`` lists them). Here: the saved tensors of
one forward call of one wrapped module (``_Forward``, which is also that forward's pack
hook: it decides at each pack whether a tensor stays or goes) and what it does with
them: copy a tensor to host, release the sources once fenced (the module boundary,
``_context._Context.boundary``, tells it when), prefetch the forwards before it when
its backward begins, refuse what may not run then. A handle's death frees the source
and the host buffer at the end (``_handles._Swapped.__del__``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from graphswap.errors import SwapExclusionError
from graphswap.runtime._context import _Context
from graphswap.runtime._group import _bad_decision, _Group
from graphswap.runtime._handles import (
    Kept,
    Layout,
    _Entry,
    _ForeignEntry,
    _Swapped,
    layout_in,
    reload,
)
from graphswap.runtime._pool import TYPED_VIEWS, Refusal
from graphswap.runtime._stats import GroupStats
from graphswap.runtime.policy import (
    CheckpointPolicy,
    _is_parameter,
    is_parameter_like,
    local_tensor,
)

_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter
_STRIDED = torch.strided
_MUST_SWAP = CheckpointPolicy.MUST_SWAP
_MUST_SAVE = CheckpointPolicy.MUST_SAVE
"""Read once here, not looked up through their module at every pack."""


class _Forward(dict[int, _Entry]):
    """The saved tensors of one forward call of one wrapped module, and its pack hook.

    The object itself is the pack hook autograd calls (``__call__``): no bound method or
    partial is made per forward, and nothing but the forward is kept from it to backward.
    It owns its offloads from the pack to their release; the handles own their unpack.

    It is also the mapping of its offloads (a ``dict``: host copies by storage key, in
    saving order), so that a forward costs one object, not two. Compared and hashed by
    identity; its truth is the dict's (whether it offloaded anything): test ``is None``.
    """

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__  # type: ignore[assignment]

    __slots__ = (
        "__weakref__",
        "ctx",
        "group",
        "keep",
        "prev",
        "protected",
        "queued",
        "saves",
        "seq",
        "stats",
        "task",
    )

    def __init__(
        self,
        ctx: _Context,
        group: _Group,
        seq: int,
        stats: GroupStats,
        keep: bool,
        prev: _Forward | None,
    ) -> None:
        self.ctx = ctx  # the manager's shared state: engines, pool, lock, in-flight queue
        self.group = group  # the wrapped module this forward ran
        self.seq = seq  # the manager's forward count when it opened: swap_offload_lag's clock
        self.stats = stats  # the group's stats, counted into by every pack and reload
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
        self.queued = False  # in the context's in-flight queue (``_Context.in_flight``)
        self.saves = 0
        """Pack calls so far in this forward (parameters and aliases too)."""
        self.task = -1
        """The autograd graph task whose backward reached this forward last (-1: none)."""

    def __call__(self, t: torch.Tensor) -> Kept | _Swapped:
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
        entry = self.get(key)
        if entry is None or entry.buf is None:  # none, or every handle of its copy died
            group = self.group
            decide = group.decide
            decision = group.policy(t) if decide is None else decide(t, index)
            if decision is not _MUST_SWAP:
                if decision is not _MUST_SAVE:
                    raise _bad_decision(group, decision)
                return (t.detach(), version, self)
            protected = self.protected
            if protected is None and (base is not None or version or t.is_leaf):
                protected = self.protected = _state_storages(group.module)
            if protected is not None and key in protected:
                return (t.detach(), version, self)
            entry = self.offload(local, storage, key)
            if entry is None:
                return (t.detach(), version, self)
            entry.version = version
            return _Swapped(self, entry, t, local, entry.first)
        if version != entry.version:
            return self.keep_changed(t, entry)
        assert entry.host is not None  # a live handle's entry holds its host copy
        return _Swapped(self, entry, t, local, layout_in(local, entry.host))

    @property
    def name(self) -> str:
        return self.group.name

    def offload(
        self, local: torch.Tensor, storage: torch.UntypedStorage, key: int
    ) -> _Entry | None:
        """Copy ``storage`` (``local``'s, keyed ``key``) to a pooled host buffer; None when
        it stays on device (the kept last layer, a capture, a full pool), counted by reason."""
        nbytes = storage.nbytes()
        ctx = self.ctx
        device = local.device
        engine, device = ctx.device_engines.get(device) or ctx.first_engine(device)
        stats = self.stats
        lock = ctx.lock
        # One acquisition: the pool, the copy's issue and its records.
        lock.acquire()  # not ``with``: it makes two bound methods a call
        try:
            if self.keep or ctx.capturing:
                _count_kept(stats, nbytes, "kept_last_layer" if self.keep else "kept_capturing")
                return None
            buf = ctx.pool.acquire(device, nbytes, engine)
            if isinstance(buf, Refusal):
                _count_kept(stats, nbytes, buf.value)
                return None
            dtype = local.dtype
            first: Layout | None = None
            src: torch.Tensor | None = None  # ``local`` when it covers its storage contiguously
            if dtype in TYPED_VIEWS and local.storage_offset() == 0 and local.nbytes == nbytes:
                size = local.size()
                host = buf.view(dtype, size, nbytes)
                stride = local.stride()
                # Laid out as ``host`` (so contiguous, the usual case: no call to ask), or
                # contiguous with another stride on a size-1 dimension.
                if stride == buf.view_stride:
                    src = local
                elif local.is_contiguous():
                    src = local
                    first = (0, dtype, size, stride)
            if src is None:
                src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
                host = buf.view(torch.uint8, src.size(), nbytes)
                first = layout_in(local, host)
            # ``device``: the one object of its device (``_Context.first_engine``).
            if engine._fills_records:  # the built-in engine: the entry is the offload's record
                entry = _Entry(
                    ctx, self.group.name, stats, device, engine, nbytes, buf, host, first
                )
                engine._offload_into(  # type: ignore[attr-defined]
                    entry, src, host, buf.last_use, nbytes, device, storage
                )
            else:
                entry = _ForeignEntry(
                    ctx,
                    self.group.name,
                    stats,
                    device,
                    engine,
                    nbytes,
                    buf,
                    host,
                    first,
                    foreign=engine.offload(src, host, buf.last_use),
                )
            self[key] = entry
            if not self.queued:
                self.queued = True
                ctx.in_flight.append(weakref.ref(self))  # ``_latest``'s: no new object
            stats.offloaded_tensors += 1
            stats.offloaded_bytes += nbytes
        finally:
            lock.release()
        return entry

    def keep_changed(self, t: torch.Tensor, entry: _Entry) -> Kept:
        """A storage saved again after an in-place change since its copy was issued: that
        copy may hold either version, so this save keeps its own bytes on device (I7)."""
        with self.ctx.lock:
            stats = self.stats
            stats.kept_tensors += 1
            stats.kept_bytes += entry.nbytes
            stats.kept_changed += 1
        return (t.detach(), t._version, self)

    def fence_newest(self) -> None:
        """Order the producing stream after this forward's newest offload, which ends
        every earlier one of its copy stream: one wait for the whole lag fence."""
        next(reversed(self.values())).fence()

    def release(self, due: bool) -> bool:
        """Drop the device sources of this forward's offloads, in saving order: fenced
        first when ``due`` (``swap_offload_lag`` forwards later), else those done only; False
        at the first still in flight, which waits for a later boundary. A source another
        reference keeps is watched until its reload (``_Entry.held``, I12)."""
        for entry in self.values():
            if not entry.released:
                if due:
                    entry.fence()  # ordered already, unless another producer
                elif not entry.done():
                    return False
                entry.released = True
                entry.held = entry.release_source()
        self.queued = False
        return True

    def synchronize(self) -> None:
        """Block until this forward's offloads completed, and drop their sources."""
        for entry in self.values():
            if not entry.released:
                entry.synchronize()
                entry.released = True
                entry.held = entry.release_source()
        self.queued = False

    def prefetch(self) -> None:
        """Reload this forward's swapped storages as one batch, first needed first:
        backward consumes them in reverse saving order, and each waits only for its
        own copy (a small one: for its group's, ``_engines.GROUP_BYTES``)."""
        if not self:
            return
        lock = self.ctx.lock
        lock.acquire()  # not ``with``: it makes two bound methods a call
        try:
            due = [
                entry
                for entry in reversed(self.values())
                if entry.reload is None and entry.buf is not None and entry.refs
            ]
            if due:
                reload(due, prefetched=True)
        finally:
            lock.release()

    def reload_missed(self, entry: _Entry) -> int:
        """An unpack found no reload of ``entry`` issued (no prefetch reached this forward):
        reload it first and this forward's other due storages after it, in the order
        backward consumes them, as one batch: the rest of this forward's backward needs
        them next. Called under the context's lock; returns how many storages, each a
        prefetch miss."""
        due = [entry]
        for other in reversed(self.values()):
            if other is not entry and other.reload is None and other.buf is not None and other.refs:
                due.append(other)
        reload(due, prefetched=False)
        return len(due)

    def backward_begins(self, _grad: object = None) -> None:
        """Backward reached this forward: at its first unpack (a hook on its outputs
        would cost more than the whole swap of a small layer), or, for a forward that
        saved nothing, at its outputs (``begin_at_outputs``). The forwards up to
        ``swap_prefetch_depth`` before it start coming back."""
        ctx = self.ctx
        ctx.boundary(ctx.seq)
        if ctx.capturing:
            self._refuse_reload_under_capture()
        target = self.prev
        for _ in range(ctx.swap_prefetch_depth):
            if target is None:
                break
            target.prefetch()
            target = target.prev

    def begin_at_outputs(self, out: Any) -> None:
        """For a forward that saved nothing, so that no unpack will tell when its
        backward begins: call ``backward_begins`` when backward reaches ``out``."""
        begins = self.backward_begins
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if len(outputs) == 1 and outputs[0].grad_fn is not None:
            outputs[0].grad_fn.register_prehook(begins)
        elif outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, begins, mode="any")

    def _refuse_reload_under_capture(self) -> None:
        """A backward under graph capture may not reload what a forward outside it copied
        to host: the copy would be captured into the graph, and every replay would read
        host buffers that other steps reuse by then (I6). Checked before any copy is
        issued, for this forward and the forwards its backward prefetches."""
        target = self
        for _ in range(self.ctx.swap_prefetch_depth + 1):
            if any(entry.buf is not None for entry in target.values()):
                raise SwapExclusionError(
                    f"activation swap excludes capturing a backward whose forward ran outside"
                    f" the capture: the backward of {self.name!r} began while the current"
                    f" stream captures a graph, but {target.name!r} swapped tensors to host in"
                    f" a forward outside it, and their reload would be captured and replayed"
                    f" from reused host buffers; run that forward under the same capture (its"
                    f" tensors then stay on device, counted as kept_capturing), or this"
                    f" backward outside it"
                )
            if target.prev is None:
                return
            target = target.prev


def _count_kept(stats: GroupStats, nbytes: int, reason: str) -> None:
    """A tensor the policy chose to swap stays on device, for ``reason`` (a field of
    ``stats``); called under the context's lock."""
    stats.kept_tensors += 1
    stats.kept_bytes += nbytes
    setattr(stats, reason, getattr(stats, reason) + 1)


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
