"""recompute_wrapper: drop what a submodule saves for backward and run it again there.

The budget mode recomputes whole submodules of a decoder layer (its norms, a dense
MLP) with PyTorch's non-reentrant ``checkpoint``, inside the layer that the swap
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

As with ``swap_wrapper``, the module's class is swapped for a generated subclass:
the object, its FQNs, ``state_dict`` keys and ``isinstance`` stay, the generated
class pickles by recipe, and :func:`unwrap_recompute` restores the original type.
"""

from __future__ import annotations

import copyreg
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from graphswap.runtime.policy import is_parameter_like

_STATE_ATTR = "_graphswap_recompute_state"
_CLASS_CACHE: dict[type, type] = {}

RecomputeCounter = Callable[[int, int], None]
"""Told, once per forward of a recomputed module, the tensors and the storage bytes
its region saved (what recompute kept off the device)."""


@dataclass(frozen=True)
class _RecomputeState:
    original_type: type
    """The class to put back on unwrap."""
    counter: RecomputeCounter | None
    """Where the forward's dropped saves are counted (the swap manager's stats)."""


class RecomputeWrapped:
    """Marker base of every generated recompute class."""


class _RecomputeClassMeta(type):
    """Metaclass of the generated classes: lets them pickle by recipe, not by name."""

    _graphswap_original: type


def _reduce_recompute_class(cls: _RecomputeClassMeta) -> tuple[Any, tuple[type]]:
    return _recompute_class, (cls._graphswap_original,)


copyreg.pickle(_RecomputeClassMeta, _reduce_recompute_class)


def _counted(
    original: Callable[..., Any], counter: RecomputeCounter, inputs: set[int]
) -> Callable[..., Any]:
    """``original``, counting on its first call (the forward, not the recompute) what
    the checkpoint's hooks drop: non-parameter storages other than the inputs'."""
    done = False

    def run(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        nonlocal done
        if done:
            return original(module, *args, **kwargs)
        done = True
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        assert top is not None, "the checkpoint's hooks are on top inside its region"
        pack, unpack = top
        # Storages counted, by address: a dropped save may die inside the region and
        # its address be reused, so a weak reference tells a new storage from it.
        seen: dict[int, StorageWeakRef] = {}
        totals = [0, 0]  # tensors, bytes

        def count(t: torch.Tensor) -> Any:
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in inputs and not is_parameter_like(t):
                known = seen.get(key)
                if known is None or known.expired():
                    seen[key] = StorageWeakRef(storage)
                    totals[0] += 1
                    totals[1] += storage.nbytes()
            return pack(t)

        with torch.autograd.graph.saved_tensors_hooks(count, unpack):
            out = original(module, *args, **kwargs)
        counter(totals[0], totals[1])
        return out

    return run


def _recompute_class(cls: type) -> type:
    """``Recompute<cls>``: its forward runs the original under a non-reentrant checkpoint
    and carries the original's signature."""
    recompute_cls = _CLASS_CACHE.get(cls)
    if recompute_cls is None:
        if type(cls) is not type:
            raise TypeError(
                f"recompute_wrapper supports modules whose class has the default metaclass;"
                f" {cls.__qualname__} uses {type(cls).__qualname__}"
            )
        original = cls.forward

        @functools.wraps(original)
        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return original(self, *args, **kwargs)
            state: _RecomputeState = self.__dict__[_STATE_ATTR]
            run = original
            if state.counter is not None:
                inputs = {a.untyped_storage()._cdata for a in args if isinstance(a, torch.Tensor)}
                run = _counted(original, state.counter, inputs)
            return checkpoint(run, self, *args, use_reentrant=False, **kwargs)

        namespace = {"__module__": __name__, "forward": forward, "_graphswap_original": cls}
        recompute_cls = _RecomputeClassMeta(
            f"Recompute{cls.__name__}", (RecomputeWrapped, cls), namespace
        )
        _CLASS_CACHE[cls] = recompute_cls
    return recompute_cls


def is_recompute_wrapped(module: torch.nn.Module) -> bool:
    """``module`` is recomputed in backward by :func:`recompute_wrapper`."""
    return isinstance(module, RecomputeWrapped)


def recompute_wrapper(
    module: torch.nn.Module, *, counter: RecomputeCounter | None = None
) -> torch.nn.Module:
    """Make ``module`` drop what it saves for backward and run again there to regenerate
    it; ``counter`` is told what each forward dropped. Returns the same object, now an
    instance of a generated ``Recompute<Class>`` subclass."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"recompute_wrapper expects an nn.Module, got {type(module).__name__}")
    if is_recompute_wrapped(module):
        raise ValueError(
            f"{type(module).__name__} is already recompute-wrapped; call"
            " unwrap_recompute(module) first"
        )
    cls = type(module)
    recompute_cls = _recompute_class(cls)
    module.__dict__[_STATE_ATTR] = _RecomputeState(cls, counter)
    module.__class__ = recompute_cls
    return module


def unwrap_recompute(module: torch.nn.Module) -> torch.nn.Module:
    """Undo ``recompute_wrapper``: the original class, nothing recomputed."""
    state: _RecomputeState | None = module.__dict__.get(_STATE_ATTR)
    if state is None:
        raise ValueError(f"{type(module).__name__} is not recompute-wrapped; nothing to unwrap")
    module.__class__ = state.original_type
    del module.__dict__[_STATE_ATTR]
    return module
