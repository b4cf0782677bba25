"""Model shapes written out in code, so that nothing is ever downloaded.

Each preset names its Hugging Face family (``model_type``) and the config values that
differ from that family's defaults. The full-size presets copy the published
``config.json`` of the checkpoint their :class:`Preset` names (the fields that set
shapes; rope settings, which change none, may be left at the family's default); the small ones
keep each family's layout (attention, MoE routing, MLA, sliding windows) at widths that
train on a laptop CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from graphswap.errors import GraphswapError
from graphswap.hf import qwen3_moe

if TYPE_CHECKING:
    from transformers import PretrainedConfig, Qwen3MoeConfig

_LLAMA_3_1_8B: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

_QWEN3_32B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

_MIXTRAL_8X7B: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "sliding_window": None,
}

_DEEPSEEK_V3: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
}

_DENSE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
}
"""The tiny presets' common shape: at batch 2 x seq 512 in float32 eager attention saves
8 MiB of probabilities per layer, above the 1 MiB swap threshold."""

_MOE: dict[str, Any] = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}

_TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("llama", _DENSE),
    "tiny-qwen2": ("qwen2", _DENSE),
    "tiny-qwen3": ("qwen3", _DENSE),
    "tiny-mistral": ("mistral", {**_DENSE, "sliding_window": 64}),
    "tiny-mixtral": ("mixtral", {**_DENSE, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "tiny-qwen2-moe": (
        "qwen2_moe",
        {**_DENSE, **_MOE, "num_experts": 4, "shared_expert_intermediate_size": 64},
    ),
    "tiny-deepseek-v3": (
        "deepseek_v3",
        {
            **{key: value for key, value in _DENSE.items() if key != "head_dim"},
            **_MOE,
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 32,
            "q_lora_rank": 48,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
        },
    ),
    "tiny-gpt-oss": (
        "gpt_oss",
        {
            **_DENSE,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 64,
            "max_position_embeddings": 131072,
        },
    ),
    "tiny-olmoe": (
        "olmoe",
        {**_DENSE, "num_experts": 4, "num_experts_per_tok": 2, "eos_token_id": 0},
    ),
    "tiny-glm4-moe": (
        "glm4_moe",
        {
            **_DENSE,
            **_MOE,
            "n_routed_experts": 4,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
        },
    ),
    "tiny-gemma3": (
        "gemma3_text",
        {
            **_DENSE,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
    ),
}


class PresetError(GraphswapError, ValueError):
    """A model preset name that is not defined, or a preset of a family the builder asked
    does not build; the message says what to use instead."""


@dataclass(frozen=True)
class Preset:
    """A named model shape: its family and the config values it sets."""

    model_type: str
    values: dict[str, Any] = field(repr=False)
    source: str = ""
    """The published config it copies; empty for graphswap's own small shapes."""


PRESETS: dict[str, Preset] = {
    "tiny": Preset(qwen3_moe.MODEL_TYPE, qwen3_moe.TINY),
    "graph-default": Preset(qwen3_moe.MODEL_TYPE, qwen3_moe.GRAPH_DEFAULT),
    "qwen3-30b-a3b": Preset(
        qwen3_moe.MODEL_TYPE, qwen3_moe.QWEN3_30B_A3B, "Qwen/Qwen3-30B-A3B config.json"
    ),
    "qwen3-235b-a22b": Preset(
        qwen3_moe.MODEL_TYPE, qwen3_moe.QWEN3_235B_A22B, "Qwen/Qwen3-235B-A22B config.json"
    ),
    "llama-3.1-8b": Preset("llama", _LLAMA_3_1_8B, "meta-llama/Llama-3.1-8B config.json"),
    "qwen3-32b": Preset("qwen3", _QWEN3_32B, "Qwen/Qwen3-32B config.json"),
    "mixtral-8x7b": Preset("mixtral", _MIXTRAL_8X7B, "mistralai/Mixtral-8x7B-v0.1 config.json"),
    "deepseek-v3": Preset("deepseek_v3", _DEEPSEEK_V3, "deepseek-ai/DeepSeek-V3 config.json"),
    **{name: Preset(model_type, values) for name, (model_type, values) in _TINY_FAMILIES.items()},
}
"""``tiny``: the CPU test and train model (Qwen3-MoE); ``graph-default``: 48 layers (the
depth of Qwen3-30B-A3B) at tiny widths, for meta-device graph dumps; ``tiny-<family>``:
one small model per supported family; the others: published checkpoints' shapes."""


def preset_names() -> list[str]:
    return sorted(PRESETS)


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise PresetError(
            f"unknown model preset {name!r}; available presets: {', '.join(preset_names())}"
        )
    return PRESETS[name]


def preset_config(
    preset: str = "tiny", *, attn_implementation: str = "eager", **overrides: Any
) -> PretrainedConfig:
    """The Hugging Face config of a named preset, of its family, plus keyword overrides
    (``eager`` by default, as :func:`qwen3_moe_config`)."""
    from transformers import AutoConfig  # model code loads on first use, not on import

    chosen = _preset(preset)
    values = {**chosen.values, **overrides}
    return AutoConfig.for_model(
        chosen.model_type, attn_implementation=attn_implementation, **values
    )


def qwen3_moe_config(
    preset: str = "tiny", *, attn_implementation: str = "eager", **overrides: Any
) -> Qwen3MoeConfig:
    """Build a ``Qwen3MoeConfig`` from a named Qwen3-MoE preset plus keyword overrides.

    ``eager`` is this builder's default because the runtime's tests use its seq x seq
    attention probabilities, which pass the swap threshold at short sequences; the
    trainer (``TrainerConfig``) and ``graphswap plan-memory`` default to ``sdpa``, the
    attention people train with.
    """
    chosen = _preset(preset)
    if chosen.model_type != qwen3_moe.MODEL_TYPE:
        raise PresetError(
            f"model preset {preset!r} is a {chosen.model_type} model, not Qwen3-MoE; build it"
            " with graphswap.hf.presets.preset_config"
        )
    from transformers import Qwen3MoeConfig  # model code loads on first use, not on import

    values = {**chosen.values, **overrides}
    return Qwen3MoeConfig(attn_implementation=attn_implementation, **values)
