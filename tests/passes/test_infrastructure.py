"""apply_model_infrastructure on one process: passes run in plan order, each verified,
and a model transformed outside the plan is refused (I2, I5, I6, P2)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from graphswap import passes
from graphswap.errors import AlreadyTransformedError
from graphswap.passes import (
    PassConflictError,
    PassNotImplementedError,
    PassOrderError,
    PassPostconditionError,
    PassRequirementError,
    PassSettingError,
)
from graphswap.passes.activation_checkpointing import verify_activation_checkpointing
from graphswap.passes.compile import apply_compile, verify_compile
from graphswap.passes.fsdp import verify_fsdp
from graphswap.passes.swap import apply_swap, verify_swap
from graphswap.passes.tensor_parallel import apply_tensor_parallel
from graphswap.train.config import TrainerConfig

Model = Callable[..., nn.Module]


def loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))


def test_nothing_asked_changes_nothing(tiny_model: Model) -> None:
    model = tiny_model()
    result = passes.apply_model_infrastructure(model, TrainerConfig())
    assert result.applied == () and result.report is None and result.mesh is None
    assert result.model is model


def test_a_pass_plan_of_other_settings_is_refused(tiny_model: Model) -> None:
    """A caller's pass plan must be its config's: its passes would be another config's (I2)."""
    config = TrainerConfig(activation_swap="attention")
    with pytest.raises(PassSettingError, match=r"^pass_plan= is the pass plan of other settings"):
        passes.apply_model_infrastructure(
            tiny_model(), config, pass_plan=passes.pass_plan(TrainerConfig())
        )
    pass_plan = passes.pass_plan(config)
    result = passes.apply_model_infrastructure(tiny_model(), config, pass_plan=pass_plan)
    assert result.pass_plan is pass_plan


def test_swap_wraps_and_links_every_layer(tiny_model: Model) -> None:
    from graphswap.runtime import is_swap_wrapped, swap_manager_of

    model = tiny_model()
    config = TrainerConfig(activation_swap="attention", swap_prefetch_depth=2)
    result = passes.apply_model_infrastructure(model, config)
    assert result.applied == ("swap",) and result.pass_plan.names == ("swap",)
    assert result.report is not None
    manager = result.report.manager
    layers = model.model.layers
    assert all(is_swap_wrapped(layer.self_attn) for layer in layers)
    assert all(swap_manager_of(layer.self_attn) is manager for layer in layers)
    assert len(manager.links) == len(layers) - 1
    assert manager.swap_prefetch_depth == 2


def test_swap_post_condition_catches_an_unwrapped_layer(tiny_model: Model) -> None:
    from graphswap.runtime import unwrap_swap

    model = tiny_model()
    report = apply_swap(model)
    unwrap_swap(model.model.layers[2].self_attn)
    with pytest.raises(PassPostconditionError, match=r"model\.layers\.2\.self_attn is not swap"):
        verify_swap(model, report, swap_prefetch_depth=1)


@pytest.mark.parametrize("mode", ["layer", "auto"])
def test_whole_layer_modes_wrap_and_link_every_layer(tiny_model: Model, mode: str) -> None:
    from graphswap.runtime import is_swap_wrapped, swap_manager_of

    model = tiny_model()
    result = passes.apply_model_infrastructure(model, TrainerConfig(activation_swap=mode))  # type: ignore[arg-type]
    assert result.applied == ("swap",) and result.report is not None
    manager = result.report.manager
    layers = model.model.layers
    assert all(is_swap_wrapped(layer) and swap_manager_of(layer) is manager for layer in layers)
    assert not any(is_swap_wrapped(layer.self_attn) for layer in layers)
    assert len(manager.links) == len(layers) - 1
    assert (result.plan_executor is not None) == (mode == "auto")


def test_layer_post_condition_catches_an_unwrapped_layer(tiny_model: Model) -> None:
    from graphswap.runtime import unwrap_swap

    model = tiny_model()
    report = apply_swap(model, activation_swap="layer")
    unwrap_swap(model.model.layers[1])
    with pytest.raises(PassPostconditionError, match=r"model\.layers\.1 is not swap-wrapped"):
        verify_swap(model, report, swap_prefetch_depth=1, activation_swap="layer")


