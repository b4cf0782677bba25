"""recompute_wrapper: drop what a submodule saves for backward and run it again there.

The budget mode recomputes submodules of a decoder layer (its norms, its feed-forward
block) with PyTorch's non-reentrant ``checkpoint``, inside the layer that the swap
wraps. Three facts of that checkpoint make the pair compose, and are why recompute is
decided per submodule rather than per tensor:

- the region's inputs are saved outside the region's hooks, so the layer's swap
  policy sees them and may move them like any other save (the recompute reloads
  them first, with the layer's prefetch);
- what the region saves goes to the checkpoint's own hooks and is dropped after
  forward, so swap never sees (and never copies) a tensor that recompute regenerates;
- the regenerated tensors are checked against the forward's by shape and dtype, the
  inputs by autograd's version counter (the in-place error), and the RNG state is
  restored before the region runs again, so the result is bitwise the forward's.

What the region saves is dropped, so autograd never unpacks it and never checks it:
a tensor the region saved and a caller then changed in place (an output kept by a
forward hook) would be regenerated from the inputs, where plain PyTorch raises. The
region's forward keeps each dropped save's version counter (an alias holding none of
its bytes), and its recompute raises the same in-place error first when one moved.

With ``save_matmuls`` only what lies between the region's matrix multiplications runs
again (activations, products, gathers, the router's softmax: memory-bound work), the
way a selective checkpoint policy that saves matmuls does. Torch's own selective
checkpoint caches what it saves inside the checkpoint, where no saved-tensor hook sees
it; here each matmul's output is handed to the hooks outside the region instead (the
layer's swap, which keeps or moves it like any save), and the recompute takes it back
from them in place of running the matmul again. With ``rerun_to_input_width`` as well,
the matmuls whose output has the width of the region's input (a feed-forward block's
down projections, back to the hidden size) are not saved: the recompute runs them
again where an operator after them saved their output (the experts' routing-weight
product), and, as the checkpoint stops once every save is regenerated, not at all
where none did (a dense block's down projection feeds the residual add only).

As with ``swap_wrapper`` (and through the same ``_class_swap.ClassSwap``), the
module's class is swapped for a generated subclass: the object, its FQNs,
``state_dict`` keys and ``isinstance`` stay, the generated class pickles as
``_recompute_class(original)``, and :func:`unwrap_recompute` restores the original type.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from graphswap.errors import (
    GraphswapTypeError,
    SwapSetupError,
    SwapStateError,
)
from graphswap.runtime._class_swap import ClassSwap, Forward
from graphswap.runtime._handles import integrity_error, version_alias
from graphswap.runtime.policy import is_parameter_like

RecomputeCounter = Callable[[int, int], None]
"""Told, once per forward of a recomputed module, the tensors and the storage bytes
its region saved (what recompute kept off the device)."""


@dataclass(frozen=True)
class _RecomputeState:
    original_type: type
    """The class to put back on unwrap."""
    counter: RecomputeCounter | None
    """Where the forward's dropped saves are counted (the swap manager's stats)."""
    save_matmuls: bool
    """Matmul outputs are saved through the outer hooks and only the operators between
    them run again."""
    rerun_to_input_width: bool
    """With ``save_matmuls``: not those whose output has the width of the region's
    first input; they run again."""


def _matmul_ops() -> frozenset[Any]:
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


_MATMULS = _matmul_ops()
"""The operators whose outputs a ``save_matmuls`` region saves: the compute-bound ones."""


def _keep(t: torch.Tensor) -> torch.Tensor:
    """The pack and unpack of a region with no hooks around it: the output stays."""
    return t


class _Packed:
    """One matmul output as the outer hooks packed it."""

    __slots__ = ("handle", "outputs")

    def __init__(self, handle: Any, output: torch.Tensor) -> None:
        self.handle = handle
        """What the outer pack hook returned."""
        self.outputs: list[tuple[weakref.ref[torch.Tensor], int]] = [
            (weakref.ref(output), output._version)
        ]
        """The output and every tensor the region made of its storage since (a linear
        layer's ``_unsafe_view`` of it, which autograd gives a version counter of its
        own: the tensor a caller holds), each weakly with its version then: what an
        in-place change would change. Below autograd, a detached alias does not share
        its version counter."""

    def watch(self, alias: torch.Tensor) -> None:
        """Check ``alias``, a tensor of the output's storage, too."""
        self.outputs.append((weakref.ref(alias), alias._version))

    def check(self) -> None:
        """Autograd's in-place error, when the output was changed since it was packed."""
        for ref, version in self.outputs:
            output = ref()
            if output is not None and output._version != version:
                raise integrity_error(
                    "a recomputed region (a matmul output)", output.size(), version, output._version
                )


