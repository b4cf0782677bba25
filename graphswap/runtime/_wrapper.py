"""swap_wrapper: install activation swap on a module without replacing the object.

Like FSDP2's ``fully_shard``, the module's class is swapped for a generated
subclass whose ``forward`` runs under the manager's saved-tensor hooks
(``_class_swap.ClassSwap``, which the recompute wrapper shares): the object, its
FQNs, ``state_dict`` keys and ``isinstance`` stay, and ``unwrap_swap`` restores the
exact original type. A generated class pickles as ``_swap_class(original)``; the
manager pickles its links and options, not its run-time state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from graphswap.errors import GraphswapTypeError, SwapSetupError
from graphswap.runtime._class_swap import ClassSwap, Forward
from graphswap.runtime._manager import SwapManager
from graphswap.runtime._recompute import run_recomputed
from graphswap.runtime.policy import SwapPolicy, swap_large_activations

RecomputeKwargs = Callable[
    [torch.nn.Module, dict[str, Any]], Callable[[dict[str, Any]], dict[str, Any]] | None
]
"""Told a module recomputed whole and its forward's keyword arguments before the forward
runs; returns what turns the keyword arguments the recompute is given back into those the
forward found (state the forward changes, such as a key/value cache it appends to, would
otherwise be seen changed), or ``None`` where the forward changes nothing."""


@dataclass(frozen=True)
class _SwapState:
    manager: SwapManager
    """The manager the module is registered with."""
    original_type: type
    """The class to put back on unwrap."""
    recompute: str | None = None
    """The module's name with its manager when its whole forward is recomputed in
    backward (only its inputs are saved, and swapped); ``None``: it is not."""
    recompute_kwargs: RecomputeKwargs | None = None
    """What gives the recompute the keyword arguments the forward found."""


class SwapWrapped:
    """Marker base of every generated swap class."""


def _swap_forward(original: Forward) -> Forward:
    """The forward of ``Swap<cls>``: ``original`` (``cls.forward``) run under the manager's
    hooks, or recomputed in backward when the module was wrapped with ``recompute``."""

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        state: _SwapState = self.__dict__[_CLASSES.state_attr]
        if state.recompute is not None and torch.is_grad_enabled():
            recomputed = _recomputed(
                original, state.manager, state.recompute, state.recompute_kwargs
            )
            return state.manager.run_forward(self, recomputed, args, kwargs)
        return state.manager.run_forward(self, original, args, kwargs)

    return forward


_CLASSES = ClassSwap(
    prefix="Swap",
    marker=SwapWrapped,
    state_attr="_graphswap_swap_state",
    forward=_swap_forward,
    wrapper="swap_wrapper",
)
"""The generated ``Swap<Class>`` classes and the modules' ``_SwapState``."""


@_CLASSES.bind
def _swap_class(cls: type[torch.nn.Module]) -> type:
    """``Swap<cls>``; what a pickled wrapped module rebuilds its class with."""
    return _CLASSES.generated(cls)


def _recomputed(
    original: Callable[..., Any],
    manager: SwapManager,
    name: str,
    recompute_kwargs: RecomputeKwargs | None,
) -> Callable[..., Any]:
    """``original`` run under a checkpoint inside the swap's hooks: the checkpoint's
    inputs are the module's saves, what the forward saves is made again in backward,
    from the keyword arguments as the forward found them (``recompute_kwargs``)."""
    counter = functools.partial(manager.count_recompute, name)

    def forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        restore = None if recompute_kwargs is None else recompute_kwargs(module, kwargs)
        if restore is None:
            return run_recomputed(original, module, args, kwargs, counter=counter)
        calls = 0

        def run(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return original(module, *args, **(kwargs if calls == 1 else restore(kwargs)))

        return run_recomputed(run, module, args, kwargs, counter=counter)

    return forward


def is_swap_wrapped(module: torch.nn.Module) -> bool:
    return isinstance(module, SwapWrapped)


def swap_manager_of(module: torch.nn.Module) -> SwapManager | None:
    state: _SwapState | None = _CLASSES.state(module)
    return state.manager if state is not None else None


def swap_wrapper(
    module: torch.nn.Module,
    *,
    manager: SwapManager,
    policy: SwapPolicy = swap_large_activations,
    name: str | None = None,
    recompute: bool = False,
    recompute_kwargs: RecomputeKwargs | None = None,
) -> torch.nn.Module:
    """Make ``module`` swap the tensors it saves for backward, as ``policy`` decides.

    ``recompute``: its whole forward is recomputed in backward, as activation
    checkpointing runs a layer; it saves only its inputs, and those are what it swaps
    (the recompute reloads them first, with the prefetch); ``recompute_kwargs`` gives the
    recompute the keyword arguments the forward found, where the forward changes them
    (:func:`graphswap.hf.cache.cache_as_before`: a Hugging Face layer's cache, which the
    forward appended to). Returns the same object, now
    an instance of a generated ``Swap<Class>`` subclass registered with ``manager``
    under ``name`` (default: class name and index).
    """
    if not isinstance(module, torch.nn.Module):
        raise GraphswapTypeError(f"swap_wrapper expects an nn.Module, got {type(module).__name__}")
    if is_swap_wrapped(module):
        raise SwapSetupError(
            f"{type(module).__name__} is already swap-wrapped; call unwrap_swap(module) first"
        )
    if not callable(policy):
        raise GraphswapTypeError(
            f"policy must be a callable Tensor -> CheckpointPolicy, got {policy!r}"
        )
    if recompute_kwargs is not None and not recompute:
        raise SwapSetupError(
            "swap_wrapper: recompute_kwargs is told of a recompute, and recompute=False"
            " runs none; pass recompute=True, or leave recompute_kwargs out"
        )
    cls = type(module)
    _CLASSES.generated(cls)  # refused before registering: nothing half-applied
    registered = manager.register(module, name, policy)
    _CLASSES.install(
        module, _SwapState(manager, cls, registered if recompute else None, recompute_kwargs)
    )
    return module


def unwrap_swap(module: torch.nn.Module) -> torch.nn.Module:
    """Undo ``swap_wrapper``: the original class, unregistered, links dropped."""
    state: _SwapState | None = _CLASSES.state(module)
    if state is None:
        raise SwapSetupError(f"{type(module).__name__} is not swap-wrapped; nothing to unwrap")
    state.manager.unregister(module)
    _CLASSES.remove(module, state.original_type)
    return module
