"""Qwen3-MoE model shapes written out in code, so that nothing is ever downloaded.

The full-size presets copy the published ``config.json`` values of the Qwen3 MoE
checkpoints; the small ones keep the attention layout (GQA, q/k norm, rotary) at
widths that train on a laptop CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import Qwen3MoeConfig

_QWEN3_30B_A3B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "norm_topk_prob": True,
}

_QWEN3_235B_A22B: dict[str, Any] = {
    **_QWEN3_30B_A3B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
}

_TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
}

_GRAPH_DEFAULT: dict[str, Any] = {**_TINY, "num_hidden_layers": 48}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "graph-default": _GRAPH_DEFAULT,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "qwen3-235b-a22b": _QWEN3_235B_A22B,
}
"""``tiny``: the CPU test and train model; ``graph-default``: 48 layers (the depth of
Qwen3-30B-A3B) at tiny widths, for meta-device graph dumps."""


def preset_names() -> list[str]:
    return sorted(PRESETS)


def qwen3_moe_config(
    preset: str = "tiny", *, attn_implementation: str = "eager", **overrides: Any
) -> Qwen3MoeConfig:
    """Build a ``Qwen3MoeConfig`` from a named preset plus keyword overrides.

    ``eager`` is this builder's default because the runtime's tests use its seq x seq
    attention probabilities, which pass the swap threshold at short sequences; the
    trainer (``TrainerConfig``) and ``graphswap plan-memory`` default to ``sdpa``, the
    attention people train with.
    """
    if preset not in PRESETS:
        raise ValueError(
            f"unknown model preset {preset!r}; available presets: {', '.join(preset_names())}"
        )
    from transformers import Qwen3MoeConfig  # model code loads on first use, not on import

    values = {**PRESETS[preset], **overrides}
    return Qwen3MoeConfig(attn_implementation=attn_implementation, **values)
