"""The head-sharding plan across families: which attentions it shards, and the refusal,
naming ``tp_size``, of those it cannot (checked from the config, before a build)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from graphswap.hf.checkpoints import build_model
from graphswap.passes import PassRequirementError
from graphswap.passes.tensor_parallel import apply_tensor_parallel, check_head_layout
from graphswap.planning import PlanSettingError, plan_memory
from graphswap.planning.trace import StepShape
from graphswap.train.config import TrainerConfig
from graphswap.train.preflight import check_model

REFUSED = {
    "tiny-deepseek-v3": "DeepseekV3Attention has no q_proj, k_proj, v_proj projection",
    "tiny-gpt-oss": "GptOssAttention holds sinks itself, one value per head",
    "tiny-olmoe": "OlmoeAttention.q_norm normalizes across all heads (width 64, head_dim 16)",
}
"""Multi-head latent attention, per-head sinks, a q/k norm over all heads."""

SHARDED = ["tiny", "tiny-llama", "tiny-qwen2", "tiny-mixtral", "tiny-gemma3", "tiny-glm4-moe"]
"""Plain q/k/v/o projections, with (Qwen3-MoE, Gemma 3) or without per-head q/k norms."""


@pytest.mark.parametrize(("preset", "problem"), sorted(REFUSED.items()))
def test_an_attention_the_plan_cannot_shard_is_refused_naming_tp_size(
    preset: str, problem: str, family_config: Callable[[str, str], Any]
) -> None:
    family_config(preset, "eager")  # skips a family this transformers lacks
    with pytest.raises(PassRequirementError) as info:
        check_model(TrainerConfig(model=preset, tp_size=2, attn_implementation="eager"))
    message = str(info.value)
    assert message.startswith("tp_size: 2 shards attention heads")
    assert problem in message
    assert message.endswith("set tp_size: 1 (fsdp: true still shards parameters over the ranks)")


@pytest.mark.parametrize("preset", SHARDED)
def test_q_k_v_o_attentions_pass_the_check(
    preset: str, family_config: Callable[[str, str], Any]
) -> None:
    check_head_layout(family_config(preset, "eager"), 2)


def test_the_planner_refuses_tp_for_an_attention_it_cannot_shard(
    family_config: Callable[[str, str], Any],
) -> None:
    config = family_config("tiny-deepseek-v3", "eager")
    with pytest.raises(PlanSettingError, match=r"^tp_size=2: shards attention heads") as info:
        plan_memory(config, StepShape(seq_len=64, tp_size=2, device="cpu", dtype=torch.float32))
    assert "no q_proj, k_proj, v_proj projection" in str(info.value)


def test_an_attention_without_head_norms_shards_on_a_mesh(
    family_config: Callable[[str, str], Any], world: None
) -> None:
    """Llama has no q/k norm: the plan shards its projections and nothing else."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    model = build_model(family_config("tiny-llama", "eager"))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, mesh)
    attention = model.model.layers[0].self_attn
    assert all(
        isinstance(getattr(attention, name).weight, DTensor)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj")
    )
