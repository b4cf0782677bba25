"""Per-tensor handles: what autograd stores for each saved tensor, and their unpack.

One of the runtime's objects (``_manager.py`` lists them). Here: the handles (a kept
tensor's ``(alias, version, forward)``, ``_Swapped``), the host copy of one storage
they share (``_Entry``) and its reloads (``reload``), the in-place check and its
``SwapIntegrityError``, a handle's death (``_Swapped.__del__``), and the unpack hook
(``unpack_hook``). A handle knows the forward that saved it only as ``Saver``, so this
module does not import ``_forward``.

Lifetimes follow autograd's own. Whatever the pack hook keeps or swaps, it hands
autograd a small handle that never refers to the tensor object it was given (that
would form a cycle through ``grad_fn``), so a graph that is dropped unused is freed
by reference counting alone. A swapped storage's host buffer goes back to the pool
when the last handle aliasing it dies; nothing is kept per step.

Every handle checks PyTorch's version counter on unpack, as autograd does for saved
tensors without hooks: a saved tensor modified in place raises
``SwapIntegrityError`` instead of giving a wrong gradient. A handle holds the counter
itself (through an alias that shares it), not the tensor's Python objects, so the
check holds after the caller dropped every one of them, and a copy still in flight
that reads changed bytes is always caught.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

from graphswap.errors import SwapIntegrityError
from graphswap.runtime._context import _Context
from graphswap.runtime._engines import Copy, CopyEngine, _Offload
from graphswap.runtime._pool import HostBuffer
from graphswap.runtime._stats import GroupStats

_task_id = torch._C._current_graph_task_id
"""The autograd graph task running now (-1: none): read at every unpack."""


def integrity_error(name: str, size: torch.Size, saved: int, now: int) -> SwapIntegrityError:
    return SwapIntegrityError(
        f"a tensor of shape {tuple(size)} saved for backward by {name!r} was modified by an"
        f" in-place operation (version {saved} when saved, {now} now); clone it before"
        " modifying it in place, as plain PyTorch requires"
    )


Layout = tuple[int | torch.SymInt, torch.dtype, torch.Size, tuple[int, ...]]
"""A tensor's offset in its storage, dtype, size and stride."""


def layout_in(local: torch.Tensor, host: torch.Tensor) -> Layout | None:
    """``local``'s layout, None when it is laid out as ``host``, its storage's host copy."""
    offset = local.storage_offset()
    dtype, size, stride = local.dtype, local.size(), local.stride()
    if offset == 0 and dtype is host.dtype and size == host.size() and stride == host.stride():
        return None
    return offset, dtype, size, stride


_NO_BYTES: dict[torch.device, torch.Tensor] = {}
"""One empty tensor per device: what a swapped tensor's version alias holds instead of
its bytes. Read through :func:`_no_bytes` the first time."""


def _no_bytes(device: torch.device) -> torch.Tensor:
    """The empty tensor of ``device``, made on first use below every dispatch mode: it
    lives as long as the process, not as long as the step a mode watches (the planner's
    trace, a clocked step), which would otherwise see it born in whichever step first
    swaps or recomputes, and in no later one."""
    empty = _NO_BYTES.get(device)
    if empty is None:
        with torch._C._DisableTorchDispatch():
            empty = _NO_BYTES[device] = torch.empty(0, device=device)
    return empty


def version_alias(t: torch.Tensor) -> torch.Tensor:
    """An alias of ``t`` (a plain tensor, above autograd) that shares its version counter,
    and so every view's and detached alias's, and holds none of its bytes: what an
    in-place check keeps when the tensor itself is not kept."""
    alias = t.detach()
    alias.data = _no_bytes(t.device)
    return alias


class Saver(Protocol):
    """What a handle asks of the forward that saved it (``_forward._Forward``)."""

    task: int
    """The autograd graph task whose backward reached the forward last (-1: none)."""

    @property
    def name(self) -> str:
        """The wrapped module's name: error messages name it."""

    def backward_begins(self, _grad: object = None) -> None:
        """Backward reached the forward: prefetch the forwards before it."""

    def reload_missed(self, entry: _Entry) -> int:
        """An unpack found no reload of ``entry`` issued: reload it and the forward's other
        due storages as one batch; how many (under the context's lock)."""


