"""Qwen3-MoE, the family graphswap was first written for, in one place: where its
model code lives, the check that a model is one (for the ``qwen3_attn_swap`` and
``qwen3_moe_layer_swap`` rules, which target its classes by name), and its shapes:
the published checkpoints' and graphswap's own small ones.

Every other family is known through what its model class declares
(:mod:`graphswap.hf.decoder`); the presets of all families are :mod:`graphswap.hf.presets`.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch.fx
from torch import nn

from graphswap.errors import HierarchyError
from graphswap.hf.lora import peft_inner

MODEL_TYPE = "qwen3_moe"
"""The family's ``model_type`` in a Hugging Face config."""
MODELING = "transformers.models.qwen3_moe.modeling_qwen3_moe"
"""The module of its model classes, imported when a rule runs, never on import."""


def qwen3_moe_class(root: nn.Module, class_name: str, *, rule: str) -> type:
    """Qwen3-MoE's class ``class_name``, once ``root`` is a Qwen3-MoE model (or a traced
    one, or a PEFT model holding one): a ``rule`` that targets its classes by name
    refuses any other model, naming what it got."""
    module = importlib.import_module(MODELING)
    root = peft_inner(root)[1]
    if not isinstance(root, (module.Qwen3MoePreTrainedModel, torch.fx.GraphModule)):
        raise HierarchyError(
            f"{rule} rewrites a Qwen3-MoE model (Qwen3MoeModel or a head class such as"
            " Qwen3MoeForCausalLM or Qwen3MoeForSequenceClassification), but the root module"
            f" ('') is {type(root).__module__}.{type(root).__qualname__}; pass the Hugging"
            " Face model itself"
        )
    return getattr(module, class_name)


QWEN3_30B_A3B: dict[str, Any] = {
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

QWEN3_235B_A22B: dict[str, Any] = {
    **QWEN3_30B_A3B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
}

TINY: dict[str, Any] = {
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

GRAPH_DEFAULT: dict[str, Any] = {**TINY, "num_hidden_layers": 48}
"""The depth of Qwen3-30B-A3B at tiny widths, for meta-device graph dumps."""