_RERUN = object()
"""The entry of a matmul call whose output was not saved: the recompute runs it."""


class _SavedMatmuls:
    """One forward's matmul outputs, packed by the saved-tensor hooks that were current
    outside the region (or kept as they are when there were none)."""

    def __init__(self, rerun_width: int | None) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.pack: Callable[[torch.Tensor], Any] = _keep if top is None else top[0]
        """The outer pack hook: the layer's swap when it is wrapped."""
        self.unpack: Callable[[Any], torch.Tensor] = _keep if top is None else top[1]
        """Its unpack hook."""
        self.rerun_width = rerun_width
        """Matmul outputs this wide (the last dimension) are not saved; ``None``: all are."""
        self.packed: dict[Any, list[Any]] = {}
        """Per matmul operator, each call's output as packed (a :class:`_Packed`), in
        call order; ``_RERUN`` for a call whose output was not saved, ``None`` once the
        recompute has taken the output back."""
        self.storages: dict[int, StorageWeakRef] = {}
        """Storages of the packed outputs, by address: saves of them are not dropped by
        recompute (the weak reference tells a later storage at a reused address apart)."""
        self.by_storage: dict[int, _Packed] = {}
        """The packed output of each of those storages, by address: a tensor the region
        makes of one is checked with it."""

    def contexts(self) -> tuple[TorchDispatchMode, TorchDispatchMode]:
        """The checkpoint's ``context_fn``: one mode for the forward, one for the recompute."""
        return _SaveMatmuls(self), _ReplayMatmuls(self)


class _SaveMatmuls(TorchDispatchMode):
    """The forward: each matmul's output goes to the outer pack hook."""

    def __init__(self, saved: _SavedMatmuls) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode unannotated
        self.saved = saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func not in _MATMULS:
            if self.saved.by_storage and isinstance(out, torch.Tensor):
                key = out.untyped_storage()._cdata
                packed = self.saved.by_storage.get(key)
                if packed is not None and not self.saved.storages[key].expired():
                    packed.watch(out)
            return out
        calls = self.saved.packed.setdefault(func, [])
        if out.shape[-1] == self.saved.rerun_width:
            calls.append(_RERUN)
        else:
            # A detached alias: the same storage, but no autograd graph, which the
            # packed tensor would otherwise keep alive (nor, below autograd, the
            # output's version counter: ``_Packed`` watches the output for that). It
            # requires grad as the output will once autograd records it, so a swap
            # policy sees it as the activation it is.
            alias = out.detach()
            if torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args
            ):
                alias.requires_grad_(True)
            packed = _Packed(self.saved.pack(alias), out)
            calls.append(packed)
            storage = out.untyped_storage()
            self.saved.storages[storage._cdata] = StorageWeakRef(storage)
            self.saved.by_storage[storage._cdata] = packed
        return out


