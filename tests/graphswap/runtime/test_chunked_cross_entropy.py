"""The chunked projection and cross-entropy against the full one (a linear layer, fp32
logits, one cross-entropy over every row): hidden-row gradients bitwise equal, the loss
and the weight gradient within the reduction-order bound measured on this machine, the
weight gradient summed in fp32; it runs on the meta device.

Measured (2-core AVX-512 CPU, 4096 rows, hidden 128, vocabulary 32000, 512-row chunks,
every ninth target ignored): fp32 loss relative difference 0, weight gradient
max |chunked - full| / max |full| 5.0e-7; bf16 loss 9e-8, weight gradient 2.2e-3 of the
largest entry (one bf16 step where the full head's single rounding falls the other
way; norm-wise 3.9e-5), where summing the chunks in bf16 instead gives 4.3e-3
(norm-wise 2.8e-3). The bounds below leave a factor of about four.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from graphswap.errors import GraphswapTypeError, LossHeadError
from graphswap.runtime import chunked_linear_cross_entropy
from graphswap.runtime._loss_head import chunk_bounds

ROWS, HIDDEN, VOCAB, CHUNK = 1536, 64, 4096, 512
FP32_WEIGHT_BOUND = 2e-6
"""max |chunked - full| / max |full| of the weight gradient in fp32."""
BF16_WEIGHT_BOUND = 2**-8
"""The same in bf16: one bf16 step of the largest entry."""
BF16_WEIGHT_NORM_BOUND = 2e-4
"""norm |chunked - full| / norm |full| in bf16, which summing chunks in bf16 exceeds."""


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _norm_relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _inputs(dtype: torch.dtype, bias: bool = False) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).to(dtype)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    targets[::9] = -100
    extra = (torch.randn(VOCAB, generator=gen).to(dtype),) if bias else ()
    return hidden, weight, targets, *extra


def _softcap(logits: torch.Tensor) -> torch.Tensor:
    return torch.tanh(logits / 30.0) * 30.0


def _full(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    transform: object = None,
) -> tuple[torch.Tensor, ...]:
    """The full head as a Hugging Face causal LM runs it: (batch, seq) rows, fp32 mean."""
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    logits = F.linear(leaves[0].view(2, ROWS // 2, HIDDEN), *leaves[1:])
    if transform is not None:
        logits = transform(logits)  # type: ignore[operator]
    loss = F.cross_entropy(logits.float().view(-1, VOCAB), targets, ignore_index=-100)
    loss.backward()
    return loss.detach(), *(leaf.grad for leaf in leaves)


def _chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    transform: object = None,
) -> tuple[torch.Tensor, ...]:
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    total = chunked_linear_cross_entropy(
        leaves[0],
        leaves[1],
        leaves[2] if bias is not None else None,
        targets,
        chunk_size=CHUNK,
        transform=transform,  # type: ignore[arg-type]
    )
    loss = total / (targets != -100).sum()
    loss.backward()
    return loss.detach(), *(leaf.grad for leaf in leaves)


@pytest.mark.parametrize(
    ("dtype", "bound"), [(torch.float32, FP32_WEIGHT_BOUND), (torch.bfloat16, BF16_WEIGHT_BOUND)]
)
def test_hidden_gradients_are_bitwise_and_the_rest_within_the_bound(
    dtype: torch.dtype, bound: float
) -> None:
    hidden, weight, targets = _inputs(dtype)
    loss, grad_hidden, grad_weight = _full(hidden, weight, None, targets)
    chunked_loss, chunked_hidden, chunked_weight = _chunked(hidden, weight, None, targets)
    assert torch.equal(chunked_hidden, grad_hidden)
    assert float(abs(chunked_loss - loss) / loss) <= 1e-6
    assert chunked_weight.dtype == dtype
    assert _relative(chunked_weight, grad_weight) <= bound
    if dtype == torch.bfloat16:
        assert _norm_relative(chunked_weight, grad_weight) <= BF16_WEIGHT_NORM_BOUND


def test_summing_the_chunks_in_bf16_would_miss_the_bound() -> None:
    """Why the weight gradient is summed in fp32: chunk products summed in bf16 round at
    every chunk and drift past the bound the fp32 sum keeps."""
    hidden, weight, targets = _inputs(torch.bfloat16)
    _, _, grad_weight = _full(hidden, weight, None, targets)
    summed = torch.zeros_like(weight)
    count = (targets != -100).sum()
    for start, length in chunk_bounds(ROWS, CHUNK):
        rows = hidden.narrow(0, start, length)
        logits = F.linear(rows, weight).requires_grad_()
        loss = F.cross_entropy(logits.float(), targets.narrow(0, start, length), reduction="sum")
        (grad_logits,) = torch.autograd.grad(loss, logits, 1.0 / count)
        summed += grad_logits.t() @ rows
    assert _norm_relative(summed, grad_weight) > BF16_WEIGHT_NORM_BOUND


def test_a_bias_and_a_softcap_run_the_same_ops() -> None:
    hidden, weight, targets, bias = _inputs(torch.float32, bias=True)
    loss, grad_hidden, grad_weight, grad_bias = _full(hidden, weight, bias, targets, _softcap)
    chunked = _chunked(hidden, weight, bias, targets, _softcap)
    assert torch.equal(chunked[1], grad_hidden)
    assert float(abs(chunked[0] - loss) / loss) <= 1e-6
    assert _relative(chunked[2], grad_weight) <= FP32_WEIGHT_BOUND
    assert _relative(chunked[3], grad_bias) <= FP32_WEIGHT_BOUND


@pytest.mark.parametrize(("rows", "chunk"), [(1000, 333), (1024, 256), (5, 8), (0, 4), (13, 1)])
def test_chunks_are_as_few_and_as_even_as_the_size_allows(rows: int, chunk: int) -> None:
    bounds = list(chunk_bounds(rows, chunk))
    assert [start for start, _ in bounds] == [
        sum(n for _, n in bounds[:i]) for i in range(len(bounds))
    ]
    lengths = [length for _, length in bounds]
    assert sum(lengths) == rows and max(lengths) <= max(chunk, rows and 1)
    assert len(bounds) == max(1, -(-rows // chunk))
    assert max(lengths) - min(lengths) <= 1


def test_no_tensor_holds_more_logits_than_one_chunk(largest_output: Callable[[], Any]) -> None:
    hidden, weight, targets = _inputs(torch.float32)
    hidden.requires_grad_()
    weight.requires_grad_()
    with largest_output() as seen:
        chunked_linear_cross_entropy(hidden, weight, None, targets, chunk_size=CHUNK).backward()
    assert seen.largest == CHUNK * VOCAB


def test_runs_on_the_meta_device() -> None:
    hidden = torch.empty(ROWS, HIDDEN, device="meta", requires_grad=True)
    weight = torch.empty(VOCAB, HIDDEN, device="meta", requires_grad=True)
    targets = torch.empty(ROWS, dtype=torch.long, device="meta")
    loss = chunked_linear_cross_entropy(hidden, weight, None, targets, chunk_size=CHUNK)
    (loss / (targets != -100).sum()).backward()
    assert loss.shape == () and loss.dtype == torch.float32
    assert hidden.grad is not None and hidden.grad.shape == hidden.shape
    assert weight.grad is not None and weight.grad.shape == weight.shape


def test_under_autocast_the_recompute_runs_as_forward_did() -> None:
    """Backward recomputes each chunk under the autocast forward ran under: the hidden
    gradients are those of the full head run under the same autocast."""
    hidden, weight, targets = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grad_hidden, _ = _full(hidden, weight, None, targets)
        chunked = _chunked(hidden, weight, None, targets)
    assert torch.equal(chunked[1], grad_hidden)
    assert float(abs(chunked[0] - loss) / loss) <= 1e-6


@pytest.mark.parametrize("size", [0, -1, True, 2.0])
def test_a_chunk_size_below_one_is_refused_naming_the_setting(size: object) -> None:
    hidden, weight, targets = _inputs(torch.float32)
    with pytest.raises(LossHeadError, match=r"^loss_head_chunk_size: must be an integer >= 1"):
        chunked_linear_cross_entropy(hidden, weight, None, targets, chunk_size=size)  # type: ignore[arg-type]


def test_rows_and_targets_must_agree() -> None:
    hidden, weight, targets = _inputs(torch.float32)
    with pytest.raises(GraphswapTypeError, match="takes hidden"):
        chunked_linear_cross_entropy(hidden, weight, None, targets[:-1], chunk_size=CHUNK)
