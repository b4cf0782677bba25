"""Which saved tensors move to host memory.

A policy is any callable ``Tensor -> CheckpointPolicy``: ``MUST_SWAP`` or ``MUST_SAVE``.
Whatever a policy answers, the runtime never swaps parameters, buffers or views of them.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphswap.errors import GraphswapTypeError, SwapSetupError

MIN_SWAP_TENSOR_BYTES = 1 << 20
"""Tensors smaller than this stay on device: below ~1 MiB a copy costs more in launch
and bookkeeping than the memory it frees."""


class CheckpointPolicy(enum.Enum):
    """What happens to one saved tensor. The name is the one the origin's users know;
    unlike ``torch.utils.checkpoint.CheckpointPolicy`` it has no recompute members,
    since graphswap never recomputes, and the runtime refuses any other answer."""

    MUST_SAVE = "must_save"
    """Keep the tensor on its device."""
    MUST_SWAP = "must_swap"
    """Copy the tensor to host memory after forward and back before its backward."""


SwapPolicy = Callable[[torch.Tensor], CheckpointPolicy]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds ``t``'s bytes on this rank: a DTensor's local shard, else
    ``t``. DTensor is looked up only once something imported it (no import cost here)."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    if dtensor_module is not None and isinstance(t, dtensor_module.DTensor):
        local: torch.Tensor = t._local_tensor
        return local
    return t


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes on this rank (a DTensor counts its local shard)."""
    local = local_tensor(t)
    return local.numel() * local.element_size()


def owns_storage(t: torch.Tensor) -> bool:
    """True when ``t`` (a DTensor: its local shard) covers its whole storage, so moving
    it frees all of it.

    A slice or a view of a larger tensor shares storage with tensors the policy
    cannot see; swapping it would copy bytes without freeing any.
    """
    t = local_tensor(t)
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return False
    if t.layout is not torch.strided:
        return False
    return t.untyped_storage().nbytes() == tensor_nbytes(t)


def _is_parameter(t: torch.Tensor) -> bool:
    """``isinstance(t, Parameter)``, without running ``Parameter``'s Python instance check
    for plain tensors: a plain tensor is a parameter only through the ``_is_param`` flag."""
    if type(t) is torch.Tensor:
        return bool(getattr(t, "_is_param", False))
    return isinstance(t, torch.nn.Parameter)


def is_parameter_like(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (``weight.t()`` as saved by ``F.linear``)."""
    if type(t) is torch.Tensor:  # _is_parameter(t), inline: this runs for every saved tensor
        if getattr(t, "_is_param", False):
            return True
    elif isinstance(t, torch.nn.Parameter):
        return True
    base = t._base
    return base is not None and _is_parameter(base)


@dataclass(frozen=True)
class _SizeThreshold:
    """A picklable policy object, so a wrapped model can be saved and deep-copied."""

    min_bytes: int
    name: str

    @property
    def __name__(self) -> str:
        return self.name

    def __call__(self, t: torch.Tensor) -> CheckpointPolicy:
        if (
            not t.requires_grad
            or t.dim() < 2
            or is_parameter_like(t)
            or not owns_storage(t)
            or tensor_nbytes(t) < self.min_bytes
        ):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_SWAP


def size_threshold_policy(
    min_bytes: int = MIN_SWAP_TENSOR_BYTES, *, name: str | None = None
) -> SwapPolicy:
    """A policy that swaps grad-requiring tensors of 2+ dims that own their storage
    and hold at least ``min_bytes`` bytes; ``name`` is how graphs and reports call it."""
    if not isinstance(min_bytes, int) or isinstance(min_bytes, bool):
        raise GraphswapTypeError(
            f"min_bytes must be an int number of bytes (e.g. 1 << 20 for 1 MiB),"
            f" got {type(min_bytes).__name__} {min_bytes!r}"
        )
    if min_bytes < 0:
        raise SwapSetupError(f"min_bytes must be >= 0, got {min_bytes}")
    return _SizeThreshold(min_bytes, name or f"size_threshold_policy({min_bytes})")


swap_large_activations: SwapPolicy = size_threshold_policy(
    MIN_SWAP_TENSOR_BYTES, name="swap_large_activations"
)
"""The default of ``swap_wrapper`` and what the attention rules move: every activation
of 1 MiB or more that owns its storage."""


def policy_name(policy: SwapPolicy) -> str:
    return getattr(policy, "__name__", type(policy).__name__)