Kept = tuple[torch.Tensor, int, Saver]
"""A saved tensor that stays on device: ``(alias, version, forward)``, a detached alias
(same storage and version counter, no ``grad_fn``), the version it had when saved (unpack
compares), and the forward that saved it (backward detection and error names). A tuple,
built without a Python call: most tensors a decoder layer saves are kept."""


class _Entry(_Offload):
    """One storage copied to host: shared by every handle that aliases it.

    The entry is its offload, whatever the engine: the runtime calls ``done()``,
    ``fence()``, ``synchronize()`` and ``release_source()`` on it. The built-in engine
    (``CopyEngine._fills_records``) writes the copy's fields into it (``_offload_into``),
    so a swapped storage costs one object, not two; with another engine the entry is a
    ``_ForeignEntry``, which holds the ``Copy`` that engine returned and passes those
    calls on to it. The class, chosen once by ``_forward._Forward.offload``, is the one
    place the two are told apart: ``copy()`` (what the engine is handed back in
    ``after``) and ``in_order`` say the rest.

    ``host`` holds the storage's bytes, shaped as the tensor that was swapped when
    that tensor covers its storage contiguously (the usual case: its reload is then
    handed back as it is), else as bytes.

    ``reload`` is the reload of the current backward, ``gen`` counts reloads and
    ``waiting`` how many live handles have not yet consumed the current one: the
    set of consumers is fixed when the reload is issued, so handles that die while
    others unpack never cause a second reload.
    """

    __slots__ = (
        "__weakref__",
        "buf",
        "ctx",
        "device",
        "engine",
        "first",
        "gen",
        "held",
        "host",
        "name",
        "prefetched",
        "refs",
        "released",
        "reload",
        "stats",
        "version",
        "waiting",
    )
    # No reference to its ``_Forward``, which holds it: a graph dropped unused is freed by
    # reference counting alone.

    def __init__(
        self,
        ctx: _Context,
        name: str,
        stats: GroupStats,
        device: torch.device,
        engine: CopyEngine,
        nbytes: int,
        buf: HostBuffer,
        host: torch.Tensor,
        first: Layout | None,
    ) -> None:
        self.ctx = ctx  # its lock, pool and capture flag: reloads and a handle's death settle there
        self.name = name  # the wrapped module's name, for trace events
        self.stats = stats  # the wrapped module's stats: reloads and prefetch hits count there
        self.device = device  # where the storage lived and its reloads go
        self.engine = engine  # the device's copy engine: issues this entry's copies
        self.nbytes = nbytes  # the storage's size, copied whole (the offload's field)
        self.buf: HostBuffer | None = buf  # the pool buffer; None: released, bytes gone
        self.host: torch.Tensor | None = host  # ``buf``'s view holding it; None: released
        self.first = first  # the layout of the save that made it (``layout_in``), found then
        self.released = False  # the offload's source was dropped (``_Forward.release``)
        self.held: weakref.ref[torch.UntypedStorage] | None = None
        """The source, when another reference kept it on device after it was dropped:
        watched until the reload (``_Context.not_freed``)."""
        self.reload: Copy | None = None  # the current backward's reload; None: none pending
        self.prefetched = False  # ``reload`` was issued by a prefetch, not yet hit
        self.gen = 0  # the current reload's generation: ``reload`` counts them
        self.waiting = 0  # live handles that have not consumed the current ``reload``
        self.refs = 0  # live handles (``_Swapped``) aliasing this storage
        self.version = -1
        """The saved tensor's version when its copy was issued (set by the pack): every
        handle of the entry was saved at it (a save at another version is kept)."""

    in_order = True
    """Its engine runs every offload in order on one copy stream, so the next offload
    into its host buffer needs no wait for this one (``HostPool.release``'s ``after``)."""

    def copy(self) -> Copy:
        """The offload as its engine knows it, for ``after``: the entry itself, its fields
        filled by the built-in engine."""
        return self


