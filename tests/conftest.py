"""Shared fixtures: tiny Qwen3-MoE models built from a config (never downloaded)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_model() -> Callable[..., torch.nn.Module]:
    """Factory: a seeded fp32 ``Qwen3MoeForCausalLM`` from the ``tiny`` preset."""
    from graphswap.hf import build_model
    from graphswap.presets import qwen3_moe_config

    def make(seed: int = 0, device: str = "cpu", **overrides: Any) -> torch.nn.Module:
        torch.manual_seed(seed)
        return build_model(qwen3_moe_config("tiny", **overrides), device=device)

    return make