def test_activation_checkpointing_keeps_the_numbers(tiny_model: Model, ids: torch.Tensor) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    reference = loss_and_grads(tiny_model(), ids)
    model = tiny_model()
    result = passes.apply_model_infrastructure(model, TrainerConfig(activation_checkpointing=True))
    assert result.applied == ("activation_checkpointing",)
    assert all(isinstance(layer, CheckpointWrapper) for layer in model.model.layers)
    assert set(model.state_dict()) == set(tiny_model().state_dict())
    loss, grads = loss_and_grads(model, ids)
    torch.testing.assert_close(loss, reference[0], rtol=0, atol=0)
    for grad, expected in zip(grads, reference[1], strict=True):
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def test_compile_wraps_each_layer(tiny_model: Model) -> None:
    from torch._dynamo.eval_frame import OptimizedModule

    model = tiny_model()
    result = passes.apply_model_infrastructure(
        model, TrainerConfig(compile=True, activation_checkpointing=True)
    )
    assert result.applied == ("activation_checkpointing", "compile")
    assert all(isinstance(layer, OptimizedModule) for layer in model.model.layers)


def test_compiled_layers_still_run(tiny_model: Model, ids: torch.Tensor) -> None:
    """The eager backend exercises the dynamo wrapping without a C++ toolchain."""
    torch._dynamo.reset()
    reference = loss_and_grads(tiny_model(num_hidden_layers=1), ids)
    model = tiny_model(num_hidden_layers=1)
    apply_compile(model, backend="eager")
    loss, _ = loss_and_grads(model, ids)
    torch.testing.assert_close(loss, reference[0])
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("verify", "message"),
    [
        (
            verify_activation_checkpointing,
            r"model\.layers\.0 is Qwen3MoeDecoderLayer, not checkpointed",
        ),
        (verify_compile, r"after compile model\.layers\.0 is Qwen3MoeDecoderLayer, not compiled"),
        (verify_fsdp, r"not fully_shard-ed: model\.layers\.0, .*, <root>$"),
    ],
)
def test_post_conditions_refuse_a_no_op(
    tiny_model: Model, verify: Callable[[nn.Module], None], message: str
) -> None:
    with pytest.raises(PassPostconditionError, match=message):
        verify(tiny_model(num_hidden_layers=2))


@pytest.mark.parametrize(
    ("setting", "value", "name"),
    [
        ("cp_size", 2, "context_parallel"),
        ("ep_size", 2, "expert_parallel"),
        ("pp_size", 2, "pipeline_parallel"),
    ],
)
def test_declared_passes_are_never_ignored(
    tiny_model: Model, setting: str, value: int, name: str
) -> None:
    model = tiny_model(num_hidden_layers=1)
    with pytest.raises(PassNotImplementedError) as info:
        passes.apply_model_infrastructure(model, TrainerConfig(**{setting: value}))
    assert str(info.value) == (
        f"{setting}: {value} asks for {name}, which graphswap declares and checks but cannot"
        " apply yet (it applies swap, tensor_parallel, activation_checkpointing, compile,"
        f" fsdp); set {setting}: 1"
    )
    assert isinstance(info.value, NotImplementedError)


def test_every_pass_it_says_it_applies_has_its_step() -> None:
    from graphswap.passes.infrastructure import _APPLY

    assert set(_APPLY) == {spec.name for spec in passes.pass_specs().values() if spec.implemented}


def test_nothing_is_applied_when_a_later_pass_cannot_run(tiny_model: Model) -> None:
    from graphswap.runtime import is_swap_wrapped

    model = tiny_model(num_hidden_layers=1)
    with pytest.raises(PassNotImplementedError):
        passes.apply_model_infrastructure(
            model, TrainerConfig(activation_swap="attention", ep_size=2)
        )
    with pytest.raises(PassRequirementError):
        passes.apply_model_infrastructure(
            model, TrainerConfig(activation_swap="attention", fsdp=True)
        )
    assert not any(is_swap_wrapped(m) for m in model.modules())


