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

    from graphswap.auto_swap import AutoSwap
    from graphswap.runtime import SwapManager
    from passes import InfrastructureResult


class CheckpointError(ValueError):
    """A local checkpoint folder that graphswap cannot use; the message names the file."""


_QWEN3_MOE_TYPE = "qwen3_moe"


def load_hf_config(path: str | Path, *, attn_implementation: str = "eager") -> Qwen3MoeConfig:
    """Read ``config.json`` of a local checkpoint folder (never the hub); it must
    declare ``model_type: qwen3_moe``, since another architecture's keys would
    silently build a Qwen3-MoE of some other shape."""
    from transformers import Qwen3MoeConfig

    folder = Path(path)
    config_file = folder / "config.json" if folder.is_dir() else folder
    if not config_file.is_file():
        where = "does not exist (no config.json)" if not folder.exists() else "has no config.json"
        raise CheckpointError(
            f"{str(path)!r} {where}; pass a local Hugging Face checkpoint folder"
            " (one written by save_pretrained)"
        )
    try:
        values = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"{config_file} is not valid JSON ({error}); re-save the checkpoint with"
            " save_pretrained or fix the file"
        ) from error
    if not isinstance(values, dict):
        raise CheckpointError(
            f"{config_file} holds a JSON {type(values).__name__}, not an object of settings;"
            " re-save the checkpoint with save_pretrained"
        )
    model_type = values.get("model_type")
    if model_type != _QWEN3_MOE_TYPE:
        found = "no model_type" if model_type is None else f"model_type {model_type!r}"
        raise CheckpointError(
            f"{config_file} has {found}; graphswap trains {_QWEN3_MOE_TYPE!r} checkpoints only:"
            f' pass a Qwen3-MoE checkpoint folder (config.json with "model_type":'
            f' "{_QWEN3_MOE_TYPE}")'
        )
    for key in ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype"):
        values.pop(key, None)
    try:
        return Qwen3MoeConfig(attn_implementation=attn_implementation, **values)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{config_file}: {error}; fix the file") from error


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint folder, in the names ``save_pretrained`` writes;
    raises :class:`CheckpointError` when there are none."""
    from transformers.utils import (
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    folder = Path(path)
    names = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
    found = [folder / name for name in names if (folder / name).is_file()]
    if not found:
        raise CheckpointError(
            f"{str(path)!r} has no weights ({', '.join(names)}); save the model with"
            " save_pretrained into that folder, or use a preset (model: ...) for a random init"
        )
    return found


def load_weights(
    path: str | Path, hf_config: Qwen3MoeConfig, *, dtype: torch.dtype
) -> torch.nn.Module:
    """``Qwen3MoeForCausalLM.from_pretrained`` of a local folder; a parameter that the
    checkpoint does not hold (it would stay randomly initialized) is an error."""
    from transformers import Qwen3MoeForCausalLM

    weight_files(path)
    model, info = Qwen3MoeForCausalLM.from_pretrained(
        path, config=hf_config, local_files_only=True, dtype=dtype, output_loading_info=True
    )
    missing = sorted(info.get("missing_keys", ())) + [
        str(key) for key in info.get("mismatched_keys", ())
    ]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(
            f"{str(path)!r} does not hold {', '.join(missing[:3])}{more} for this model"
            f" ({hf_config.num_hidden_layers} layers): they would train from a random init;"
            " leave num_layers unset or at most the checkpoint's num_hidden_layers"
        )
    return model


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

    @property
    def auto_swap(self) -> AutoSwap | None:
        """``activation_swap: auto``: the plan and its policies (``check()`` after a step)."""
        return self.infrastructure.auto_swap


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
    is a local checkpoint folder to load, by default ``model_path``: a checkpoint is
    trained from its weights, never from a random init of its shape. The
    infrastructure (swap, sharding, compile, FSDP) is applied by
    ``passes.apply_model_infrastructure`` from the same ``config``, so a setting
    cannot be dropped on the way.
    """
    from passes import apply_model_infrastructure

    if hf_config is None:
        hf_config = trainer_hf_config(config)
    dtype = getattr(torch, config.dtype)
    if weights is None:
        weights = config.model_path
    if weights is not None:
        model = load_weights(weights, hf_config, dtype=dtype).to(device)
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
    """A fresh ``Qwen3MoeForCausalLM`` with ``activation_swap`` installed through the pass plan.

    ``auto`` plans for ``trainer_config``'s ``seq_len``, ``batch_size``, ``tp_size`` and
    ``swap_*`` keys; build with a ``TrainerConfig(activation_swap="auto", ...)`` to set them.
    """
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
