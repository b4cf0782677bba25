"""One detector of earlier transforms, so the rewrite and the pass plan see the same facts
and raise the same error for them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import graphswap
from graphswap import passes
from graphswap.rewriting.transforms import Transform, find_transforms, shown_by
from graphswap.runtime import SwapManager, swap_wrapper
from graphswap.train.config import TrainerConfig

Model = Callable[..., nn.Module]


def composable_checkpoint(model: nn.Module) -> None:
    from torch.distributed._composable import checkpoint

    checkpoint(model.model.layers[1])


def checkpoint_wrapper(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model.model.layers[1] = checkpoint_wrapper(model.model.layers[1])


def hf_gradient_checkpointing(model: nn.Module) -> None:
    # transformers 5.23 renamed gradient_checkpointing_enable to activation_checkpointing_enable.
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()


def compile_layer(model: nn.Module) -> None:
    model.model.layers[1] = torch.compile(model.model.layers[1], backend="eager")


def swap_wrap(model: nn.Module) -> None:
    swap_wrapper(model.model.layers[1].self_attn, manager=SwapManager())


TRANSFORMS = {
    "composable checkpoint": (composable_checkpoint, Transform.CHECKPOINT, "model.layers.1"),
    "checkpoint_wrapper": (checkpoint_wrapper, Transform.CHECKPOINT, "model.layers.1"),
    "HF gradient checkpointing": (hf_gradient_checkpointing, Transform.CHECKPOINT, "model"),
    "torch.compile": (compile_layer, Transform.COMPILE, "model.layers.1"),
    "swap_wrapper": (swap_wrap, Transform.SWAP, "model.layers.1.self_attn"),
}


@pytest.mark.parametrize("name", TRANSFORMS)
def test_each_transform_is_found_where_it_was_applied(tiny_model: Model, name: str) -> None:
    apply, kind, fqn = TRANSFORMS[name]
    model = tiny_model(num_hidden_layers=2)
    assert find_transforms(model) == ()
    apply(model)
    first = find_transforms(model)[0]
    assert (first.kind, first.fqn) == (kind, fqn)
    assert kind in shown_by(model.get_submodule(fqn))


@pytest.mark.parametrize("name", ["composable checkpoint", "checkpoint_wrapper", "torch.compile"])
def test_rewrite_and_the_plan_refuse_the_same_fact_with_the_same_error(
    tiny_model: Model, name: str
) -> None:
    """The swap excludes checkpointing and must precede compile: whichever entry point a
    user takes, the transformed model is refused with ``AlreadyTransformedError`` and
    left as it was."""
    apply = TRANSFORMS[name][0]
    for entry in (
        lambda m: graphswap.rewrite(m, "qwen3_attn_swap"),
        lambda m: passes.apply_model_infrastructure(m, TrainerConfig(activation_swap="attention")),
    ):
        model = tiny_model(num_hidden_layers=2)
        apply(model)
        with pytest.raises(graphswap.errors.AlreadyTransformedError, match=r"'model\.layers\.1'"):
            entry(model)
        assert not any(t.kind is Transform.SWAP for t in find_transforms(model))


def test_fsdp_parameters_are_not_mistaken_for_tensor_parallel(
    tiny_model: Model, world: None
) -> None:
    from torch.distributed.fsdp import fully_shard

    model = tiny_model(num_hidden_layers=1)
    fully_shard(model)
    assert {t.kind for t in find_transforms(model)} == {Transform.FSDP}


def test_tensor_parallel_shows_as_sharded_parameters(tiny_model: Model, world: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from graphswap.passes.tensor_parallel import apply_tensor_parallel

    model = tiny_model(num_hidden_layers=1)
    apply_tensor_parallel(model, init_device_mesh("cpu", (1,)))
    traces = find_transforms(model)
    assert {t.kind for t in traces} == {Transform.SHARDED}
    assert str(traces[0]).startswith("parameter 'model.layers.0.self_attn.q_proj.weight' is a")
