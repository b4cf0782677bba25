"""SwapManager: per-forward swaps, layer-to-layer prefetch, bounded offload lag.

The runtime is a few objects, each owning its state, in one file each; imports point
one way (``tests/graphswap/runtime/test_import_graph.py``: no cycle, ``TYPE_CHECKING``
imports included):

- ``_manager.py`` (this file): ``SwapManager``, what users hold: options and their
  validation, pickling, the registry of wrapped modules, prefetch links and the schedule,
  stats, and ``run_forward``, which records a forward and installs the saved-tensor hooks.
- ``_context.py``: ``_Context``, what every forward of one manager shares (copy engines,
  host pool, offloads in flight, lock, capture flag) and the module boundary.
- ``_forward.py``: ``_Forward``, one forward call of a wrapped module, which is its pack
  hook and the dict of its offloads, and owns their release, its prefetch and its
  backward begin.
- ``_handles.py``: per-tensor handles (a kept tensor's tuple, ``_Swapped``, ``_Entry``),
  the in-place check (``SwapIntegrityError``), reloads, unpack (``unpack_hook``) and
  lifetimes.
- ``_group.py``: per wrapped-module records (``_Group``, ``GroupInfo``) and the refusals of
  compile, export, activation checkpointing and other offloaders (``SwapExclusionError``).

Autograd's hooks are the forward itself (``_Forward``, the pack hook) and a plain
function (``unpack_hook``), so no object is made per forward for them and no extra call
per pack or unpack.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from graphswap import _compat
from graphswap.errors import GraphswapDeprecationWarning, SwapSetupError
from graphswap.runtime._context import _Context
from graphswap.runtime._engines import CopyEngine
from graphswap.runtime._forward import _Forward
from graphswap.runtime._group import GroupInfo, _excluded, _Group, _refuse, _refuse_traced
from graphswap.runtime._handles import unpack_hook
from graphswap.runtime._pool import HostPool, check_host_bytes, default_max_host_bytes
from graphswap.runtime._stats import GroupStats, SwapStats
from graphswap.runtime.policy import SwapPolicy, policy_name

__all__ = ["SwapManager"]

_task_id = torch._C._current_graph_task_id
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
"""What every wrapped forward asks first (``_group._excluded``), read once here."""


def _check_int(name: str, value: object, minimum: int, alternative: str = "") -> int:
    """An int, not a bool (``True`` would pass as 1) nor a string of one."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SwapSetupError(f"{name} must be an int >= {minimum}{alternative}, got {value!r}")
    return value


def _check_bool(name: str, value: object) -> bool:
    """True or False: any other value would be taken by its truth (``"no"`` is true)."""
    if not isinstance(value, bool):
        raise SwapSetupError(f"{name} must be True or False, got {value!r}")
    return value


