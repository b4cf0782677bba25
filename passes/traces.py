"""Traces that a pass already ran on a model, so that a model transformed outside the
plan (sharded before the swap, P2) is refused at apply time instead of half-working."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def _swap(model: nn.Module) -> str | None:
    from graphswap.runtime import is_swap_wrapped

    for fqn, module in model.named_modules():
        if is_swap_wrapped(module):
            return f"module {fqn!r} is swap-wrapped"
    return None


def _fsdp(model: nn.Module) -> str | None:
    from torch.distributed.fsdp import FSDPModule

    for fqn, module in model.named_modules():
        if isinstance(module, FSDPModule):
            return f"module {fqn or '<root>'!r} is fully_shard-ed (FSDP2)"
    return None


def _sharded(model: nn.Module) -> str | None:
    """DTensor parameters without FSDP: tensor, context or expert parallel."""
    from torch.distributed.tensor import DTensor

    if _fsdp(model) is not None:
        return None
    for fqn, param in model.named_parameters():
        if isinstance(param, DTensor):
            return f"parameter {fqn!r} is a DTensor (the model is already sharded)"
    return None


def _compile(model: nn.Module) -> str | None:
    from torch._dynamo.eval_frame import OptimizedModule

    for fqn, module in model.named_modules():
        if isinstance(module, OptimizedModule) or module._compiled_call_impl is not None:
            return f"module {fqn or '<root>'!r} is compiled (torch.compile)"
    return None


def _activation_checkpointing(model: nn.Module) -> str | None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    for fqn, module in model.named_modules():
        if isinstance(module, CheckpointWrapper):
            return f"module {fqn!r} is checkpoint_wrapper-ed"
        if getattr(module, "gradient_checkpointing", False) is True:
            return f"module {fqn or '<root>'!r} has Hugging Face gradient checkpointing on"
    return None


_DETECTORS: dict[str, Callable[[nn.Module], str | None]] = {
    "swap": _swap,
    "tensor_parallel": _sharded,
    "context_parallel": _sharded,
    "expert_parallel": _sharded,
    "activation_checkpointing": _activation_checkpointing,
    "compile": _compile,
    "fsdp": _fsdp,
}
"""Pipeline parallel leaves no trace on a module tree that could be told apart."""


def find_trace(model: nn.Module, pass_name: str) -> str | None:
    """What shows that ``pass_name`` (or a pass like it) already changed ``model``."""
    detector = _DETECTORS.get(pass_name)
    return None if detector is None else detector(model)