class _ForeignEntry(_Entry):
    """An entry whose offload a user's engine made (``CopyEngine.offload``): the calls on
    the offload go to the ``Copy`` that engine returned, and the engine is handed that
    ``Copy`` back in ``after``, never the entry."""

    __slots__ = ("foreign",)

    in_order = False

    def __init__(self, *args: Any, foreign: Copy) -> None:
        super().__init__(*args)
        self.foreign = foreign  # what the engine's ``offload`` returned

    def copy(self) -> Copy:
        return self.foreign

    def done(self) -> bool:
        return self.foreign.done()

    def fence(self) -> None:
        self.foreign.fence()

    def synchronize(self) -> None:
        self.foreign.synchronize()

    def release_source(self) -> weakref.ref[torch.UntypedStorage] | None:
        return self.foreign.release_source()


class _Swapped:
    """What autograd stores instead of a swapped tensor.

    ``counter`` shares the saved tensor's version counter and holds none of its bytes:
    the in-place check needs no Python object of the tensor or of its base to be alive,
    so a change made while the copy was in flight, and then dropped with every
    reference to the tensor, is still an error at unpack.
    """

    __slots__ = (
        "counter",
        "entry",
        "forward",
        "gen",
        "layout",
        "spec",
    )

    def __init__(
        self,
        fwd: Saver,
        entry: _Entry,
        t: torch.Tensor,
        local: torch.Tensor,
        layout: Layout | None,
    ) -> None:
        self.forward = fwd  # the forward that saved it: backward detection and error names
        self.entry = entry  # the host copy of its storage, shared with its aliases
        self.layout = layout
        """Where ``local`` starts in its storage, its dtype, size and stride; None when laid
        out as the entry's host copy, whose reload is then handed back as it is."""
        self.spec = None if local is t else t._spec  # type: ignore[attr-defined]
        """A DTensor's mesh, placements and global shape, to rebuild it around its shard.
        Its version when saved is its entry's: unpack compares ``counter`` with it."""
        # ``t``'s version counter and none of its bytes: ``detach()`` shares the counter
        # (with every view of ``t`` too) and no ``grad_fn``; setting ``.data`` then swaps its
        # storage for an empty one and keeps the counter. So an in-place change made through
        # any alias of ``t`` stays visible after every Python object of ``t`` died, while its
        # device memory is freed. A DTensor's wrapper holds no bytes, its local shard does:
        # the shard is replaced.
        counter = t.detach()
        empty = _NO_BYTES.get(entry.device)
        if empty is None:
            empty = _no_bytes(entry.device)
        if local is t:
            counter.data = empty
        else:
            counter._local_tensor = empty  # type: ignore[attr-defined]
        self.counter = counter
        self.gen = -1
        """The reload generation this handle consumed last (-1: none)."""
        entry.refs += 1
        if entry.reload is not None:
            entry.waiting += 1

    def __del__(self) -> None:
        """Autograd dropped this handle: settle the reload, and when it was the
        last handle of its storage, free the source once ordered and pool the host buffer.

        Nothing here blocks the host: the stream that produced the source waits for its
        copy still in flight, compute for a reload, and the next offload into the buffer
        waits for its last users."""
        entry = self.entry
        ctx = entry.ctx
        ctx.lock.acquire()  # not ``with``: it makes two bound methods a call
        try:
            refs = entry.refs = entry.refs - 1
            reload = entry.reload
            if reload is not None and self.gen != entry.gen:
                # It never consumed the current reload: one consumer fewer to wait for.
                entry.waiting -= 1
                if entry.waiting == 0:
                    entry.reload = None
                    if not ctx.capturing:
                        reload.fence()
                    reload = None
            if refs:
                return
            buf = entry.buf
            if buf is None:
                return
            entry.buf = entry.host = None
            if not ctx.capturing:
                if not entry.released:
                    if not entry.done():
                        entry.fence()
                    entry.released = True
                    entry.held = entry.release_source()
                if reload is not None:
                    reload.fence()
            held = entry.held
            if held is not None:
                entry.held = None
                if held() is not None:
                    ctx.not_freed(entry.stats, entry.nbytes, entry.name)
            if reload is not None:
                entry.reload = None
            if entry.in_order:
                ctx.pool.release(buf, () if reload is None else (reload,))
            elif reload is None:
                ctx.pool.release(buf, (entry.copy(),))
            else:
                ctx.pool.release(buf, (entry.copy(), reload))
        finally:
            ctx.lock.release()


