"""A linear projection and cross-entropy over chunks of rows, each chunk's logits made
again in backward: no (rows x vocabulary) tensor outlives one chunk.

A language model's head turns ``N`` hidden rows into ``N x V`` logits and reduces them
to one loss; kept for backward in fp32, those logits can outweigh a decoder layer's
activations. Here forward projects ``chunk_size`` rows at a time and keeps only the
running sum of their losses; backward projects each chunk again and runs autograd over
that chunk alone, with the ops the full head runs, in the same order.

What changes the numbers, and what does not:

- Each row's logits, its log-softmax and the gradient into the hidden row come from the
  same kernels on the same row: the gradient of the hidden rows is the full head's bit
  for bit where the matrix products give each row the same result whatever rows are
  computed beside it (measured: CPU GEMMs of 12 rows or more). Chunks are of equal size
  (at most ``chunk_size``), so none is smaller than it must be.
- The loss and the weight gradient sum over chunks instead of over all rows at once:
  they differ from the full head by the order of that reduction only. The weight
  gradient is accumulated in fp32 whatever the weight's dtype, and rounded once at the
  end: summing chunk products in bf16 would round at every chunk.

Everything is shape-driven (the count of chunks is a Python int of the row count), so
the head runs on the meta device, as the planner traces a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable

from graphswap.errors import GraphswapTypeError, LossHeadError

LogitsTransform = Callable[[torch.Tensor], torch.Tensor]
"""What a model does to its logits between the projection and the loss (Gemma's
final-logit softcapping, Cohere's logit scale), written as the model writes it, so that
autograd runs the same ops in backward."""


def chunk_bounds(rows: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """``(start, length)`` of each chunk: the fewest chunks of at most ``chunk_size``
    rows, of equal length but for one row (a ragged last chunk of a few rows would run
    a matrix product of another kernel than the full head's)."""
    count = max(1, -(-rows // chunk_size))
    base, extra = divmod(rows, count)
    start = 0
    for index in range(count):
        length = base + (1 if index < extra else 0)
        yield start, length
        start += length


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype] | None:
    """The autocast state forward ran under, to run the recompute under it too; ``None``
    where the device has no autocast (meta)."""
    if not torch.amp.is_autocast_available(device_type):
        return None
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _chunk_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    transform: LogitsTransform | None,
) -> torch.Tensor:
    """The summed cross-entropy of one chunk, as Hugging Face's ``ForCausalLMLoss`` runs
    it: the model's transform in the logits' dtype, then fp32."""
    if transform is not None:
        logits = transform(logits)
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward: the fp32 sum of the rows' cross-entropies, chunk by chunk, nothing of a
    chunk kept. Backward: each chunk projected again and differentiated alone."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk_size: int,
        ignore_index: int,
        transform: LogitsTransform | None,
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start, length in chunk_bounds(hidden.shape[0], chunk_size):
            logits = F.linear(hidden.narrow(0, start, length), weight, bias)
            total = total + _chunk_loss(
                logits, targets.narrow(0, start, length), ignore_index, transform
            )
        ctx.save_for_backward(hidden, weight, targets, *(() if bias is None else (bias,)))
        ctx.chunk_size = chunk_size  # type: ignore[attr-defined]  # autograd's ctx holds anything
        ctx.ignore_index = ignore_index  # type: ignore[attr-defined]
        ctx.transform = transform  # type: ignore[attr-defined]
        ctx.autocast = _autocast_state(hidden.device.type)  # type: ignore[attr-defined]
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, *rest = ctx.saved_tensors
        bias = rest[0] if rest else None
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if need_weight
            else None
        )
        grad_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if need_bias and bias is not None
            else None
        )
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        for start, length in chunk_bounds(hidden.shape[0], ctx.chunk_size):
            rows = hidden.narrow(0, start, length).detach().requires_grad_()
            with torch.enable_grad(), _autocast(hidden.device.type, ctx.autocast):
                logits = F.linear(rows, weight, bias)
                loss = _chunk_loss(
                    logits, targets.narrow(0, start, length), ctx.ignore_index, ctx.transform
                )
                wanted = (logits, rows) if need_hidden else (logits,)
                grads = torch.autograd.grad(loss, wanted, grad)
            grad_logits = grads[0]
            if grad_hidden is not None:
                grad_hidden.narrow(0, start, length).copy_(grads[1])
            with _autocast(hidden.device.type, None):
                if grad_weight is not None:
                    # fp32 products of the logits' dtype (exact for bf16), summed in fp32.
                    used = rows.detach().to(grad_logits.dtype)
                    grad_weight.addmm_(grad_logits.t().float(), used.float())
                if grad_bias is not None:
                    grad_bias.add_(grad_logits.float().sum(0))
            del logits, loss, grads, grad_logits
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None or bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


class _autocast:
    """Autocast as ``state`` says (``None``: off, or no autocast on the device)."""

    def __init__(self, device_type: str, state: tuple[bool, torch.dtype] | None) -> None:
        self._mode: torch.autocast | None = None
        if torch.amp.is_autocast_available(device_type):
            enabled, dtype = state if state is not None else (False, None)
            self._mode = torch.autocast(device_type, dtype=dtype, enabled=enabled)

    def __enter__(self) -> None:
        if self._mode is not None:
            self._mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    ignore_index: int = -100,
    transform: LogitsTransform | None = None,
) -> torch.Tensor:
    """``cross_entropy(transform(linear(hidden, weight, bias)).float(), targets,
    reduction="sum")`` over ``chunk_size`` rows at a time, as an fp32 scalar; the caller
    divides it (by the count of targets that are not ``ignore_index``, or by
    ``num_items_in_batch``) as the model's own loss does, so that autograd scales the
    gradient by the same ops.

    ``hidden``: ``(rows, hidden)``; ``targets``: ``(rows,)`` integer class indices.
    ``transform``: what the model does to its logits before the loss, run on each chunk.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise LossHeadError(
            f"loss_head_chunk_size: must be an integer >= 1 (tokens per chunk of the loss"
            f" head), got {chunk_size!r}"
        )
    if hidden.dim() != 2 or targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        raise GraphswapTypeError(
            f"chunked_linear_cross_entropy takes hidden (rows, hidden) and targets (rows,),"
            f" got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    # torch leaves Function.apply unannotated
    loss: torch.Tensor = _ChunkedLinearCrossEntropy.apply(  # type: ignore[no-untyped-call]
        hidden, weight, bias, targets, chunk_size, ignore_index, transform
    )
    return loss
