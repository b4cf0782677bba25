"""Per wrapped-module state: the group and the run-time refusals of its forward.

One of the runtime's objects (``_manager.py`` lists them). Here: what the manager keeps
for each wrapped module (``_Group``: module, name, index, policy; ``GroupInfo``, its
public view), the refusals of transforms that activation swap excludes (torch.compile
and torch.export, activation checkpointing, another activation offloader:
``SwapExclusionError``, I6), and a policy's bad answer. A backward captured apart from
its forward is refused by the forward (``_forward._Forward``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphswap.errors import GraphswapTypeError, SwapExclusionError
from graphswap.runtime.policy import CheckpointPolicy, SwapPolicy, policy_name

_FIXES = {
    "compile": "compile: false (by hand: call graphswap.unrewrite(model) before torch.compile)",
    "activation_checkpointing": "activation_checkpointing: false (transformers' Trainer and"
    " TRL: gradient_checkpointing=False, which TRL's SFTConfig turns on by default;"
    " activation_checkpointing=False from transformers 5.23 on; by hand: call"
    " graphswap.unrewrite(model) before enabling gradient checkpointing); to keep"
    " checkpointing, let graphswap own the recompute: activation_swap: budget (with a"
    " trainer: graphswap.train.budget.apply_budget(model, budget, args), which takes the"
    " trainer's checkpointing as whole layers recomputed inside the swap)",
    "activation_offloading": "leave the other offloader out (TRL: activation_offloading=False;"
    " graphswap already copies what the wrapped modules save to host)",
}

_OFFLOADERS = {
    ("trl.models.activation_offloading", ""): "TRL's activation offloading"
    " (activation_offloading=True)",
    ("torch.autograd.graph", "save_on_cpu."): "torch.autograd.graph.save_on_cpu",
}
"""Saved-tensor hooks that offload, by the module and qualified-name prefix of their
pack function: under them two offloaders would copy one model's activations."""


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


def _excluded() -> tuple[str, str] | None:
    """``(excluded, found)``: what the current forward runs under that activation swap
    excludes (checkpointing, another offloader), and how it was found; ``None`` if nothing."""
    if torch._C._current_graph_task_id() != -1:
        return (
            "activation_checkpointing",
            "a recomputation during backward (reentrant activation checkpointing)",
        )
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return None
    module = getattr(hooks[0], "__module__", None)
    if module == "torch.utils.checkpoint":
        return (
            "activation_checkpointing",
            "torch.utils.checkpoint (non-reentrant activation checkpointing)",
        )
    qualname = getattr(hooks[0], "__qualname__", "")
    for (where, prefix), found in _OFFLOADERS.items():
        if module == where and qualname.startswith(prefix):
            return "activation_offloading", found
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
class _Group:
    """What the manager keeps for one wrapped module, from register to unregister."""

    module: torch.nn.Module  # the wrapped module; the key of its group in the registry
    name: str  # unique within the manager: stats and errors name the module by it
    index: int  # registration order: links and schedules are sorted by it
    policy: SwapPolicy  # asked at each pack whether a tensor swaps or stays
    module_type: str  # the module's class, "module.qualname", for GroupInfo
    decide: Callable[[torch.Tensor, int], CheckpointPolicy] | None = dataclasses.field(init=False)
    """``policy.decide`` when the policy has one: it is asked ``decide(t, index)``, told
    which save of the forward ``t`` is (every pack call counts); else ``policy(t)`` is."""

    def __post_init__(self) -> None:
        decide = getattr(self.policy, "decide", None)
        self.decide = decide if callable(decide) else None


def _bad_decision(group: _Group, decision: object) -> GraphswapTypeError:
    return GraphswapTypeError(
        f"the swap policy {policy_name(group.policy)} of {group.name!r} answered {decision!r};"
        " a swap policy answers graphswap.CheckpointPolicy.MUST_SWAP or MUST_SAVE"
        " (torch.utils.checkpoint.CheckpointPolicy is another enum, for recomputation)"
    )
