"""Every TrainerConfig field reaches the pipeline (P1: the origin dropped a
distributed-setup argument on the way to the builder, which silently skipped the
module replacement).

Each field is listed under exactly one consumer. Fields of the passes and of the model
builder are checked by behaviour here, through ``graphswap.models.build`` (the one
path from settings to a model); fields of the training loop are checked to be read by
``graphswap.train`` or its command, whose own tests check what they do. A new field that is listed
nowhere fails ``test_every_field_has_exactly_one_consumer``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from graphswap.config import ConfigError, TrainerConfig

PASS_FIELDS: dict[str, Any] = {
    "activation_swap": "attention",
    "swap_prefetch_depth": 2,
    "swap_bandwidth_gbps": 3.0,
    "swap_tflops": 2.0,
    "swap_hide_margin": 0.25,
    "tp_size": 2,
    "cp_size": 2,
    "ep_size": 2,
    "pp_size": 2,
    "activation_checkpointing": True,
    "compile": True,
    "fsdp": True,
}
"""Consumed by ``passes.plan`` / ``apply_model_infrastructure``: field -> a changed value."""

SWAP_SETTINGS = ("swap_prefetch_depth", "swap_bandwidth_gbps", "swap_tflops", "swap_hide_margin")
"""Pass fields that tune the swap pass rather than enable a pass of their own."""

BUILDER_FIELDS = ("model", "model_path", "num_layers", "attn_implementation", "dtype")
"""Consumed by ``graphswap.models`` when it builds the Hugging Face model."""

TRAINER_FIELDS = ("seq_len", "batch_size", "steps", "lr", "device", "seed", "data", "output_dir")
"""Consumed by ``graphswap train``: the loop (``graphswap.train``) and its command."""

BASE = TrainerConfig(num_layers=1)
"""One layer keeps every build fast; ``num_layers`` itself is checked separately."""


def test_every_field_has_exactly_one_consumer() -> None:
    listed = [*PASS_FIELDS, *BUILDER_FIELDS, *TRAINER_FIELDS]
    assert sorted(listed) == sorted(set(listed)), "a field is listed under two consumers"
    missing = set(TrainerConfig.keys()) - set(listed)
    assert not missing, f"TrainerConfig fields with no consumer listed: {sorted(missing)}"
    assert set(listed) <= set(TrainerConfig.keys())


def outcome(config: TrainerConfig) -> tuple[Any, ...]:
    """What building with ``config`` produced, or the error it raised."""
    from graphswap.models import build

    torch._dynamo.reset()
    try:
        built = build(config)
    except (ValueError, NotImplementedError) as error:
        return ("raised", type(error).__name__, str(error))
    infrastructure = built.infrastructure
    manager = built.swap_manager
    return (
        infrastructure.plan.names,
        infrastructure.applied,
        None if manager is None else (manager.prefetch_depth, len(manager.links)),
        tuple(type(m).__name__ for m in built.model.modules()),
    )


@pytest.fixture(scope="module")
def base_outcome() -> Iterator[tuple[Any, ...]]:
    yield outcome(BASE)
    torch._dynamo.reset()


@pytest.mark.parametrize("field", list(PASS_FIELDS))
def test_pass_fields_change_the_result_or_raise(field: str, base_outcome: tuple[Any, ...]) -> None:
    try:
        changed = dataclasses.replace(BASE, **{field: PASS_FIELDS[field]})
    except ConfigError as error:
        assert error.key == field
        return
    result = outcome(changed)
    assert result != base_outcome
    if result[0] == "raised":
        assert field in result[2], f"the error does not name the setting {field!r}: {result[2]}"
    else:
        assert any(field == spec.setting for spec in _plan(changed).passes)


def test_swap_prefetch_depth_reaches_the_swap_manager() -> None:
    swap = dataclasses.replace(BASE, activation_swap="attention", num_layers=2)
    depth_one, depth_two = outcome(swap), outcome(dataclasses.replace(swap, swap_prefetch_depth=2))
    assert depth_one[2] == (1, 1) and depth_two[2] == (2, 1)


def test_auto_settings_reach_the_plan() -> None:
    from graphswap.models import build

    auto = {key: PASS_FIELDS[key] for key in SWAP_SETTINGS[1:]}
    config = dataclasses.replace(
        BASE, activation_swap="auto", num_layers=2, seq_len=64, batch_size=1, **auto
    )
    built = build(config)
    assert built.auto_swap is not None
    plan = built.auto_swap.plan
    assert (plan.seq, plan.batch, plan.swap) == (64, 1, "auto")
    assert (plan.bandwidth_gbps, plan.tflops, plan.hide_margin) == (3.0, 2.0, 0.25)


def test_every_pass_field_enables_its_pass() -> None:
    """The plan has one pass per setting; none of them is dropped."""
    from passes import pass_specs

    settings = {spec.setting for spec in pass_specs().values()}
    assert settings == set(PASS_FIELDS) - set(SWAP_SETTINGS)
    for field, value in PASS_FIELDS.items():
        if field not in SWAP_SETTINGS:
            config = dataclasses.replace(BASE, **{field: value})
            assert [spec.setting for spec in _plan(config).passes] == [field]


def _plan(config: TrainerConfig) -> Any:
    import passes

    return passes.plan(config)


def test_builder_fields_reach_the_model(tmp_path: Path) -> None:
    from graphswap.models import build, trainer_hf_config
    from graphswap.presets import qwen3_moe_config

    def layers(config: TrainerConfig) -> int:
        return len(build(config).model.model.layers)

    assert layers(BASE) == 1
    assert layers(dataclasses.replace(BASE, num_layers=2)) == 2
    eager = build(dataclasses.replace(BASE, attn_implementation="eager")).model
    assert eager.config._attn_implementation == "eager"
    bf16 = build(dataclasses.replace(BASE, dtype="bfloat16")).model
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    preset = trainer_hf_config(dataclasses.replace(BASE, num_layers=None, model="graph-default"))
    assert preset.num_hidden_layers == 48
    qwen3_moe_config("tiny", hidden_size=64, head_dim=16).save_pretrained(tmp_path)
    local = trainer_hf_config(dataclasses.replace(BASE, model_path=str(tmp_path)))
    assert (local.hidden_size, local.num_hidden_layers) == (64, 1)


@pytest.mark.parametrize("field", TRAINER_FIELDS)
def test_trainer_fields_are_read_by_the_training_loop(field: str) -> None:
    import graphswap.cli._train
    import graphswap.preflight
    import graphswap.train

    modules = (graphswap.train, graphswap.preflight, graphswap.cli._train)
    sources = "".join(inspect.getsource(module) for module in modules)
    assert f"config.{field}" in sources, (
        f"graphswap train never reads config.{field}; consume it or remove the field"
    )
