"""Build Hugging Face Qwen3-MoE models from a config or a local checkpoint folder."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from graphswap.config import ActivationSwap, TrainerConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import Qwen3MoeConfig

    from graphswap.runtime import SwapManager
    from passes import InfrastructureResult


def load_hf_config(path: str | Path, *, attn_implementation: str = "eager") -> Qwen3MoeConfig:
    """Read ``config.json`` of a local checkpoint folder (never the hub)."""
    from transformers import Qwen3MoeConfig

    folder = Path(path)
    config_file = folder / "config.json" if folder.is_dir() else folder
    if not config_file.is_file():
        raise FileNotFoundError(
            f"no config.json at {str(path)!r}: pass a local Hugging Face checkpoint folder"
        )
    values = json.loads(config_file.read_text())
    model_type = values.get("model_type")
    if model_type not in (None, "qwen3_moe"):
        raise ValueError(
            f"{config_file} has model_type {model_type!r}; graphswap supports 'qwen3_moe'"
        )
    for key in ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype"):
        values.pop(key, None)
    return Qwen3MoeConfig(attn_implementation=attn_implementation, **values)


def build_model(
    config: Qwen3MoeConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """Instantiate ``Qwen3MoeForCausalLM``; on ``meta`` no memory is allocated."""
    from transformers import Qwen3MoeForCausalLM

    with torch.device(device):
        model = Qwen3MoeForCausalLM(config)
    return model.to(dtype=dtype)


@dataclass(frozen=True)
class BuiltModel:
    """A model with its infrastructure applied, and what was applied."""

    model: torch.nn.Module
    infrastructure: InfrastructureResult

    @property
    def swap_manager(self) -> SwapManager | None:
        report = self.infrastructure.report
        return report.manager if report is not None else None


def build(
    config: TrainerConfig,
    *,
    hf_config: Qwen3MoeConfig | None = None,
    weights: str | Path | None = None,
    device: str | torch.device = "cpu",
    mesh: DeviceMesh | None = None,
) -> BuiltModel:
    """The one path from settings to a ready model: every builder goes through here.

    ``hf_config`` defaults to the preset or ``model_path`` of ``config``; ``weights``
    is a local checkpoint folder to load. The infrastructure (swap, sharding,
    compile, FSDP) is applied by ``passes.apply_model_infrastructure`` from the same
    ``config``, so a setting cannot be dropped on the way.
    """
    from passes import apply_model_infrastructure

    if hf_config is None:
        hf_config = trainer_hf_config(config)
    dtype = getattr(torch, config.dtype)
    if weights is not None:
        from transformers import Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM.from_pretrained(
            weights, config=hf_config, local_files_only=True, dtype=dtype
        ).to(device)
    else:
        model = build_model(hf_config, device=device, dtype=dtype)
    infrastructure = apply_model_infrastructure(model, config, mesh=mesh)
    return BuiltModel(infrastructure.model, infrastructure)


def trainer_hf_config(config: TrainerConfig) -> Qwen3MoeConfig:
    """The Hugging Face config that ``config`` names (preset or local folder)."""
    overrides = {} if config.num_layers is None else {"num_hidden_layers": config.num_layers}
    if config.model_path is not None:
        hf_config = load_hf_config(
            config.model_path, attn_implementation=config.attn_implementation
        )
        for key, value in overrides.items():
            setattr(hf_config, key, value)
        return hf_config
    from graphswap.presets import qwen3_moe_config

    return qwen3_moe_config(
        config.model, attn_implementation=config.attn_implementation, **overrides
    )


def _with_swap(
    config: TrainerConfig | None, activation_swap: ActivationSwap | None
) -> TrainerConfig:
    config = config or TrainerConfig()
    if activation_swap is None:
        return config
    if activation_swap != config.activation_swap and config.activation_swap != "none":
        raise ValueError(
            f"activation_swap={activation_swap!r} contradicts the trainer config's"
            f" activation_swap: {config.activation_swap}; pass one of them"
        )
    return dataclasses.replace(config, activation_swap=activation_swap)


def from_config(
    hf_config: Qwen3MoeConfig,
    *,
    activation_swap: ActivationSwap | None = None,
    trainer_config: TrainerConfig | None = None,
    device: str | torch.device = "cpu",
    mesh: DeviceMesh | None = None,
) -> torch.nn.Module:
    """A fresh ``Qwen3MoeForCausalLM`` with ``activation_swap`` installed through the pass plan."""
    config = _with_swap(trainer_config, activation_swap)
    return build(config, hf_config=hf_config, device=device, mesh=mesh).model


def from_pretrained(
    path: str | Path,
    *,
    activation_swap: ActivationSwap | None = None,
    trainer_config: TrainerConfig | None = None,
    device: str | torch.device = "cpu",
    mesh: DeviceMesh | None = None,
) -> torch.nn.Module:
    """Load a local checkpoint folder (never the hub) and install the infrastructure."""
    config = _with_swap(trainer_config, activation_swap)
    hf_config = load_hf_config(path, attn_implementation=config.attn_implementation)
    return build(config, hf_config=hf_config, weights=path, device=device, mesh=mesh).model
