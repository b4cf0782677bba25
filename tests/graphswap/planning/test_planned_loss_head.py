"""The planner traces the loss head the step runs (``loss_head``): the model's own,
graphswap's chunked head, or TRL's fused head, each installed on the meta model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from graphswap.hf.presets import preset_config
from graphswap.planning import MemoryPlan, PlanSettingError, SwapMode, plan_memory
from graphswap.planning.trace import StepShape


def _config() -> Any:
    """A dense model whose head outweighs its layers: a 32k vocabulary, two layers."""
    config = preset_config("tiny-llama", attn_implementation="sdpa")
    config.vocab_size = 32768
    config.num_hidden_layers = 2
    return config


def _plan(
    activation_swap: SwapMode = "none",
    activation_memory_budget: int | None = None,
    **shape: Any,
) -> MemoryPlan:
    """One sequence of 2048 tokens in bfloat16 under sdpa, but for ``shape``'s settings."""
    step = StepShape(
        **{
            "seq_len": 2048,
            "batch_size": 1,
            "dtype": torch.bfloat16,
            "attn_implementation": "sdpa",
            **shape,
        }
    )
    return plan_memory(
        _config(),
        step,
        activation_swap=activation_swap,
        activation_memory_budget=activation_memory_budget,
    )


def test_the_chunked_head_is_traced_and_named() -> None:
    full = _plan()
    chunked = _plan(loss_head="chunked", loss_head_chunk_size=512)
    assert (full.loss_head, full.loss_head_chunk_size) == ("full", None)
    assert (chunked.loss_head, chunked.loss_head_chunk_size) == ("chunked", 512)
    assert chunked.to_dict()["loss_head_chunk_size"] == 512
    assert full.timeline.peak_label == "head"
    assert chunked.timeline.peak_bytes < 0.5 * full.timeline.peak_bytes
    smaller = _plan(loss_head="chunked", loss_head_chunk_size=256)
    assert smaller.timeline.peak_bytes < chunked.timeline.peak_bytes
    # The projection runs again in backward: the chunked step is longer.
    assert chunked.timeline.step_seconds > full.timeline.step_seconds


def test_trls_fused_head_is_traced_as_it_runs_on_the_device_planned() -> None:
    pytest.importorskip("trl")
    full = _plan(device="cuda")
    cuda = _plan(loss_head="trl", device="cuda")
    cpu = _plan(loss_head="trl", device="cpu")
    assert cuda.loss_head == "trl"
    # No logits kept: far below the full head; on CUDA the Triton fold and the fp32
    # products allocate nothing, which TRL's torch fallback on CPU does.
    assert cuda.timeline.peak_bytes < 0.5 * full.timeline.peak_bytes
    assert cuda.timeline.peak_bytes < cpu.timeline.peak_bytes


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"loss_head": "fused"}, "loss_head"),
        ({"loss_head": "chunked", "loss_head_chunk_size": 0}, "loss_head_chunk_size"),
        ({"loss_head": "chunked", "loss_head_chunk_size": 1.5}, "loss_head_chunk_size"),
    ],
)
def test_a_bad_head_setting_is_refused_naming_it(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(PlanSettingError) as info:
        _plan(**settings)
    assert info.value.setting == named


def test_the_budget_chooses_the_chunk_size_that_meets_it_at_the_least_time() -> None:
    """A budget the configured chunk meets only by recomputing, a smaller chunk meets
    keeping everything: the plan takes the smaller chunk, which costs no FLOPs, and
    graphswap train installs the size the plan chose."""
    from graphswap.rewriting.loss_head import loss_head_chunk_size
    from graphswap.train.build import build
    from graphswap.train.config import TrainerConfig

    settings = {"device": "cpu", "dtype": torch.float32, "loss_head": "chunked"}
    large = _plan(**settings, loss_head_chunk_size=1024).timeline.peak_bytes
    small = _plan(**settings, loss_head_chunk_size=256).timeline.peak_bytes
    assert small < large
    chosen = _plan(
        **settings,
        loss_head_chunk_size=1024,
        activation_swap="budget",
        activation_memory_budget=small,
    )
    assert (chosen.loss_head_chunk_size, chosen.recompute) == (256, ())
    assert chosen.timeline.peak_bytes <= small
    roomy = _plan(
        **settings,
        loss_head_chunk_size=1024,
        activation_swap="budget",
        activation_memory_budget=large,
    )
    assert roomy.loss_head_chunk_size == 1024, "the configured size where it fits"
    trainer = TrainerConfig(
        activation_swap="budget",
        activation_memory_budget=small,
        loss_head="chunked",
        seq_len=2048,
        batch_size=1,
        attn_implementation="sdpa",
    )
    built = build(trainer, hf_config=_config())
    assert loss_head_chunk_size(built.model) == built.infrastructure.loss_head_chunk_size == 256
