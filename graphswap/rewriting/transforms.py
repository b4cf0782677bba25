"""What earlier transforms left on a model: one detector for the rewrite and the passes.

Exact-type rules need the untouched model, and the pass plan needs to know that a
pass it must run first was already overtaken (the origin's P2: sharded before the
swap). Both ask here, so they see the same facts. A check never imports what it looks
for: a class whose module is not loaded cannot have instances, and importing dynamo or
FSDP just to look would make the check heavy.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from graphswap.runtime import is_recompute_wrapped, is_swap_wrapped


class Transform(enum.Enum):
    """A kind of transform, in the order a refusal reports them."""

    SWAP = "swap"
    COMPILE = "compile"
    FSDP = "fsdp"
    SHARDED = "sharded"
    """DTensor parameters without FSDP: tensor, context or expert parallel."""
    CHECKPOINT = "activation_checkpointing"


@dataclass(frozen=True)
class Trace:
    """One module (or parameter) that shows a transform, and how."""

    kind: Transform
    fqn: str
    shows: str
    """What was found, completing "module <fqn> ..." (or "parameter <fqn> ...")."""

    def __str__(self) -> str:
        noun = "parameter" if self.kind is Transform.SHARDED else "module"
        return f"{noun} {self.fqn or '<root>'!r} {self.shows}"


def find_transforms(model: nn.Module) -> tuple[Trace, ...]:
    """Every trace of an earlier transform on ``model``: by kind (in :class:`Transform`
    order), then in module order."""
    traces = [
        Trace(kind, fqn, shows)
        for fqn, module in model.named_modules()
        for kind, shows in _shown(module).items()
    ]
    if not any(trace.kind is Transform.FSDP for trace in traces):
        traces.extend(_sharded_parameters(model))
    order = list(Transform)
    return tuple(sorted(traces, key=lambda trace: order.index(trace.kind)))


def shown_by(module: nn.Module) -> set[Transform]:
    """The transforms that ``module`` itself (not its children) shows; parameters
    sharded as DTensors are a fact of the tree, see :func:`find_transforms`."""
    return set(_shown(module))


def _shown(module: nn.Module) -> dict[Transform, str]:
    shown = {}
    if is_swap_wrapped(module):
        shown[Transform.SWAP] = "is already swap-wrapped"
    elif is_recompute_wrapped(module):
        shown[Transform.SWAP] = "is already recomputed by graphswap (activation_swap: budget)"
    if _isinstance(module, _loaded("torch._dynamo.eval_frame", "OptimizedModule")) or getattr(
        module, "_compiled_call_impl", None
    ):
        shown[Transform.COMPILE] = "is compiled (torch.compile)"
    if _isinstance(module, _loaded("torch.distributed.fsdp", "FSDPModule")):
        shown[Transform.FSDP] = "is already fully_shard-ed (FSDP2)"
    checkpointed = _checkpointed(module)
    if checkpointed:
        shown[Transform.CHECKPOINT] = checkpointed
    return shown


def _checkpointed(module: nn.Module) -> str | None:
    """How ``module`` recomputes in backward: torch's ``checkpoint_wrapper`` (or a
    wrapper like it), the composable ``checkpoint``, or Hugging Face gradient
    checkpointing."""
    wrapper = _loaded(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointWrapper"
    )
    if _isinstance(module, wrapper) or hasattr(module, "_checkpoint_wrapped_module"):
        return "is activation-checkpoint-wrapped"
    registry = _loaded("torch.distributed._composable.contract", "_get_registry")
    if callable(registry) and "checkpoint" in (registry(module) or {}):
        return "is activation-checkpointed (torch.distributed._composable.checkpoint)"
    if getattr(module, "gradient_checkpointing", False) is True:
        return "has Hugging Face gradient checkpointing on"
    return None


def _sharded_parameters(model: nn.Module) -> Iterator[Trace]:
    """FSDP2 turns every parameter it manages into a DTensor, so DTensor parameters
    tell of tensor/context/expert parallel only where no module is fully_shard-ed."""
    dtensor = _loaded("torch.distributed.tensor", "DTensor")
    if not isinstance(dtensor, type):
        return
    for fqn, param in model.named_parameters():
        if isinstance(param, dtensor):
            yield Trace(Transform.SHARDED, fqn, "is a DTensor: the model is already sharded")


def _loaded(module_name: str, name: str) -> object | None:
    module = sys.modules.get(module_name)
    return getattr(module, name, None) if module is not None else None


def _isinstance(module: nn.Module, cls: object | None) -> bool:
    return isinstance(cls, type) and isinstance(module, cls)
