"""SwapManager: per-forward swap groups, layer-to-layer prefetch, bounded offload lag.

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

import collections
import dataclasses
import functools
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from graphswap.policy import (
    CheckpointPolicy,
    SwapPolicy,
    is_parameter_like,
    local_tensor,
    policy_name,
)
from graphswap.runtime.engines import (
    AcceleratorCopyEngine,
    Copy,
    CopyEngine,
    SimulatedAccelerator,
)
from graphswap.runtime.pool import HostBuffer, HostPool, Refusal
from graphswap.runtime.stats import GroupStats, SwapStats

TRACE_LIMIT = 100_000

Layout = tuple[torch.dtype, torch.Size, tuple[int, ...]]
"""A tensor's dtype, size and stride."""

_TYPED_COPIES = frozenset(
    {
        *(torch.float64, torch.float32, torch.float16, torch.bfloat16),
        *(torch.complex64, torch.complex128, torch.bool, torch.uint8),
        *(torch.int8, torch.int16, torch.int32, torch.int64),
    }
)
"""Dtypes a host view of bytes can take and copy; others (sub-byte, quantized, float8)
are copied as bytes."""


class SwapIntegrityError(RuntimeError):
    """A tensor saved for backward changed after it was saved: its gradient would be wrong."""


class SwapExclusionError(RuntimeError):
    """A swap-wrapped module ran under a transform that activation swap excludes."""


_FIXES = {
    "compile": "compile: false (by hand: call graphswap.unrewrite(model) before torch.compile)",
    "activation_checkpointing": "activation_checkpointing: false (by hand: call"
    " graphswap.unrewrite(model) before enabling gradient checkpointing)",
}


def _refuse(name: str, excluded: str, found: str) -> None:
    """Raise the plan's exclusion error at run time (the plan cannot see hand-made setups)."""
    raise SwapExclusionError(
        f"activation swap excludes {excluded}: {name!r} ran under {found}, which would handle"
        f" its saved tensors a second time; set activation_swap: none or {_FIXES[excluded]}"
    )


@functools.cache
def _traced_exclusion_error() -> type[SwapExclusionError]:
    """``SwapExclusionError`` that Dynamo passes on as it is: it wraps any other error raised
    while it traces into an ``InternalTorchDynamoError``."""
    # Loaded only while torch.compile or torch.export traces, so Dynamo is imported already.
    from torch._dynamo.exc import TorchRuntimeError

    class SwapExclusionWhileTracing(SwapExclusionError, TorchRuntimeError):
        """A swap-wrapped module traced by torch.compile or torch.export."""

    return SwapExclusionWhileTracing


def _refuse_traced(name: str) -> None:
    """Refuse a wrapped forward that torch.compile or torch.export traces.

    Marked as a constant result (what ``torch.compiler.assume_constant_result`` does,
    without importing Dynamo with graphswap): Dynamo calls it for real while it traces,
    so the error reaches the user in every mode, ``fullgraph=True`` and strict export
    too, rather than being traced as a raise or turned into a graph break.
    """
    error = _traced_exclusion_error()
    if torch.compiler.is_exporting():
        raise error(
            f"activation swap excludes torch.export: {name!r} ran under torch.export, which"
            " traces its forward into a graph without the swap's saved-tensor hooks and"
            " copies; export the model without swap: call graphswap.unrewrite(model) before"
            " torch.export (or build it with activation_swap: none)"
        )
    raise error(
        f"activation swap excludes compile: {name!r} ran under torch.compile, which would"
        f" handle its saved tensors a second time; set activation_swap: none or"
        f" {_FIXES['compile']}"
    )


_refuse_traced._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _checkpointing() -> str | None:
    """How the current forward is checkpointed, if it is."""
    if torch._C._current_graph_task_id() != -1:
        return "a recomputation during backward (reentrant activation checkpointing)"
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint":
        return "torch.utils.checkpoint (non-reentrant activation checkpointing)"
    return None


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
    decide: Callable[[torch.Tensor, int], CheckpointPolicy] | None = dataclasses.field(init=False)
    """``policy.decide`` when the policy has one: it is asked ``decide(t, index)``, told
    which save of the forward ``t`` is (every pack call counts); else ``policy(t)`` is."""

    def __post_init__(self) -> None:
        decide = getattr(self.policy, "decide", None)
        self.decide = decide if callable(decide) else None