def reload(entries: list[_Entry], *, prefetched: bool) -> None:
    """Issue the reloads of ``entries``, all of one forward (per device, one batch), for
    the live handles that have not consumed one; ``prefetched``: ahead of their first
    unpack. Called under the context's lock, by a prefetch or by an unpack that found
    none issued (I10: one reload per storage and backward)."""
    first = entries[0]
    ctx = first.ctx
    engine, device = first.engine, first.device  # one object per device: ``is``
    batch = entries
    if len(ctx.device_engines) > 1:  # entries of several devices: a batch each
        for entry in entries:
            if entry.engine is not engine or entry.device is not device:
                batch = [e for e in entries if e.engine is engine and e.device is device]
                reload([e for e in entries if e not in batch], prefetched=prefetched)
                break
    # ``host`` is None once the last handle died; a due entry has live handles (``refs``).
    items = [(entry.host, (entry.copy(),)) for entry in batch]
    reloads = engine.reloads(device, items)  # type: ignore[arg-type]
    nbytes = 0
    for entry, copy in zip(batch, reloads, strict=True):
        entry.reload = copy
        entry.gen += 1
        entry.waiting = entry.refs
        entry.prefetched = prefetched
        nbytes += entry.nbytes
        held = entry.held
        if held is not None:
            entry.held = None
            if held() is not None:
                ctx.not_freed(entry.stats, entry.nbytes, entry.name)
    stats = first.stats  # the forward's
    stats.reloaded_tensors += len(batch)
    stats.reloaded_bytes += nbytes


def unpack_hook(packed: Kept | _Swapped) -> torch.Tensor:
    """The unpack hook of every wrapped forward: a plain function, the context reached
    through the handle, so that no bound method is made per forward."""
    if isinstance(packed, tuple):  # a kept tensor: ``Kept``
        alias, version, fwd = packed
        task = _task_id()
        if task != fwd.task and task != -1:
            # The first unpack of this forward in this backward: its backward begins.
            fwd.task = task
            fwd.backward_begins()
        now = alias._version
        if now != version:
            raise integrity_error(fwd.name, alias.size(), version, now)
        return alias
    fwd = packed.forward
    task = _task_id()
    if task != fwd.task and task != -1:
        fwd.task = task
        fwd.backward_begins()
    entry = packed.entry
    now = packed.counter._version
    if now != entry.version:
        host = entry.host
        assert host is not None  # a live handle's entry holds its host copy
        size = packed.layout[2] if packed.layout is not None else host.size()
        raise integrity_error(fwd.name, size, entry.version, now)
    lock = entry.ctx.lock
    lock.acquire()  # not ``with``: it makes two bound methods a call
    try:
        copy = entry.reload
        if copy is None:
            # No prefetch reached it: the rest of its forward comes back with it.
            entry.stats.prefetch_misses += fwd.reload_missed(entry)
            copy = entry.reload
            assert copy is not None
        elif packed.gen == entry.gen:  # a second unpack of this handle in one backward
            entry.stats.prefetch_misses += 1
            host = entry.host
            assert host is not None  # a live handle's entry holds its host copy
            (copy,) = entry.engine.reloads(entry.device, [(host, (entry.copy(),))])
            entry.stats.reloaded_tensors += 1
            entry.stats.reloaded_bytes += entry.nbytes
        elif entry.prefetched:
            entry.stats.prefetch_hits += 1
            entry.prefetched = False
        if copy is entry.reload:
            packed.gen = entry.gen
            entry.waiting -= 1
            if entry.waiting == 0:
                entry.reload = None
    finally:
        lock.release()
    out = copy.fenced_result()
    if packed.layout is not None:
        storage = out.untyped_storage()
        offset, dtype, size, stride = packed.layout
        out = torch.empty(0, dtype=dtype, device=entry.device)
        out.set_(storage, offset, size, stride)
    if packed.spec is not None:
        # Loaded only when a DTensor was packed, so torch.distributed is imported already.
        from torch.distributed.tensor import DTensor

        return DTensor(out, packed.spec, requires_grad=False)
    return out
