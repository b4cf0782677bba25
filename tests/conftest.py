"""Shared fixtures: tiny models built from a config (never downloaded)."""

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
    from graphswap.hf.checkpoints import build_model
    from graphswap.hf.presets import qwen3_moe_config

    def make(seed: int = 0, device: str = "cpu", **overrides: Any) -> torch.nn.Module:
        torch.manual_seed(seed)
        return build_model(qwen3_moe_config("tiny", **overrides), device=device)

    return make


@pytest.fixture
def family_config() -> Callable[[str, str], Any]:
    """Factory: the Hugging Face config of a model preset with ``attn`` attention, or a
    skip when this transformers lacks the preset's family or cannot build its config
    (the floor's may), or its model does not run ``attn``."""
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from graphswap.hf.presets import PRESETS, preset_config

    def make(preset: str, attn: str) -> Any:
        model_type = PRESETS[preset].model_type
        if model_type not in CONFIG_MAPPING_NAMES:
            pytest.skip(f"this transformers has no {model_type!r} models")
        try:
            config = preset_config(preset, attn_implementation="eager")
        except Exception as error:
            # OLMoE's config on 5.4 fails its own field validation; on the versions CI
            # runs the families on (5.17, the latest) every config builds.
            if Version(transformers.__version__) >= Version("5.17"):
                raise
            pytest.skip(f"this transformers cannot build a {model_type!r} config: {error}")
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
        if attn == "sdpa" and not model_class._supports_sdpa:
            pytest.skip(f"{model_class.__name__} runs eager attention only")
        config._attn_implementation = attn
        return config

    return make


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models on one thread: they are too small for more, and on a loaded machine
    OpenMP's barriers make a step of two threads many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
