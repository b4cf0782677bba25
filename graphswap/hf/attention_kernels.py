"""The attention kernel a planner trace runs, and a mode that runs it on the meta device.

On ``meta``, ``F.scaled_dot_product_attention`` takes the math path, which saves the
seq x seq probabilities; on a GPU or a CPU the dispatcher picks a fused kernel, which
saves q, k, v, the output and the log-sum-exp. :class:`FusedAttentionMode` sends the
call to the chosen kernel's own aten op instead: autograd records that kernel's backward
node (so the trace saves what its backward needs) and the op's meta kernel gives the
output shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from graphswap.errors import GraphswapError

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
DEVICES = ("cuda", "cpu")
KERNELS = ("flash", "efficient", "cudnn", "math")

_HALF = (torch.float16, torch.bfloat16)
_ANY = (torch.float32, torch.float16, torch.bfloat16)

_SUPPORTED: dict[tuple[str, str], tuple[torch.dtype, ...]] = {
    ("cuda", "flash"): _HALF,
    ("cuda", "efficient"): _ANY,
    ("cuda", "cudnn"): _HALF,
    ("cuda", "math"): _ANY,
    ("cpu", "flash"): _ANY,
    ("cpu", "math"): _ANY,
}
"""Kernels each device runs, and their dtypes (PyTorch's sdp_utils constraints, sm80+)."""

_OPS = {
    ("cuda", "flash"): "_scaled_dot_product_flash_attention",
    ("cuda", "efficient"): "_scaled_dot_product_efficient_attention",
    ("cuda", "cudnn"): "_scaled_dot_product_cudnn_attention",
    ("cuda", "math"): "_scaled_dot_product_attention_math",
    ("cpu", "flash"): "_scaled_dot_product_flash_attention_for_cpu",
    ("cpu", "math"): "_scaled_dot_product_attention_math",
}

_FUSED_SAVES = "q, k and v (key/value heads, not repeated), the output and the log-sum-exp"
_REPEATED_SAVES = (
    "q, k and v (key/value heads repeated to the query heads: the kernel takes no grouped "
    "heads), the output and the log-sum-exp"
)
_REPEATS_KV = frozenset({"efficient", "cudnn"})
"""CUDA kernels without grouped-query attention: key and value heads are repeated first."""
_MATH_SAVES = "the seq x seq attention probabilities (float32 for 16-bit inputs)"


class PlanSettingError(GraphswapError, ValueError):
    """A planner setting that cannot be traced: names the setting, its value and what works."""

    def __init__(self, setting: str, value: object, detail: str) -> None:
        self.setting = setting
        self.value = value
        self.detail = detail
        super().__init__(f"{setting}={value!r}: {detail}")


@dataclass(frozen=True)
class AttentionKernel:
    """One sdpa kernel on one device."""

    name: str
    device: str

    @property
    def op(self) -> str:
        return f"aten.{_OPS[self.device, self.name]}"

    def describe(self) -> str:
        if self.name == "math":
            saves = _MATH_SAVES
        elif self.device == "cuda" and self.name in _REPEATS_KV:
            saves = _REPEATED_SAVES
        else:
            saves = _FUSED_SAVES
        return (
            f"attention: sdpa runs the {self.device} {self.name} kernel, traced through "
            f"{self.op}; autograd saves what its backward needs: {saves}"
        )


EAGER_ASSUMPTION = (
    "attention: eager (matmul, softmax, matmul) saves the seq x seq attention "
    "probabilities of every head"
)


def default_kernel(device: str, dtype: torch.dtype) -> str:
    """What PyTorch picks first: flash for 16-bit on CUDA, efficient for float32 on CUDA
    (flash and cuDNN run 16-bit only), the CPU flash kernel on CPU."""
    if device == "cuda" and dtype not in _HALF:
        return "efficient"
    return "flash"


def resolve_attention_kernel(
    attn_implementation: str,
    *,
    device: str,
    dtype: torch.dtype,
    attn_kernel: str | None = None,
) -> AttentionKernel | None:
    """The kernel sdpa runs for ``device`` and ``dtype`` (``None`` for eager attention).

    Raises :class:`PlanSettingError` for a device, implementation or kernel that is
    unknown, and for a kernel the device or dtype cannot run.
    """
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise PlanSettingError(
            "attn_implementation",
            attn_implementation,
            f"use one of {', '.join(ATTN_IMPLEMENTATIONS)}",
        )
    if device not in DEVICES:
        raise PlanSettingError("device", device, f"use one of {', '.join(DEVICES)}")
    if attn_implementation == "eager":
        if attn_kernel is not None:
            raise PlanSettingError(
                "attn_kernel",
                attn_kernel,
                "eager attention runs no sdpa kernel, so the kernel would change nothing; "
                "use sdpa attention or leave the kernel out",
            )
        return None
    name = default_kernel(device, dtype) if attn_kernel is None else attn_kernel
    if name not in KERNELS:
        raise PlanSettingError("attn_kernel", name, f"use one of {', '.join(KERNELS)}")
    dtypes = _SUPPORTED.get((device, name))
    if dtypes is None:
        runs = [kernel for (dev, kernel) in _SUPPORTED if dev == device]
        raise PlanSettingError(
            "attn_kernel",
            name,
            f"{name} runs on cuda only; on {device} use one of {', '.join(runs)}",
        )
    if dtype not in dtypes:
        runs = [kernel for (dev, kernel), ok in _SUPPORTED.items() if dev == device and dtype in ok]
        raise PlanSettingError(
            "attn_kernel",
            name,
            f"{name} on {device} runs {_names(dtypes)}, not {_names((dtype,))}; "
            f"with {_names((dtype,))} use one of {', '.join(runs)}, or dtype {_names(dtypes)}",
        )
    return AttentionKernel(name, device)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return " or ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)


class FusedAttentionMode(TorchFunctionMode):
    """Runs every ``F.scaled_dot_product_attention`` call through ``kernel``'s aten op,
    with the arguments PyTorch's sdpa dispatcher hands that op."""

    def __init__(self, kernel: AttentionKernel) -> None:
        super().__init__()
        self.kernel = kernel

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        aten: Any = torch.ops.aten
        name, device = self.kernel.name, self.kernel.device
        if name == "math" or (device == "cpu" and value.size(-1) != query.size(-1)):
            # The CPU flash kernel needs one head size for q, k and v; for values of
            # another (multi-head latent attention) PyTorch's CPU dispatcher runs math.
            return aten._scaled_dot_product_attention_math(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # As sdpa does before any fused kernel: a boolean mask becomes an additive one.
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
                attn_mask.logical_not(), float("-inf")
            )
        if device == "cpu":
            return aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )[0]
        if name == "flash" and value.size(-1) != query.size(-1):
            raise PlanSettingError(
                "attn_kernel",
                name,
                f"flash needs one head size for q, k and v, but this model's values have"
                f" {value.size(-1)} and its queries {query.size(-1)} (multi-head latent"
                " attention); PyTorch runs efficient there: use efficient or math",
            )
        log_sumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if name in _REPEATS_KV and key.size(-3) != query.size(-3):
            # These kernels take no grouped key/value heads: the heads are repeated first.
            groups = query.size(-3) // key.size(-3)
            key = key.repeat_interleave(groups, dim=-3)
            value = value.repeat_interleave(groups, dim=-3)
        if name == "flash":
            if attn_mask is not None:
                raise PlanSettingError(
                    "attn_kernel",
                    name,
                    "the model passes an attention mask, which flash cannot take; "
                    "use efficient or cudnn",
                )
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        if name == "efficient":
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, log_sumexp, dropout_p, is_causal, scale=scale
            )[0]
        return aten._scaled_dot_product_cudnn_attention(
            query, key, value, attn_mask, log_sumexp, dropout_p, is_causal, False, scale=scale
        )[0]