def _bad_decision(slot: _Slot, decision: object) -> TypeError:
    return TypeError(
        f"the swap policy {policy_name(slot.policy)} of {slot.name!r} answered {decision!r};"
        " a swap policy answers graphswap.CheckpointPolicy.MUST_SWAP or MUST_SAVE"
        " (torch.utils.checkpoint.CheckpointPolicy is another enum, for recomputation)"
    )


def _integrity_error(name: str, size: torch.Size, saved: int, now: int) -> SwapIntegrityError:
    return SwapIntegrityError(
        f"a tensor of shape {tuple(size)} saved for backward by {name!r} was modified by an"
        f" in-place operation (version {saved} when saved, {now} now); clone it before"
        " modifying it in place, as plain PyTorch requires"
    )


_NO_BYTES: dict[torch.device, torch.Tensor] = {}
"""One empty tensor per device: what a swapped tensor's version alias holds instead of
its bytes."""


def _version_alias(t: torch.Tensor, local: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor that shares ``t``'s version counter and none of its bytes.

    ``detach()`` shares the counter (with every view of ``t`` too) and no ``grad_fn``;
    setting ``.data`` then swaps its storage for an empty one and keeps its counter. So
    an in-place change made through any alias of ``t`` stays visible to the handle
    after every Python object of ``t`` died, while its device memory is freed. A
    DTensor's wrapper holds no bytes, its local shard does: the shard is replaced.
    """
    alias = t.detach()
    empty = _NO_BYTES.get(device)
    if empty is None:
        empty = _NO_BYTES[device] = torch.empty(0, device=device)
    if local is t:
        alias.data = empty
    else:
        alias._local_tensor = empty  # type: ignore[attr-defined]
    return alias


class _Kept:
    """A saved tensor that stays on device: a detached alias (same storage and version
    counter, no ``grad_fn``) and the version it had when saved."""

    __slots__ = ("alias", "group", "version")

    def __init__(self, t: torch.Tensor, group: _Group) -> None:
        self.alias = t.detach()
        self.version = t._version
        self.group = group

    def unpack(self) -> torch.Tensor:
        now = self.alias._version
        if now != self.version:
            raise _integrity_error(self.group.name, self.alias.size(), self.version, now)
        return self.alias


class _Entry:
    """One storage copied to host: shared by every handle that aliases it.

    ``host`` holds the storage's bytes, shaped as the tensor that was swapped when
    that tensor covers its storage contiguously (the usual case: its reload is then
    handed back as it is), else as bytes; ``layout`` says which.

    ``load`` is the reload of the current backward, ``gen`` counts reloads and
    ``waiting`` how many live handles have not yet consumed the current one: the
    set of consumers is fixed when the load is issued, so handles that die while
    others unpack never cause a second reload.
    """

    __slots__ = (
        "__weakref__",
        "buf",
        "device",
        "engine",
        "gen",
        "host",
        "layout",
        "load",
        "manager",
        "name",
        "nbytes",
        "offload",
        "prefetched",
        "refs",
        "stats",
        "version",
        "waiting",
    )

    def __init__(
        self,
        manager: SwapManager,
        name: str,
        stats: GroupStats,
        device: torch.device,
        engine: CopyEngine,
        nbytes: int,
        buf: HostBuffer,
        host: torch.Tensor,
        layout: Layout,
        offload: Copy,
    ) -> None:
        self.manager = manager
        self.name = name
        self.stats = stats
        self.device = device
        self.engine = engine
        self.nbytes = nbytes
        self.buf: HostBuffer | None = buf
        self.host: torch.Tensor | None = host
        self.layout = layout
        self.offload = offload
        self.load: Copy | None = None
        self.prefetched = False
        self.gen = 0
        self.waiting = 0
        self.refs = 0
        self.version = -1
        """The saved tensor's version when its copy was issued (set by ``_pack``)."""


class _Swapped:
    """What autograd stores instead of a swapped tensor.

    ``counter`` shares the saved tensor's version counter and holds none of its bytes
    (:func:`_version_alias`): the in-place check needs no Python object of the tensor
    or of its base to be alive, so a change made while the copy was in flight, and then
    dropped with every reference to the tensor, is still an error at unpack.
    """

    __slots__ = (
        "counter",
        "entry",
        "gen",
        "group",
        "layout",
        "offset",
        "spec",
        "version",
        "whole",
    )

    def __init__(
        self,
        group: _Group,
        entry: _Entry,
        t: torch.Tensor,
        local: torch.Tensor,
        layout: Layout,
        version: int,
    ) -> None:
        self.group = group
        self.entry = entry
        self.layout = layout
        """``local``'s dtype, size and stride."""
        self.offset = local.storage_offset()
        self.whole = self.offset == 0 and entry.layout == layout
        """Laid out as the entry's host copy: its reload is handed back as it is."""
        self.spec = None if local is t else t._spec  # type: ignore[attr-defined]
        """A DTensor's mesh, placements and global shape, to rebuild it around its shard."""
        self.version = version
        self.counter = _version_alias(t, local, entry.device)
        self.gen = -1
        """The reload generation this handle consumed last (-1: none)."""
        entry.refs += 1
        if entry.load is not None:
            entry.waiting += 1

    def __del__(self) -> None:
        self.entry.manager._handle_died(self)


class _Group:
    """The saved tensors of one forward call of one wrapped module."""

    __slots__ = (
        "__weakref__",
        "entries",
        "keep",
        "prev",
        "protected",
        "saves",
        "seq",
        "slot",
        "stats",
        "task",
    )

    def __init__(
        self,
        slot: _Slot,
        seq: int,
        stats: GroupStats,
        *,
        keep: bool,
        prev: _Group | None,
    ) -> None:
        self.slot = slot
        self.seq = seq
        self.stats = stats
        self.keep = keep
        self.prev = prev
        """The group its prev module opened last: the one this group's backward prefetches."""
        self.protected: set[int] | None = None
        """Storages of the module's parameters and buffers, never swapped; found when the
        first tensor is about to be swapped, so forwards that swap nothing pay nothing."""
        self.entries: dict[int, _Entry] = {}
        self.saves = 0
        """Pack calls so far in this forward (parameters and aliases too)."""
        self.task = -1
        """The autograd graph task whose backward reached this group last (-1: none)."""

    def is_protected(self, key: int) -> bool:
        if self.protected is None:
            self.protected = _state_storages(self.slot.module)
        return key in self.protected

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


def _default_max_host_bytes() -> int:
    """Half of physical memory: enough for any layer stack that fits on a GPU."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _check_int(name: str, value: object, minimum: int, alternative: str = "") -> int:
    """An int, not a bool (``True`` would pass as 1) nor a string of one."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{alternative}, got {value!r}")
    return value


