"""TRL ``SFTTrainer``'s fused loss head, as the planner traces it on the meta device.

``SFTTrainer`` installs ``trl.trainer.utils.add_fused_lm_head`` on the model and calls it
with ``fused_lm_head=True``: the head projects ``[4096 tokens, 32768 vocabulary]`` tiles
into one buffer and folds each tile into per-token statistics, so no logits are kept.
On a GPU the fold is a Triton kernel that works in place, and the backward accumulates
its fp32 gradients with ``addmm(..., out_dtype=float32)``; elsewhere TRL folds in torch
ops, whose temporaries are tiles of their own. A trace on meta runs TRL's own code, with
the GPU's two steps in its place when the plan is for ``cuda``: the folds allocate
nothing (their memory-bound time, a read of each tile, is left out) and the gradient
products are summed in fp32 without an fp32 copy of the tile.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch
from torch import nn

from graphswap.errors import LossHeadError
from graphswap.hf.lora import peft_inner

FORWARD_KWARGS = {"fused_lm_head": True}
"""What ``SFTTrainer`` passes the model's forward so that the fused head runs."""
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")
"""The per-token figures ``SFTTrainer`` asks its head for (the loss, its entropy and
token-accuracy metrics): each has buffers of its own."""


def install(model: nn.Module) -> None:
    """``add_fused_lm_head(model)`` as ``SFTTrainer`` calls it, or :class:`LossHeadError`
    when TRL is missing."""
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:
        raise LossHeadError(
            "loss_head: trl plans TRL's fused head, which needs trl installed"
        ) from None
    add_fused_lm_head(model, outputs=SFT_OUTPUTS)


def installed(model: nn.Module) -> bool:
    """``model`` runs TRL's fused head: ``SFTTrainer`` installed it (``add_fused_lm_head``
    binds its forward to the instance; with ``peft_config``, to the model inside the
    ``PeftModel``)."""
    inner = peft_inner(model)[1]
    # Its name and module are the model's own forward's (functools.wraps): its code is not.
    code = getattr(getattr(inner.__dict__.get("forward"), "__func__", None), "__code__", None)
    return code is not None and code.co_name == "_fused_forward" and "trl" in code.co_filename


def _fold_in_place(*args: Any, **kwargs: Any) -> None:
    """The Triton fold's memory: none (it updates the per-token statistics in place)."""


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` summed in fp32 as CUDA runs it: no fp32 copy of ``a`` or ``b``."""
    if a.dtype in (torch.float16, torch.bfloat16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a, b)


_is_autocast_enabled = torch.is_autocast_enabled


def _no_autocast_on_meta(*args: Any) -> bool:
    """``torch.is_autocast_enabled``, answering ``False`` for meta (where torch raises)."""
    if args and args[0] == "meta":
        return False
    return _is_autocast_enabled(*args)


@contextmanager
def tracing(device: str) -> Iterator[None]:
    """TRL's head traceable on meta, as it runs on ``device`` (``cuda`` or ``cpu``)."""
    from trl.kernels import chunked_logprob

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch, "is_autocast_enabled", _no_autocast_on_meta))
        if device == "cuda":
            for name in ("_forward_tile", "_backward_tile"):
                stack.enter_context(mock.patch.object(chunked_logprob, name, _fold_in_place))
            stack.enter_context(mock.patch.object(chunked_logprob, "_addmm_fp32", _addmm_fp32))
        yield
