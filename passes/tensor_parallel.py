"""Tensor parallel: shard the attention heads of every decoder layer over a 1-D mesh.

q/k/v are column-parallel and o row-parallel, so each rank computes its local heads
and one all-reduce joins them. Hugging Face attentions infer the head count from the
projection's width (``view(..., -1, head_dim)``) and only read
``num_key_value_groups``, which is unchanged when both head counts divide by
``tp_size``, so no module attribute needs rewriting. Per-head q/k norms (Qwen3, Gemma 3)
hold weights shared by all heads: they run as sequence-parallel over the head dimension
so that their gradients are summed over ranks instead of staying partial. An attention
with other weights (MLA, sinks, norms across all heads) is refused, naming ``tp_size``.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from torch import nn

from graphswap.hf.checkpoints import build_model, decoder_layers
from graphswap.hf.decoder import HEAD_NORMS, HEAD_PROJECTIONS, head_sharding_problem
from graphswap.passes.errors import PassPostconditionError, PassRequirementError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_COLWISE = HEAD_PROJECTIONS[:3]
_ROWWISE = HEAD_PROJECTIONS[3:]
_HEAD_DIM = 2
"""The head dimension of ``(batch, seq, heads, head_dim)``, where the q/k norms run."""


def check_heads_divisible(hf_config: Any, tp_size: int) -> None:
    """Refuse a ``tp_size`` that does not split the heads of ``hf_config`` (a model's
    ``config``): checked from the config alone, so before any model is built."""
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None)
    if heads is None or kv_heads is None:
        raise PassRequirementError(
            f"tp_size: {tp_size} needs model.config.num_attention_heads and"
            " num_key_value_heads to split the heads; pass a Hugging Face model"
        )
    if heads % tp_size or kv_heads % tp_size:
        fitting = [n for n in range(1, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise PassRequirementError(
            f"tp_size: {tp_size} must divide num_attention_heads ({heads}) and"
            f" num_key_value_heads ({kv_heads}); set tp_size to one of"
            f" {', '.join(map(str, fitting))}"
        )


def check_head_layout(hf_config: Any, tp_size: int) -> None:
    """Refuse a family whose attention the head-sharding plan cannot shard, from its
    config alone: one decoder layer is built on the meta device and inspected."""
    one_layer = copy.deepcopy(hf_config)
    one_layer.num_hidden_layers = 1
    one_layer._attn_implementation = "eager"  # the layout is the same; every family runs it
    if isinstance(getattr(one_layer, "layer_types", None), list):
        one_layer.layer_types = one_layer.layer_types[:1]
    check_heads_shardable(build_model(one_layer, device="meta"), tp_size)


def check_heads_shardable(model: nn.Module, tp_size: int) -> None:
    """Every decoder layer's attention is one the head-sharding plan can shard."""
    fqn, layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        problem = (
            f"{fqn}.{index} has no self_attn"
            if attention is None
            else head_sharding_problem(attention)
        )
        if problem is not None:
            raise PassRequirementError(
                f"tp_size: {tp_size} shards attention heads (q/k/v/o projections and per-head"
                f" q/k norms), but {type(model).__name__} cannot be sharded so: {problem};"
                " set tp_size: 1 (fsdp: true still shards parameters over the ranks)"
            )


def _head_norms(attention: nn.Module) -> tuple[str, ...]:
    return tuple(name for name in HEAD_NORMS if hasattr(attention, name))


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    # torch.distributed loads only when the pass runs.
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    check_heads_divisible(getattr(model, "config", None), tp_mesh.size())
    check_heads_shardable(model, tp_mesh.size())
    _, layers = decoder_layers(model)
    for layer in layers:
        plan = {
            **{name: ColwiseParallel() for name in _COLWISE},
            **{name: RowwiseParallel() for name in _ROWWISE},
            **{
                name: SequenceParallel(sequence_dim=_HEAD_DIM, use_local_output=True)
                for name in _head_norms(layer.self_attn)
            },
        }
        parallelize_module(layer.self_attn, tp_mesh, plan)
    verify_tensor_parallel(model, tp_mesh)


def verify_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard  # as in apply_tensor_parallel

    fqn, layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        expected = {
            **{name: Shard(0) for name in _COLWISE},
            **{name: Shard(1) for name in _ROWWISE},
            **{name: Replicate() for name in _head_norms(layer.self_attn)},
        }
        for name, placement in expected.items():
            weight = layer.self_attn.get_submodule(name).weight
            if not isinstance(weight, DTensor) or weight.placements != (placement,):
                found = weight.placements if isinstance(weight, DTensor) else "a plain tensor"
                raise PassPostconditionError(
                    f"after tensor_parallel {fqn}.{index}.self_attn.{name}.weight is {found},"
                    f" expected {placement} over the tp mesh (tp_size: {tp_mesh.size()})"
                )
