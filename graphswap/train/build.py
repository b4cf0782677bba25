"""Build Hugging Face decoder models, of any family, from a trainer config, with the passes
it asks for.

The plain model (config, instance, weights) comes from :mod:`graphswap.hf.checkpoints`; this module
adds the infrastructure through ``graphswap.passes.apply_model_infrastructure``, so every builder
takes one path from settings to model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, get_args

import torch

from graphswap._compat import Renamed
from graphswap.hf.checkpoints import (
    build_model,
    checkpoint_dtype,
    load_hf_config,
    load_weights,
    model_config,
)
from graphswap.passes import PassPlan, apply_model_infrastructure
from graphswap.passes.pass_plan import pass_plan_of
from graphswap.planning import SwapMode
from graphswap.train.config import ConfigError, DType, TrainerConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PretrainedConfig

    from graphswap.passes import InfrastructureResult
    from graphswap.passes.plan_executor import PlanExecutor
    from graphswap.runtime import SwapManager


@dataclass(frozen=True)
class BuiltModel:
    """A model with its infrastructure applied, and what was applied."""

    model: torch.nn.Module
    infrastructure: InfrastructureResult

    @property
    def swap_manager(self) -> SwapManager | None:
        report = self.infrastructure.report
        return report.manager if report is not None else None

    @property
    def plan_executor(self) -> PlanExecutor | None:
        """``activation_swap: auto`` or ``budget``: the plan and the policies carrying it
        out (``check()`` after a step)."""
        return self.infrastructure.plan_executor

    auto_swap = Renamed("plan_executor")  # 0.2.0's name, after one of the two modes


def build(
    config: TrainerConfig,
    *,
    hf_config: PretrainedConfig | None = None,
    weights: str | Path | None = None,
    device: str | torch.device = "cpu",
    mesh: DeviceMesh | None = None,
    pass_plan: PassPlan | None = None,
) -> BuiltModel:
    """The one path from settings to a ready model: every builder goes through here.

    ``hf_config`` defaults to the preset or ``model_path`` of ``config``; ``weights``
    is a local checkpoint folder to load, by default ``model_path``: a checkpoint is
    trained from its weights, never from a random init of its shape. The
    infrastructure (swap, sharding, compile, FSDP) is applied by
    ``graphswap.passes.apply_model_infrastructure`` from the same ``config``, so a setting
    cannot be dropped on the way. ``pass_plan``: ``config``'s pass plan when the caller
    built it already; the build and the passes share one.
    """
    planned = pass_plan_of(config, pass_plan).check_runnable()  # refused before a model is built
    if hf_config is None:
        hf_config = trainer_hf_config(config)
    dtype = getattr(torch, config.dtype)
    if weights is None:
        weights = config.model_path
    if weights is not None:
        model = load_weights(weights, hf_config, dtype=dtype).to(device)
    else:
        model = build_model(hf_config, device=device, dtype=dtype)
    infrastructure = apply_model_infrastructure(model, config, mesh=mesh, pass_plan=planned)
    return BuiltModel(infrastructure.model, infrastructure)


def trainer_hf_config(config: TrainerConfig) -> PretrainedConfig:
    """The Hugging Face config that ``config`` names (preset or local folder)."""
    return model_config(
        config.model,
        config.model_path,
        attn_implementation=config.attn_implementation,
        num_layers=config.num_layers,
        rope_factor=config.rope_factor,
    )


def _with_swap(config: TrainerConfig | None, activation_swap: SwapMode | None) -> TrainerConfig:
    config = config or TrainerConfig()
    if activation_swap is None:
        return config
    if activation_swap != config.activation_swap and config.activation_swap != "none":
        raise ConfigError(
            "activation_swap",
            f"{activation_swap!r} contradicts the trainer config's"
            f" activation_swap: {config.activation_swap}; pass one of them",
        )
    return dataclasses.replace(config, activation_swap=activation_swap)


def from_config(
    hf_config: PretrainedConfig,
    *,
    activation_swap: SwapMode | None = None,
    trainer_config: TrainerConfig | None = None,
    device: str | torch.device = "cpu",
    mesh: DeviceMesh | None = None,
) -> torch.nn.Module:
    """A fresh causal LM of ``hf_config``'s family with ``activation_swap`` installed through
    the pass plan.

    ``auto`` plans for ``trainer_config``'s ``seq_len``, ``batch_size``, ``tp_size`` and
    ``swap_*`` keys; build with a ``TrainerConfig(activation_swap="auto", ...)`` to set them.
    """
    config = _with_swap(trainer_config, activation_swap)
    return build(config, hf_config=hf_config, device=device, mesh=mesh).model


def from_pretrained(
    path: str | Path,
    *,
    activation_swap: SwapMode | None = None,
    trainer_config: TrainerConfig | None = None,
    device: str | torch.device = "cpu",
    mesh: DeviceMesh | None = None,
) -> torch.nn.Module:
    """Load a local checkpoint folder (never the hub) and install the infrastructure.

    Without a ``trainer_config`` the weights keep the dtype the checkpoint records
    (bfloat16 stays bfloat16, as ``transformers`` loads it) where the trainer takes it;
    a ``trainer_config`` sets the dtype itself."""
    recorded = checkpoint_dtype(path)
    if trainer_config is None and recorded in get_args(DType):
        trainer_config = TrainerConfig(dtype=recorded)  # type: ignore[arg-type]
    config = _with_swap(trainer_config, activation_swap)
    hf_config = load_hf_config(path, attn_implementation=config.attn_implementation)
    return build(config, hf_config=hf_config, weights=path, device=device, mesh=mesh).model
