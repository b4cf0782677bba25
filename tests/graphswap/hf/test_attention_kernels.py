"""Which sdpa kernel a plan traces, what each one saves, and the settings it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphswap.hf.attention_kernels import (
    KERNELS,
    FusedAttentionMode,
    PlanSettingError,
    resolve_attention_kernel,
)
from graphswap.hf.presets import qwen3_moe_config
from graphswap.planning.saved_tensors import trace_saved_tensors
from graphswap.planning.trace import StepShape
from graphswap.train.cli import _memory

BATCH, HEADS, SEQ = 2, 4, 256
"""The tiny preset's query heads; a (batch, heads, seq, seq) save is the probabilities."""


@pytest.mark.parametrize(
    ("device", "dtype", "kernel"),
    [
        ("cuda", torch.bfloat16, "flash"),
        ("cuda", torch.float16, "flash"),
        ("cuda", torch.float32, "efficient"),
        ("cpu", torch.float32, "flash"),
        ("cpu", torch.bfloat16, "flash"),
    ],
)
def test_default_kernel_is_the_one_pytorch_picks_first(device, dtype, kernel) -> None:  # type: ignore[no-untyped-def]
    resolved = resolve_attention_kernel("sdpa", device=device, dtype=dtype)
    assert resolved is not None and (resolved.name, resolved.device) == (kernel, device)


def test_eager_attention_runs_no_kernel() -> None:
    assert resolve_attention_kernel("eager", device="cuda", dtype=torch.bfloat16) is None


def _attention_saves(device: str, kernel: str) -> list[tuple[tuple[int, ...], torch.dtype]]:
    trace = trace_saved_tensors(
        qwen3_moe_config("tiny", num_hidden_layers=1),
        StepShape(seq_len=SEQ, batch_size=BATCH, device=device, attn_kernel=kernel),
    )
    return [(s.shape, s.dtype) for s in trace.layers[0].saves if s.in_attention]


@pytest.mark.parametrize(
    ("device", "kernel"),
    [("cuda", "flash"), ("cuda", "efficient"), ("cuda", "cudnn"), ("cpu", "flash")],
)
def test_fused_kernels_save_the_log_sum_exp_not_the_probabilities(device, kernel) -> None:  # type: ignore[no-untyped-def]
    saves = _attention_saves(device, kernel)
    assert not any(shape == (BATCH, HEADS, SEQ, SEQ) for shape, _ in saves)
    log_sum_exp = {((BATCH, HEADS, SEQ), torch.float32), ((BATCH, HEADS, SEQ, 1), torch.float32)}
    assert log_sum_exp & set(saves)


@pytest.mark.parametrize(("device", "kernel"), [("cuda", "math"), ("cpu", "math")])
def test_math_saves_the_probabilities_in_float32(device: str, kernel: str) -> None:
    assert ((BATCH, HEADS, SEQ, SEQ), torch.float32) in _attention_saves(device, kernel)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (
            {"device": "cuda", "dtype": torch.float32, "attn_kernel": "flash"},
            ["flash on cuda runs float16 or bfloat16", "efficient, math"],
        ),
        (
            {"device": "cuda", "dtype": torch.float32, "attn_kernel": "cudnn"},
            ["cudnn on cuda runs float16 or bfloat16", "efficient, math"],
        ),
        (
            {"device": "cpu", "dtype": torch.bfloat16, "attn_kernel": "efficient"},
            ["efficient runs on cuda only", "on cpu use one of flash, math"],
        ),
        (
            {"device": "cuda", "dtype": torch.bfloat16, "attn_kernel": "flash2"},
            ["use one of flash, efficient, cudnn, math"],
        ),
        ({"device": "xpu", "dtype": torch.bfloat16}, ["use one of cuda, cpu"]),
    ],
)
def test_a_kernel_the_device_or_dtype_cannot_run_is_refused(kwargs, words) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanSettingError) as caught:
        resolve_attention_kernel("sdpa", **kwargs)
    setting = "device" if "attn_kernel" not in kwargs else "attn_kernel"
    assert caught.value.setting == setting
    for word in words:
        assert word in str(caught.value)


def test_a_kernel_with_eager_attention_would_change_nothing() -> None:
    with pytest.raises(PlanSettingError, match="use sdpa attention"):
        resolve_attention_kernel("eager", device="cuda", dtype=torch.bfloat16, attn_kernel="math")


def _qkv() -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(1, 2, 64, 16, device="meta", requires_grad=True) for _ in range(3))


def test_flash_refuses_an_attention_mask_and_efficient_takes_it_as_a_bias() -> None:
    q, k, v = _qkv()
    mask = torch.ones(64, 64, dtype=torch.bool, device="meta")
    cuda = {"device": "cuda", "dtype": torch.float32}
    flash = resolve_attention_kernel("sdpa", dtype=torch.bfloat16, device="cuda")
    with FusedAttentionMode(flash), pytest.raises(PlanSettingError, match="efficient or cudnn"):  # type: ignore[arg-type]
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with FusedAttentionMode(resolve_attention_kernel("sdpa", **cuda)):  # type: ignore[arg-type]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.grad_fn is not None
    assert out.grad_fn.name() == "ScaledDotProductEfficientAttentionBackward0"
    assert out.grad_fn._saved_attn_bias.dtype == torch.float32


def test_the_cli_offers_the_kernels_the_planner_knows() -> None:
    assert _memory.KERNELS == KERNELS


def test_values_of_another_head_size_run_math_on_cpu_and_refuse_flash_on_cuda(
    family_config,
) -> None:
    """DeepSeek-V3's latent attention: queries of 24, values of 16 per head."""
    config = family_config("tiny-deepseek-v3", "sdpa")
    on_cpu = trace_saved_tensors(config, StepShape(seq_len=64, device="cpu", dtype=torch.float32))
    shapes = [save.shape for save in on_cpu.layers[0].saves if save.in_attention]
    assert (1, 4, 64, 64) in shapes  # math saves the probabilities
    with pytest.raises(PlanSettingError, match="flash needs one head size for q, k and v"):
        trace_saved_tensors(config, StepShape(seq_len=64, device="cuda", dtype=torch.bfloat16))
    efficient = trace_saved_tensors(
        config, StepShape(seq_len=64, device="cuda", dtype=torch.bfloat16, attn_kernel="efficient")
    )
    assert efficient.kernel is not None and efficient.kernel.name == "efficient"
