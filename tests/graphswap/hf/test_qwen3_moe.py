"""What graphswap knows about Qwen3-MoE in particular: the rules that name its classes
serve its models alone, and its small shapes keep its layout."""

from __future__ import annotations

import pytest
from torch import nn

from graphswap import rewrite
from graphswap.errors import HierarchyError, NoMatchError
from graphswap.hf import qwen3_moe
from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import preset_config, qwen3_moe_config


def test_a_qwen3_moe_model_gives_its_class_by_name() -> None:
    model = build_model(qwen3_moe_config("tiny", num_hidden_layers=1), device="meta")
    attention = qwen3_moe.qwen3_moe_class(model, "Qwen3MoeAttention", rule="qwen3_attn_swap")
    assert attention is type(model.model.layers[0].self_attn)


@pytest.mark.parametrize(
    ("rule", "found"),
    [
        ("qwen3_attn_swap", "LlamaAttention at 'model.layers.0.self_attn'"),
        ("qwen3_moe_layer_swap", "LlamaDecoderLayer at 'model.layers.0'"),
    ],
)
def test_the_qwen3_rules_find_nothing_in_another_family_and_say_what_it_holds(
    rule: str, found: str
) -> None:
    model = build_model(preset_config("tiny-llama", num_hidden_layers=1), device="meta")
    with pytest.raises(NoMatchError) as refused:
        rewrite(model, rule)
    assert f"modeling_llama.{found}" in str(refused.value)


class _Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


@pytest.mark.parametrize("rule", ["qwen3_attn_swap", "qwen3_moe_layer_swap"])
def test_a_qwen3_moe_model_inside_another_module_is_refused_as_it_was(rule: str) -> None:
    model = _Wrapper(build_model(qwen3_moe_config("tiny", num_hidden_layers=2), device="meta"))
    before = {name: type(module) for name, module in model.named_modules()}
    with pytest.raises(HierarchyError) as refused:
        rewrite(model, rule)
    message = str(refused.value)
    assert message.startswith(f"{rule} rewrites a Qwen3-MoE model")
    assert "test_qwen3_moe._Wrapper; pass the Hugging Face model itself" in message
    assert {name: type(module) for name, module in model.named_modules()} == before


def test_the_graph_default_is_the_tiny_shape_at_the_depth_of_qwen3_30b() -> None:
    depth = qwen3_moe.QWEN3_30B_A3B["num_hidden_layers"]
    assert {**qwen3_moe.TINY, "num_hidden_layers": depth} == qwen3_moe.GRAPH_DEFAULT
    config = qwen3_moe_config("graph-default")
    assert config.model_type == qwen3_moe.MODEL_TYPE
    assert config.num_hidden_layers == depth == 48