class SwapManager:
    """Owns the swap of one model's wrapped modules: links, copy engine, host pool, stats.

    ``swap_prefetch_depth``: how many earlier layers start coming back when a layer's
    backward begins. ``keep_last``: the end of a linked chain keeps its tensors on
    device, since its backward starts right after forward. ``max_host_bytes``: cap of
    the host pool (default: this rank's share of the memory its container or node
    allows, :func:`~graphswap.runtime.default_max_host_bytes`); past it tensors stay on
    device and ``pool_exhausted`` counts them. ``swap_offload_lag``: a layer's swapped
    storages leave device memory no later than when the forward of the wrapped module
    ``swap_offload_lag`` forwards later begins (0: at the end of its own forward); the
    stream that produced the tensor waits for the copy there, the host never blocks.
    ``engine``: the copy engine (default: ``AcceleratorCopyEngine`` for accelerator
    tensors, ``NoOpAccelerator`` for CPU tensors, where nothing needs ordering; pass a
    ``graphswap.runtime.sim.SimulatedAccelerator`` to have every ordering hazard checked,
    as tests do).

    Every forward of a wrapped module is recorded on its own, linked to the forward
    its prev module ran last, so several forwards before one backward (gradient
    accumulation with all graphs alive) prefetch within their own pass.

    The options are spelled as the trainer config's keys and the planner's
    :class:`~graphswap.planning.trace.SwapSchedule` fields; 0.2.0's names
    (``prefetch_depth=``, ``offload_lag=``) warn and work until 0.3.
    """

    @_compat.renamed_kwargs(**_compat.RENAMED_SWAP_OPTIONS)
    def __init__(
        self,
        *,
        swap_prefetch_depth: int = 1,
        keep_last: bool = True,
        max_host_bytes: int | None = None,
        swap_offload_lag: int = 1,
        engine: CopyEngine | None = None,
    ) -> None:
        # Options (kept by pickling): see the class docstring. The prefetch depth and the
        # offload lag are the context's, which the forwards read.
        depth = _check_int("swap_prefetch_depth", swap_prefetch_depth, 1)
        lag = _check_int("swap_offload_lag", swap_offload_lag, 0)
        if engine is not None and not isinstance(engine, CopyEngine):
            raise SwapSetupError(
                f"engine must be a graphswap.runtime CopyEngine (AcceleratorCopyEngine,"
                f" NoOpAccelerator or SimulatedAccelerator), got {type(engine).__name__}"
            )
        self.keep_last = _check_bool("keep_last", keep_last)
        # Pinned host buffers the offloads copy into, capped at ``max_host_bytes``.
        pool = HostPool(
            default_max_host_bytes()
            if max_host_bytes is None
            else check_host_bytes(
                _check_int("max_host_bytes", max_host_bytes, 0, " (or None: a share of the node)")
            )
        )
        # What every forward and handle of this manager shares: the pool, the engines
        # (``engine``; None: each device's own), the offloads in flight, the lock, the
        # capture flag, the forward count.
        self._ctx = _Context(pool, engine, depth, lag)
        self._groups: dict[torch.nn.Module, _Group] = {}  # the registry: wrapped module -> group
        self._registered = 0  # registrations so far: the next group's index
        self._prev: dict[torch.nn.Module, torch.nn.Module] = {}  # links: later -> earlier
        self._next: dict[torch.nn.Module, torch.nn.Module] = {}  # links: earlier -> later
        # The forward each module ran last: the ``prev`` of its next module's next forward.
        self._latest: dict[torch.nn.Module, weakref.ref[_Forward]] = {}
        self._stats: dict[str, GroupStats] = {}  # per group name; outlives unregister

    @property
    def swap_prefetch_depth(self) -> int:
        """How many earlier layers come back when a layer's backward begins."""
        return self._ctx.swap_prefetch_depth

    @property
    def swap_offload_lag(self) -> int:
        """Forwards after which a layer's swapped storages have left device memory."""
        return self._ctx.swap_offload_lag

    # 0.2.0's names of the two options, readable until 0.3.
    prefetch_depth = _compat.Renamed("swap_prefetch_depth")
    offload_lag = _compat.Renamed("swap_offload_lag")

    def __getstate__(self) -> dict[str, Any]:
        """Options, wrapped modules and links; a copy starts with fresh stats, pool and engines."""
        return {
            "options": {
                "swap_prefetch_depth": self.swap_prefetch_depth,
                "keep_last": self.keep_last,
                "max_host_bytes": self._ctx.pool.max_bytes,
                "swap_offload_lag": self.swap_offload_lag,
                "engine": self._ctx.engine_override,
            },
            "groups": [
                (s.module, s.name, s.index, s.policy, s.module_type) for s in self._groups.values()
            ],
            "registered": self._registered,
            "links": list(self._next.items()),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = _compat.manager_state(state)  # an older version's, converted with a warning
        self.__init__(**state["options"])  # type: ignore[misc]
        for module, name, index, policy, module_type in state["groups"]:
            self._groups[module] = _Group(module, name, index, policy, module_type)
            self._stats[name] = GroupStats()
        self._registered = state["registered"]
        for prev, nxt in state["links"]:
            self._next[prev] = nxt
            self._prev[nxt] = prev

    def register(self, module: torch.nn.Module, name: str | None, policy: SwapPolicy) -> str:
        """Called by ``swap_wrapper``; ``name`` defaults to the class name and a counter.
        Returns the name registered."""
        cls = type(module)
        name = name or f"{cls.__name__}_{self._registered}"
        if module in self._groups:
            raise SwapSetupError(f"module {name!r} is already registered with this SwapManager")
        if any(group.name == name for group in self._groups.values()):
            raise SwapSetupError(
                f"a module named {name!r} is already registered; pass a unique name"
            )
        self._groups[module] = _Group(
            module, name, self._registered, policy, f"{cls.__module__}.{cls.__qualname__}"
        )
        self._registered += 1
        self._stats[name] = GroupStats()
        return name

    def unregister(self, module: torch.nn.Module) -> None:
        """Forget ``module`` and its links. Its stats stay readable, what it did while
        wrapped, until a module is registered under its name again and starts at zero."""
        del self._groups[module]
        for a, b in list(self._next.items()):
            if module in (a, b):
                del self._next[a], self._prev[b]
        self._latest.pop(module, None)

    def link(self, earlier: torch.nn.Module, later: torch.nn.Module) -> None:
        """Link two wrapped modules, ``earlier`` before ``later`` in forward order: when the
        backward of ``later`` begins, ``earlier``'s tensors start coming back (in FSDP2's
        words, a backward prefetch)."""
        for role, module in (("earlier", earlier), ("later", later)):
            if module not in self._groups:
                raise SwapSetupError(
                    f"{role} module {type(module).__name__} is not swap-wrapped by this manager;"
                    " call swap_wrapper(module, manager=manager) first"
                )
        if earlier is later:
            raise SwapSetupError("a module cannot prefetch itself; link it to another module")
        if earlier in self._next or later in self._prev:
            taken = self._groups[earlier if earlier in self._next else later].name
            raise SwapSetupError(
                f"{taken!r} is already linked; each module has one prev and one next"
            )
        walk: torch.nn.Module | None = earlier
        while walk is not None:
            if walk is later:
                raise SwapSetupError(
                    "this link would close a cycle in the prefetch chain; link each module"
                    " to the next one in forward order"
                )
            walk = self._prev.get(walk)
        self._next[earlier] = later
        self._prev[later] = earlier

    def set_forward_prefetch_layer(self, earlier: torch.nn.Module, later: torch.nn.Module) -> None:
        """The origin's name of :meth:`link`."""
        warnings.warn(
            "SwapManager.set_forward_prefetch_layer is the origin's name of SwapManager.link",
            GraphswapDeprecationWarning,
            stacklevel=2,
        )
        self.link(earlier, later)

    @property
    def engine(self) -> CopyEngine | None:
        """The copy engine this manager was given; None: each device's own."""
        return self._ctx.engine_override

    @property
    def links(self) -> list[tuple[str, str]]:
        order = sorted(self._next.items(), key=lambda kv: self._groups[kv[0]].index)
        return [(self._groups[a].name, self._groups[b].name) for a, b in order]

    def is_kept(self, module: torch.nn.Module) -> bool:
        return self.keep_last and module in self._prev and module not in self._next

    def groups(self) -> list[GroupInfo]:
        return [
            GroupInfo(
                group.name,
                group.index,
                group.module_type,
                policy_name(group.policy),
                self.is_kept(m),
            )
            for m, group in self._groups.items()
        ]

    def prefetch_schedule(self) -> list[tuple[str, str]]:
        """(trigger, target) pairs, each swapped target once, in backward order.

        A target is reloaded by the first backward that reaches it: the furthest
        layer after it within ``swap_prefetch_depth`` links.
        """
        pairs = []
        for target, group in self._groups.items():
            if self.is_kept(target) or target not in self._next:
                continue
            trigger = target
            for _ in range(self.swap_prefetch_depth):
                if trigger not in self._next:
                    break
                trigger = self._next[trigger]
            pairs.append((self._groups[trigger].index, group.index, trigger, target))
        pairs.sort(key=lambda p: (-p[0], -p[1]))
        return [(self._groups[t].name, self._groups[g].name) for _, _, t, g in pairs]

    @property
    def stats(self) -> SwapStats:
        pool = self._ctx.pool
        with self._ctx.lock:
            snapshot = SwapStats(
                max_host_bytes=pool.max_bytes,
                peak_host_bytes=pool.peak_in_use_bytes,
                host_reserved_bytes=pool.reserved_bytes,
                host_in_use_bytes=pool.in_use_bytes,
                per_group={k: dataclasses.replace(v) for k, v in self._stats.items()},
            )
        for group_stats in snapshot.per_group.values():
            snapshot.add(group_stats)
        return snapshot

    def count_plan_mismatch(self, name: str) -> None:
        """The policy of the module ``name`` met a save its plan chose with another shape
        or dtype, and kept it on device: counted in ``stats.plan_mismatches``."""
        with self._ctx.lock:
            self._stats[name].plan_mismatches += 1

    def count_recompute(self, name: str, tensors: int, nbytes: int) -> None:
        """A recomputed submodule of the module ``name`` dropped ``tensors`` storages of
        ``nbytes`` in one forward: counted in ``stats.recomputed_*``."""
        with self._ctx.lock:
            group_stats = self._stats[name]
            group_stats.recomputed_tensors += tensors
            group_stats.recomputed_bytes += nbytes

    def reset_stats(self) -> None:
        pool = self._ctx.pool
        with self._ctx.lock:
            for group_stats in self._stats.values():
                for f in dataclasses.fields(GroupStats):
                    setattr(group_stats, f.name, 0)
            pool.peak_in_use_bytes = pool.in_use_bytes

    def synchronize(self) -> None:
        """Block until every offload in flight completed, and free their sources."""
        self._ctx.synchronize()

    def run_forward(
        self, module: torch.nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any:
        """Run ``forward(module, *args, **kwargs)`` (the original class's forward, unbound:
        no per-call partial) under this manager's saved-tensor hooks."""
        if torch.compiler.is_compiling():  # torch.compile or torch.export traces this forward
            _refuse_traced(self._groups[module].name)
        if not torch.is_grad_enabled():
            return forward(module, *args, **kwargs)
        group = self._groups[module]
        # ``_excluded()``'s two queries inline; it names what was found only when either
        # answers (a backward running, or saved-tensor hooks installed: ours when nested).
        if _task_id() != -1 or _top_hooks(False) is not None:
            excluded = _excluded()
            if excluded is not None:
                _refuse(group.name, *excluded)
        ctx = self._ctx
        ctx.seq = seq = ctx.seq + 1
        pool = ctx.pool
        if pool.in_use_bytes == 0:
            # Nothing swapped is alive: a step boundary, outside every hook.
            with ctx.lock:
                pool.trim()
        ctx.boundary(seq)
        prev = self._prev.get(module)
        if prev is None:
            fwd = _Forward(ctx, group, seq, self._stats[group.name], False, None)
        else:
            prev_ref = self._latest.get(prev)
            fwd = _Forward(
                ctx,
                group,
                seq,
                self._stats[group.name],
                self.keep_last and module not in self._next,  # keep: is_kept(module)
                prev_ref() if prev_ref is not None else None,
            )
        self._latest[module] = weakref.ref(fwd)
        # What ``torch.autograd.graph.saved_tensors_hooks`` does, without its object and
        # calls (looked up at each forward: the planner's tracker wraps the push). The pack
        # hook is the forward itself, the unpack hook a plain function: no object per forward.
        autograd = torch._C._autograd
        autograd._push_saved_tensors_default_hooks(fwd, unpack_hook)
        try:
            out = forward(module, *args, **kwargs)
        finally:
            autograd._pop_saved_tensors_default_hooks()
        ctx.boundary(seq)
        if fwd.saves == 0:
            # Nothing saved, so no unpack will tell when this forward's backward begins.
            fwd.begin_at_outputs(out)
        return out
