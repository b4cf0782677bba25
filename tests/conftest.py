"""Shared fixtures: tiny Qwen3-MoE models built from a config (never downloaded)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist


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


@pytest.fixture
def world(tmp_path: Path) -> Iterator[None]:
    """A one-process gloo world, so that sharding APIs and distributed passes can run in
    this process."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