class _ReplayMatmuls(TorchDispatchMode):
    """The recompute: each matmul's output is unpacked instead of computed again."""

    def __init__(self, saved: _SavedMatmuls) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode unannotated
        self.saved = saved
        self.calls: dict[Any, int] = {}
        """Matmul calls so far in this recompute, per operator."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func not in _MATMULS:
            return func(*args, **(kwargs or {}))
        index = self.calls.get(func, 0)
        self.calls[func] = index + 1
        packed = self.saved.packed.get(func, [])
        entry = packed[index] if index < len(packed) else None
        if entry is _RERUN:
            return func(*args, **(kwargs or {}))
        if entry is None:
            raise SwapStateError(
                f"recompute_wrapper(save_matmuls=True): {func} call {index} has no saved "
                "output: the region ran other matmuls than in forward, or backward ran "
                "through it twice; recompute regions support one backward"
            )
        packed[index] = None
        entry.check()
        return self.saved.unpack(entry.handle).detach()


class RecomputeWrapped:
    """Marker base of every generated recompute class."""


class _Region:
    """What a recomputed region's checkpoint runs: ``original``, whose first call is the
    forward and every later one a recompute.

    The forward runs under hooks between the checkpoint's and its saves: they keep each
    dropped save's version counter and count the dropped storages for ``counter``. A
    recompute first raises autograd's in-place error when one of those saves was changed
    since (plain PyTorch raises there at unpack, and the recompute would otherwise
    regenerate it as it was).
    """

    __slots__ = ("counter", "kept", "original", "ran", "saves")

    def __init__(
        self,
        original: Callable[..., Any],
        counter: RecomputeCounter | None,
        kept: dict[int, StorageWeakRef],
    ) -> None:
        self.original = original  # the module's own forward
        self.counter = counter  # told the forward's dropped tensors and bytes; None: not counted
        self.kept = kept
        """Storages the checkpoint does not drop, by address (the inputs', and the saved
        matmul outputs' as they are made): not counted."""
        self.ran = False  # the forward ran: a call now is a recompute
        self.saves: list[tuple[torch.Tensor, torch.Size, int]] = []
        """Each dropped save as a version alias (its counter, none of its bytes) with its
        size and its version when saved. Parameters are not watched: torch's checkpoint recomputes
        with them as they are, and FSDP2 refills them between forward and backward."""

    def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.ran:
            for alias, size, version in self.saves:
                if alias._version != version:
                    cls = getattr(type(module), "_graphswap_original", type(module))
                    name = f"{cls.__name__} (recomputed)"
                    raise integrity_error(name, size, version, alias._version)
            return self.original(module, *args, **kwargs)
        self.ran = True
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        assert top is not None, "the checkpoint's hooks are on top inside its region"
        pack, unpack = top
        saves, kept = self.saves, self.kept
        # Storages counted, by address: a dropped save may die inside the region and its
        # address be reused, so a weak reference tells a new storage from it.
        seen: dict[int, StorageWeakRef] = {}
        totals = [0, 0]  # tensors, bytes

        def save(t: torch.Tensor) -> Any:
            if not is_parameter_like(t):
                if type(t) is torch.Tensor:
                    saves.append((version_alias(t), t.size(), t._version))
                storage = t.untyped_storage()
                key = storage._cdata
                held, known = kept.get(key), seen.get(key)
                if (held is None or held.expired()) and (known is None or known.expired()):
                    seen[key] = StorageWeakRef(storage)
                    totals[0] += 1
                    totals[1] += storage.nbytes()
            return pack(t)

        with torch.autograd.graph.saved_tensors_hooks(save, unpack):
            out = self.original(module, *args, **kwargs)
        # Autograd may keep ``save`` with each save (torch 2.9 does): the weak references
        # go now, not with the saves, so no storage outlives its region's forward for them
        # (a storage's Python object is what reports its death).
        seen.clear()
        if self.counter is not None:
            self.counter(totals[0], totals[1])
        return out


def run_recomputed(
    forward: Callable[..., Any],
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    counter: RecomputeCounter | None,
    save_matmuls: bool = False,
    rerun_to_input_width: bool = False,
) -> Any:
    """``forward(module, *args, **kwargs)`` under a non-reentrant checkpoint: what it
    saves is dropped and made again in backward (``counter`` told what was dropped), and
    a dropped save changed in place since is autograd's error there; ``save_matmuls``:
    its matmul outputs are saved through the hooks around it instead, but for those as
    wide as its first input with ``rerun_to_input_width``. What a recompute-wrapped
    module runs, and a swap-wrapped layer recomputed whole."""
    options: dict[str, Any] = {}
    kept: dict[int, StorageWeakRef] = {}
    saved: _SavedMatmuls | None = None
    if save_matmuls:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        width = first.shape[-1] if rerun_to_input_width and first is not None else None
        saved = _SavedMatmuls(width)
        options["context_fn"] = saved.contexts
        kept = saved.storages
    if counter is not None:
        for arg in args:
            if isinstance(arg, torch.Tensor):
                storage = arg.untyped_storage()
                kept[storage._cdata] = StorageWeakRef(storage)
    region = _Region(forward, counter, kept)
    try:
        return checkpoint(region, module, *args, use_reentrant=False, **options, **kwargs)
    finally:
        # Needed while the forward runs; the recompute reads none of it.
        kept.clear()
        if saved is not None:
            saved.by_storage.clear()


def _recompute_forward(original: Forward) -> Forward:
    """The forward of ``Recompute<cls>``: ``original`` (``cls.forward``) run under a
    non-reentrant checkpoint while grad is on."""

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(self, *args, **kwargs)
        state: _RecomputeState = self.__dict__[_CLASSES.state_attr]
        return run_recomputed(
            original,
            self,
            args,
            kwargs,
            counter=state.counter,
            save_matmuls=state.save_matmuls,
            rerun_to_input_width=state.rerun_to_input_width,
        )

    return forward


_CLASSES = ClassSwap(
    prefix="Recompute",
    marker=RecomputeWrapped,
    state_attr="_graphswap_recompute_state",
    forward=_recompute_forward,
    wrapper="recompute_wrapper",
)
"""The generated ``Recompute<Class>`` classes and the modules' ``_RecomputeState``."""


@_CLASSES.bind
def _recompute_class(cls: type[torch.nn.Module]) -> type:
    """``Recompute<cls>``; what a pickled wrapped module rebuilds its class with."""
    return _CLASSES.generated(cls)


def is_recompute_wrapped(module: torch.nn.Module) -> bool:
    """``module`` is recomputed in backward by :func:`recompute_wrapper`."""
    return isinstance(module, RecomputeWrapped)


def recompute_wrapper(
    module: torch.nn.Module,
    *,
    counter: RecomputeCounter | None = None,
    save_matmuls: bool = False,
    rerun_to_input_width: bool = False,
) -> torch.nn.Module:
    """Make ``module`` drop what it saves for backward and run again there to regenerate
    it; ``counter`` is told what each forward dropped. ``save_matmuls``: the outputs of
    its matrix multiplications are saved instead (through the saved-tensor hooks around
    the module: the layer's swap keeps or moves them) and only the operators between
    them run again. ``rerun_to_input_width`` (with ``save_matmuls``): but for the
    matmuls whose output is as wide as the module's first input (a feed-forward block's
    down projections), which run again where a later operator saved their output.
    Returns the same object, now an instance of a generated ``Recompute<Class>``
    subclass."""
    if not isinstance(module, torch.nn.Module):
        raise GraphswapTypeError(
            f"recompute_wrapper expects an nn.Module, got {type(module).__name__}"
        )
    if rerun_to_input_width and not save_matmuls:
        raise SwapSetupError(
            "recompute_wrapper: rerun_to_input_width chooses which matmul outputs "
            "save_matmuls saves; set save_matmuls=True with it"
        )
    if is_recompute_wrapped(module):
        raise SwapSetupError(
            f"{type(module).__name__} is already recompute-wrapped; call"
            " unwrap_recompute(module) first"
        )
    _CLASSES.install(
        module, _RecomputeState(type(module), counter, save_matmuls, rerun_to_input_width)
    )
    return module


def unwrap_recompute(module: torch.nn.Module) -> torch.nn.Module:
    """Undo ``recompute_wrapper``: the original class, nothing recomputed."""
    state: _RecomputeState | None = _CLASSES.state(module)
    if state is None:
        raise SwapSetupError(f"{type(module).__name__} is not recompute-wrapped; nothing to unwrap")
    _CLASSES.remove(module, state.original_type)
    return module