@pytest.mark.parametrize("config", [TrainerConfig(tp_size=2), TrainerConfig(fsdp=True)])
def test_distributed_passes_need_a_world(tiny_model: Model, config: TrainerConfig) -> None:
    with pytest.raises(PassRequirementError, match=r"needs a distributed world: launch with"):
        passes.apply_model_infrastructure(tiny_model(num_hidden_layers=1), config)


def test_tp_size_must_divide_the_heads(tiny_model: Model) -> None:
    with pytest.raises(PassRequirementError) as info:
        passes.apply_model_infrastructure(tiny_model(num_hidden_layers=1), TrainerConfig(tp_size=4))
    assert str(info.value) == (
        "tp_size: 4 must divide num_attention_heads (4) and num_key_value_heads (2);"
        " set tp_size to one of 1, 2"
    )


def test_a_mesh_without_a_distributed_pass_is_refused(tiny_model: Model, world: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    with pytest.raises(PassSettingError, match=r"^a device mesh was passed but the config"):
        passes.apply_model_infrastructure(
            tiny_model(num_hidden_layers=1), TrainerConfig(), mesh=mesh
        )


def test_a_given_mesh_must_have_the_named_dimension(tiny_model: Model, world: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    with pytest.raises(PassRequirementError, match=r"needs a 'dp_shard' dimension"):
        passes.apply_model_infrastructure(
            tiny_model(num_hidden_layers=1), TrainerConfig(fsdp=True), mesh=mesh
        )


def test_build_mesh_names_the_dimensions_the_config_needs(world: None) -> None:
    assert passes.build_mesh(TrainerConfig(), device_type="cpu") is None
    mesh = passes.build_mesh(TrainerConfig(fsdp=True), device_type="cpu")
    assert mesh is not None and mesh.mesh_dim_names == ("dp_shard",) and mesh.size() == 1
    with pytest.raises(PassRequirementError) as info:
        passes.build_mesh(TrainerConfig(tp_size=2), device_type="cpu")
    assert str(info.value) == (
        "tp_size: 2 does not divide the world size 1; set tp_size to a divisor of 1"
    )


def test_fsdp_in_a_world_of_one(tiny_model: Model, world: None, ids: torch.Tensor) -> None:
    from torch.distributed.fsdp import FSDPModule

    from graphswap.runtime import is_swap_wrapped

    reference = loss_and_grads(tiny_model(), ids)[0]
    model = tiny_model()
    config = TrainerConfig(activation_swap="attention", fsdp=True)
    result = passes.apply_model_infrastructure(model, config)
    assert result.applied == ("swap", "fsdp")
    assert result.mesh is not None and result.mesh.mesh_dim_names == ("dp_shard",)
    assert isinstance(model, FSDPModule)
    assert all(is_swap_wrapped(layer.self_attn) for layer in model.model.layers)
    torch.testing.assert_close(loss_and_grads(model, ids)[0], reference, rtol=0, atol=0)


def test_sharded_before_swap_is_refused_at_apply_time(tiny_model: Model, world: None) -> None:
    """P2: the model was tensor-parallelized by hand, then handed to the plan."""
    from torch.distributed.device_mesh import init_device_mesh

    model = tiny_model(num_hidden_layers=2)
    apply_tensor_parallel(model, init_device_mesh("cpu", (1,)))
    with pytest.raises(AlreadyTransformedError) as info:
        passes.apply_model_infrastructure(model, TrainerConfig(activation_swap="attention"))
    assert str(info.value) == (
        "swap (activation_swap: attention) must run before tensor_parallel, but parameter"
        " 'model.layers.0.self_attn.q_proj.weight' is a DTensor: the model is already"
        " sharded; pass the model as built and let apply_model_infrastructure apply"
        " tensor_parallel (tp_size) after swap"
    )


def test_fully_sharded_before_swap_is_refused_at_apply_time(tiny_model: Model, world: None) -> None:
    from torch.distributed.fsdp import fully_shard

    model = tiny_model(num_hidden_layers=2)
    fully_shard(model)
    with pytest.raises(
        AlreadyTransformedError,
        match=r"^swap \(activation_swap: attention\) must run"
        r" before fsdp, but module '<root>' is already fully_shard-ed",
    ):
        passes.apply_model_infrastructure(model, TrainerConfig(activation_swap="attention"))


def test_forced_wrong_order_fails_in_the_swap_pass(tiny_model: Model, world: None) -> None:
    """Calling the passes by hand in the wrong order still cannot wrap a sharded model:
    the same fact raises the same error as through the plan."""
    from torch.distributed.device_mesh import init_device_mesh

    model = tiny_model(num_hidden_layers=2)
    apply_tensor_parallel(model, init_device_mesh("cpu", (1,)))
    with pytest.raises(
        AlreadyTransformedError,
        match=r"^parameter 'model\.layers\.0\.self_attn\.q_proj\.weight' is a DTensor: .*"
        r"'attn_swap' must run before tensor/expert/context parallel",
    ):
        apply_swap(model)


def test_excluded_transform_found_on_the_model(tiny_model: Model) -> None:
    model = tiny_model(num_hidden_layers=1)
    # transformers 5.23 renamed gradient_checkpointing_enable to activation_checkpointing_enable.
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    with pytest.raises(AlreadyTransformedError) as info:
        passes.apply_model_infrastructure(model, TrainerConfig(activation_swap="attention"))
    assert str(info.value).startswith(
        "activation_swap: attention excludes activation_checkpointing, but module"
    )
    assert str(info.value).endswith(
        "has Hugging Face gradient checkpointing on; pass the model without"
        " activation_checkpointing or set activation_swap: none"
    )


def test_precompiled_model_is_refused_for_swap(tiny_model: Model) -> None:
    model = tiny_model(num_hidden_layers=1)
    apply_compile(model, backend="eager")
    with pytest.raises(AlreadyTransformedError, match=r"must run before compile, but module"):
        passes.apply_model_infrastructure(model, TrainerConfig(activation_swap="attention"))


def test_plan_errors_reach_apply(tiny_model: Model) -> None:
    model = tiny_model(num_hidden_layers=1)
    with pytest.raises(PassConflictError, match=r"^activation_swap: attention excludes compile"):
        passes.apply_model_infrastructure(
            model, TrainerConfig(activation_swap="attention", compile=True)
        )
    assert type(model.model.layers[0]).__name__ == "Qwen3MoeDecoderLayer"


def test_a_pass_order_runs_in_its_order(tiny_model: Model) -> None:
    config = TrainerConfig(
        activation_checkpointing=True,
        compile=True,
        pass_order=("activation_checkpointing", "compile"),
    )
    model = tiny_model(num_hidden_layers=1)
    result = passes.apply_model_infrastructure(model, config)
    assert result.applied == ("activation_checkpointing", "compile")
    layer = model.model.layers[0]
    assert type(layer).__name__ == "OptimizedModule", "compile ran last: it wraps the layer"
    assert type(layer._orig_mod).__name__ == "CheckpointWrapper"


def test_a_wrong_pass_order_changes_nothing(tiny_model: Model) -> None:
    config = TrainerConfig(
        activation_checkpointing=True,
        compile=True,
        pass_order=("compile", "activation_checkpointing"),
    )
    model = tiny_model(num_hidden_layers=1)
    with pytest.raises(PassOrderError, match=r"^pass_order: activation_checkpointing \(position"):
        passes.apply_model_infrastructure(model, config)
    assert type(model.model.layers[0]).__name__ == "Qwen3MoeDecoderLayer"


@pytest.mark.compat
def test_the_result_s_0_1_plan_warns_and_is_the_pass_plan(tiny_model: Model) -> None:
    config = TrainerConfig(activation_swap="attention")
    result = passes.apply_model_infrastructure(tiny_model(), config)
    with pytest.warns(DeprecationWarning, match=r"use InfrastructureResult\.pass_plan") as caught:
        assert result.plan is result.pass_plan
    assert caught[0].filename == __file__, "the warning points at the caller's line"
