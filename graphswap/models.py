"""Build Hugging Face Qwen3-MoE models from a config or a local checkpoint folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import Qwen3MoeConfig


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