def _check_bool(name: str, value: object) -> bool:
    """True or False: any other value would be taken by its truth (``"no"`` is true)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


class SwapManager:
    """Owns the swap groups of one model: links, copy engine, host pool, stats.

    ``prefetch_depth``: how many earlier layers start coming back when a layer's
    backward begins. ``keep_last``: the end of a linked chain keeps its tensors on
    device, since its backward starts right after forward. ``max_host_bytes``: cap of
    the host pool (default: half of physical memory); past it tensors stay on device
    and ``pool_exhausted`` counts them. ``offload_lag``: a layer's swapped storages
    leave device memory no later than when the forward of the wrapped module
    ``offload_lag`` forwards later begins (0: at the end of its own forward); the
    stream that produced the tensor waits for the copy there, the host never blocks.
    ``engine``: the copy engine (default: ``AcceleratorCopyEngine`` for accelerator
    tensors, a ``SimulatedAccelerator(lag=0)`` for CPU tensors). ``trace``: record
    events.

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
        offload_lag: int = 1,
        engine: CopyEngine | None = None,
        trace: bool = False,
    ) -> None:
        self.prefetch_depth = _check_int("prefetch_depth", prefetch_depth, 1)
        self.offload_lag = _check_int("offload_lag", offload_lag, 0)
        if engine is not None and not isinstance(engine, CopyEngine):
            raise ValueError(
                f"engine must be a graphswap.runtime CopyEngine (AcceleratorCopyEngine or"
                f" SimulatedAccelerator), got {type(engine).__name__}"
            )
        self.keep_last = _check_bool("keep_last", keep_last)
        _check_bool("trace", trace)
        self._pool = HostPool(
            _default_max_host_bytes()
            if max_host_bytes is None
            else _check_int("max_host_bytes", max_host_bytes, 0, " (or None: half of RAM)")
        )
        self._engine_override = engine
        self._engines: dict[str, CopyEngine] = {}
        self._device_engines: dict[torch.device, CopyEngine] = {}
        self._slots: dict[torch.nn.Module, _Slot] = {}
        self._registered = 0
        self._prev: dict[torch.nn.Module, torch.nn.Module] = {}
        self._next: dict[torch.nn.Module, torch.nn.Module] = {}
        self._latest: dict[torch.nn.Module, weakref.ref[_Group]] = {}
        self._in_flight: dict[torch.device, collections.deque[tuple[int, Copy]]] = {}
        """Offloads whose source is still held, per device in issue order, with the
        ``seq`` of the forward that issued them."""
        self._seq = 0
        self._stats: dict[str, GroupStats] = {}
        self._lock = threading.RLock()
        self.events: collections.deque[tuple[str, str]] | None = (
            collections.deque(maxlen=TRACE_LIMIT) if trace else None
        )

    def __getstate__(self) -> dict[str, Any]:
        """Options, groups and links; a copy starts with fresh stats, pool and engines."""
        return {
            "options": {
                "prefetch_depth": self.prefetch_depth,
                "keep_last": self.keep_last,
                "max_host_bytes": self._pool.max_bytes,
                "offload_lag": self.offload_lag,
                "engine": self._engine_override,
                "trace": self.events is not None,
            },
            "slots": [
                (s.module, s.name, s.index, s.policy, s.module_type) for s in self._slots.values()
            ],
            "registered": self._registered,
            "links": list(self._next.items()),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state["options"])  # type: ignore[misc]
        for module, name, index, policy, module_type in state["slots"]:
            self._slots[module] = _Slot(module, name, index, policy, module_type)
            self._stats[name] = GroupStats()
        self._registered = state["registered"]
        for prev, nxt in state["links"]:
            self._next[prev] = nxt
            self._prev[nxt] = prev

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
        """Forget ``module`` and its links. Its stats stay readable, what it did while
        wrapped, until a module is registered under its name again and starts at zero."""
        del self._slots[module]
        for a, b in list(self._next.items()):
            if module in (a, b):
                del self._next[a], self._prev[b]
        self._latest.pop(module, None)

    def set_forward_prefetch_layer(self, earlier: torch.nn.Module, later: torch.nn.Module) -> None:
        """Link two wrapped modules, ``earlier`` before ``later`` in forward order: when the
        backward of ``later`` begins, ``earlier``'s tensors start coming back.

        The name is the origin's; what it sets is, in FSDP2's words, a backward prefetch.
        """
        for role, module in (("earlier", earlier), ("later", later)):
            if module not in self._slots:
                raise ValueError(
                    f"{role} module {type(module).__name__} is not swap-wrapped by this manager;"
                    " call swap_wrapper(module, manager=manager) first"
                )
        if earlier is later:
            raise ValueError("a module cannot prefetch itself")
        if earlier in self._next or later in self._prev:
            taken = self._slots[earlier if earlier in self._next else later].name
            raise ValueError(f"{taken!r} is already linked; each module has one prev and one next")
        walk: torch.nn.Module | None = earlier
        while walk is not None:
            if walk is later:
                raise ValueError("this link would close a cycle in the prefetch chain")
            walk = self._prev.get(walk)
        self._next[earlier] = later
        self._prev[later] = earlier

    @property
    def engine(self) -> CopyEngine | None:
        """The copy engine this manager was given; None: each device's own."""
        return self._engine_override

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

    def count_plan_mismatch(self, name: str) -> None:
        """The policy of the module ``name`` met a save its plan chose with another shape
        or dtype, and kept it on device: counted in ``stats.plan_mismatches``."""
        with self._lock:
            self._stats[name].plan_mismatches += 1

    def reset_stats(self) -> None:
        with self._lock:
            for group_stats in self._stats.values():
                for f in dataclasses.fields(GroupStats):
                    setattr(group_stats, f.name, 0)
            self._pool.peak_in_use_bytes = self._pool.in_use_bytes

    def synchronize(self) -> None:
        """Block until every offload in flight completed, and free their sources."""
        with self._lock:
            copies = [copy for queue in self._in_flight.values() for _, copy in queue]
            for queue in self._in_flight.values():
                queue.clear()
        for copy in copies:
            copy.synchronize()
            copy.release_source()

    def run_forward(
        self, module: torch.nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any:
        """Run ``forward`` of a wrapped module under this manager's saved-tensor hooks."""
        if torch.compiler.is_compiling():  # torch.compile or torch.export traces this forward
            _refuse_traced(self._slots[module].name)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        slot = self._slots[module]
        checkpointed = _checkpointing()
        if checkpointed is not None:
            _refuse(slot.name, "activation_checkpointing", checkpointed)
        self._seq += 1
        seq = self._seq
        self._boundary(seq)
        prev = self._prev.get(module)
        prev_ref = self._latest.get(prev) if prev is not None else None
        group = _Group(
            slot,
            seq,
            self._stats[slot.name],
            keep=self.is_kept(module),
            prev=prev_ref() if prev_ref is not None else None,
        )
        self._latest[module] = weakref.ref(group)
        # What saved_tensors_hooks does, without three Python calls per forward.
        torch._C._autograd._push_saved_tensors_default_hooks(
            functools.partial(self._pack, group), self._unpack
        )
        try:
            out = forward(*args, **kwargs)
        finally:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        self._boundary(seq)
        if group.saves == 0:
            # Nothing saved, so no unpack will tell when this group's backward begins.
            self._on_backward(group, out)
        return out

    def _on_backward(self, group: _Group, out: Any) -> None:
        """Call ``_backward_begins(group)`` when backward reaches the outputs ``out``."""
        begins = functools.partial(self._backward_begins, group)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if len(outputs) == 1 and outputs[0].grad_fn is not None:
            outputs[0].grad_fn.register_prehook(begins)
        elif outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, begins, mode="any")

    def _first_engine(self, device: torch.device) -> CopyEngine:
        """The engine of a device met for the first time: one per device type."""
        engine = self._engines.get(device.type)
        if engine is None:
            if self._engine_override is not None:
                engine = self._engine_override
            elif device.type == "cpu":
                engine = SimulatedAccelerator(lag=0)
            else:
                engine = AcceleratorCopyEngine()
            self._engines[device.type] = engine
        self._device_engines[device] = engine
        return engine

    def _boundary(self, seq: int) -> None:
        """A module boundary: the device advances; offloads of groups ``offload_lag``
        forwards back are fenced (their producing stream waits for them) and their
        sources dropped; finished ones too."""
        engines = self._engines.values()
        for engine in engines:
            if engine.capturing():
                return
        for engine in engines:
            engine.tick()
        limit = seq - self.offload_lag
        with self._lock:
            for queue in self._in_flight.values():
                while queue:
                    issued, copy = queue[0]
                    if issued <= limit:
                        copy.fence()
                    elif not copy.done():
                        break
                    copy.release_source()
                    queue.popleft()

    def _pack(self, group: _Group, t: torch.Tensor) -> Any:
        index = group.saves
        group.saves = index + 1
        local = t if type(t) is torch.Tensor else local_tensor(t)
        if (
            type(local) is torch.Tensor
            and local.layout is torch.strided
            and not local.is_meta
            and not is_parameter_like(t)
        ):
            storage = local.untyped_storage()
            key = storage._cdata
            entry = group.entries.get(key)
            if entry is not None and entry.buf is None:
                entry = None  # every handle of its copy died: its host buffer went back
            version = t._version
            if entry is None:
                slot = group.slot
                decision = slot.policy(t) if slot.decide is None else slot.decide(t, index)
                if decision is not CheckpointPolicy.MUST_SWAP:
                    if decision is not CheckpointPolicy.MUST_SAVE:
                        raise _bad_decision(slot, decision)
                    return _Kept(t, group)
                if group.is_protected(key):
                    return _Kept(t, group)
            elif version != entry.version:
                return self._keep_changed(group, t, entry)
            layout = (local.dtype, local.size(), local.stride())
            if entry is None:
                entry = self._offload(group, local, storage, layout)
                if entry is None:
                    return _Kept(t, group)
                entry.version = version
            return _Swapped(group, entry, t, local, layout, version)
        return _Kept(t, group)

    def _keep_changed(self, group: _Group, t: torch.Tensor, entry: _Entry) -> _Kept:
        """A storage saved again after an in-place change since its copy was issued: that
        copy may hold either version, so this save keeps its own bytes on device."""
        with self._lock:
            stats = group.stats
            stats.kept_tensors += 1
            stats.kept_bytes += entry.nbytes
            stats.kept_changed += 1
        return _Kept(t, group)

    def _offload(
        self, group: _Group, local: torch.Tensor, storage: torch.UntypedStorage, layout: Layout
    ) -> _Entry | None:
        nbytes = storage.nbytes()
        device = local.device
        engine = self._device_engines.get(device) or self._first_engine(device)
        reason: str | None = None
        buf: HostBuffer | Refusal | None = None
        if group.keep:
            reason = "kept_last_layer"
        elif engine.capturing():
            reason = "kept_capturing"
        else:
            buf = self._pool.acquire(device, nbytes, engine)
            if isinstance(buf, Refusal):
                reason = buf.value
        stats = group.stats
        if reason is not None or not isinstance(buf, HostBuffer):
            with self._lock:
                stats.kept_tensors += 1
                stats.kept_bytes += nbytes
                setattr(stats, reason, getattr(stats, reason) + 1)
            return None
        if (
            local.dtype in _TYPED_COPIES
            and local.storage_offset() == 0
            and local.nbytes == nbytes
            and local.is_contiguous()
        ):
            src = local
            host = buf.view(layout[0], layout[1], nbytes)
            layout = (layout[0], layout[1], host.stride())
        else:
            src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            host = buf.view(torch.uint8, src.shape, nbytes)
            layout = (torch.uint8, src.shape, (1,))
        copy = engine.offload(src, host, buf.last_use)
        entry = _Entry(
            self, group.slot.name, stats, device, engine, nbytes, buf, host, layout, copy
        )
        group.entries[storage._cdata] = entry
        with self._lock:
            queue = self._in_flight.get(device)
            if queue is None:
                queue = self._in_flight[device] = collections.deque()
            queue.append((group.seq, copy))
            stats.offloaded_tensors += 1
            stats.offloaded_bytes += nbytes
        if self.events is not None:
            self.events.append(("offload", group.slot.name))
        return entry

    def _refuse_reload_under_capture(self, group: _Group) -> None:
        """A backward under graph capture may not reload what a forward outside it copied
        to host: the copy would be captured into the graph, and every replay would read
        host buffers that other steps reuse by then. Checked before any copy is issued,
        for ``group`` and the groups its backward prefetches."""
        target = group
        for _ in range(self.prefetch_depth + 1):
            if any(entry.buf is not None for entry in target.entries.values()):
                raise SwapExclusionError(
                    f"activation swap excludes capturing a backward whose forward ran outside"
                    f" the capture: the backward of {group.name!r} began while the current"
                    f" stream captures a graph, but {target.name!r} swapped tensors to host in"
                    f" a forward outside it, and their reload would be captured and replayed"
                    f" from reused host buffers; run that forward under the same capture (its"
                    f" tensors then stay on device, counted as kept_capturing), or this"
                    f" backward outside it"
                )
            if target.prev is None:
                return
            target = target.prev

    def _backward_begins(self, group: _Group, _grad: Any = None) -> None:
        """Backward reached ``group``: at its first unpack (a hook on its outputs would
        cost more than the whole swap of a small layer), or, for a group that saved
        nothing, at its outputs."""
        if self.events is not None:
            self.events.append(("backward_begin", group.name))
        for engine in self._engines.values():
            if engine.capturing():
                self._refuse_reload_under_capture(group)
                break
        self._boundary(self._seq)
        target = group.prev
        for _ in range(self.prefetch_depth):
            if target is None:
                break
            self._prefetch(target)
            target = target.prev

    def _prefetch(self, group: _Group) -> None:
        """Reload ``group``'s swapped storages, first needed first: backward consumes
        them in reverse saving order, and each waits only for its own copy."""
        issued = False
        with self._lock:
            for entry in reversed(group.entries.values()):
                if entry.load is None and entry.buf is not None and entry.refs:
                    self._load(entry)
                    entry.prefetched = True
                    issued = True
        if issued and self.events is not None:
            self.events.append(("prefetch", group.name))

    def _load(self, entry: _Entry) -> Copy:
        """Issue the reload of ``entry`` for the live handles that have not consumed one."""
        assert entry.host is not None
        load = entry.engine.load(entry.host, entry.device, (entry.offload,))
        entry.load = load
        entry.gen += 1
        entry.waiting = entry.refs
        entry.prefetched = False
        entry.stats.reloaded_tensors += 1
        entry.stats.reloaded_bytes += entry.nbytes
        return load

    def _unpack(self, packed: Any) -> torch.Tensor:
        group = packed.group
        task = torch._C._current_graph_task_id()
        if task != group.task and task != -1:
            # The first unpack of this group in this backward: its backward begins.
            group.task = task
            self._backward_begins(group)
        if type(packed) is _Kept:
            return packed.unpack()
        assert type(packed) is _Swapped
        now = packed.counter._version
        if now != packed.version:
            raise _integrity_error(group.name, packed.layout[1], packed.version, now)
        entry = packed.entry
        with self._lock:
            load = entry.load
            if load is None or packed.gen == entry.gen:
                entry.stats.prefetch_misses += 1
                if load is None:
                    load = self._load(entry)
                else:
                    load = entry.engine.load(
                        entry.host,  # type: ignore[arg-type]
                        entry.device,
                        (entry.offload,),
                    )
                    entry.stats.reloaded_tensors += 1
                    entry.stats.reloaded_bytes += entry.nbytes
            elif entry.prefetched:
                entry.stats.prefetch_hits += 1
                entry.prefetched = False
            if load is entry.load:
                packed.gen = entry.gen
                entry.waiting -= 1
                if entry.waiting == 0:
                    entry.load = None
        if self.events is not None:
            self.events.append(("unpack", entry.name))
        load.fence()
        out = load.result()
        if not packed.whole:
            storage = out.untyped_storage()
            dtype, size, stride = packed.layout
            out = torch.empty(0, dtype=dtype, device=entry.device)
            out.set_(storage, packed.offset, size, stride)
        if packed.spec is not None:
            # Loaded only when a DTensor was packed, so torch.distributed is imported already.
            from torch.distributed.tensor import DTensor

            return DTensor(out, packed.spec, requires_grad=False)
        return out

    def _handle_died(self, packed: _Swapped) -> None:
        """A saved-tensor slot freed its handle: settle the reload and the host buffer."""
        entry = packed.entry
        with self._lock:
            entry.refs -= 1
            load = entry.load
            if load is not None and packed.gen != entry.gen:
                entry.waiting -= 1
                if entry.waiting == 0:
                    entry.load = None
                    if not entry.engine.capturing():
                        load.fence()
            if entry.refs == 0:
                self._release(entry)

    def _release(self, entry: _Entry) -> None:
        """The last handle died: free the source once ordered, pool the host buffer.

        Nothing here blocks the host: the stream that produced the source waits for its
        copy still in flight, compute for a reload, and the next offload into the
        buffer waits for its last users.
        """
        buf, entry.buf = entry.buf, None
        if buf is None:
            return
        entry.host = None
        last_use = (entry.offload,) if entry.load is None else (entry.offload, entry.load)
        if not entry.engine.capturing():
            if not entry.offload.done():
                entry.offload.fence()
            entry.offload.release_source()
            if entry.load is not None:
                entry.load.fence()
        entry.load = None
        self._pool.release(buf, last_use)
