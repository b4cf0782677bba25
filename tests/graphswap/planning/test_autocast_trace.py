"""The planner's meta trace under autocast: the step an fp32 model runs under a
trainer's ``bf16`` autocast, planned as it runs.

The trace must save what the real step saves (every save's shape, dtype and storage,
autocast's weight cache included), and a budget plan made for autocast must be the step
autocast runs: no plan mismatch, and the recomputed and offloaded bytes the plan says.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

import graphswap
from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import preset_config
from graphswap.passes.plan_executor import PlanMismatchWarning
from graphswap.planning import PlanSettingError, plan_memory
from graphswap.planning.saved_tensors import (
    SavedTensorCollector,
    build_meta_model,
    trace_saved_tensors,
)
from graphswap.planning.trace import StepShape
from graphswap.runtime.policy import swap_large_activations
from graphswap.train.build import build
from graphswap.train.config import TrainerConfig

SEQ_LEN, BATCH_SIZE = 64, 2


def _saves(scopes: dict) -> dict:
    return {
        scope: [(s.shape, s.dtype, s.storage, s.parameter) for s in saves]
        for scope, saves in scopes.items()
        if saves
    }


def _bf16_step(attn: str, **lora: Any) -> StepShape:
    """The step these tests run: fp32 weights under CPU bf16 autocast."""
    return StepShape(
        seq_len=SEQ_LEN,
        batch_size=BATCH_SIZE,
        dtype=torch.float32,
        autocast_dtype=torch.bfloat16,
        attn_implementation=attn,
        device="cpu",
        **lora,
    )


def _real_saves(model: torch.nn.Module, collected: torch.nn.Module, vocab_size: int) -> dict:
    """What ``collected`` (``model`` or the model inside it) saves in a real forward of
    ``model`` under CPU bf16 autocast, by scope."""
    collector = SavedTensorCollector(collected, swap_large_activations)
    ids = torch.randint(0, vocab_size, (BATCH_SIZE, SEQ_LEN))
    with collector.collect(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids, use_cache=False)
    return _saves(collector.saves)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_trace_saves_what_a_real_cpu_autocast_step_saves(preset: str, attn: str) -> None:
    """Every save, in order, with its shape, dtype and storage: a linear's bf16 copies
    of its input and weight (the weight's cast shared through autocast's cache), sdpa's
    bf16 q, k and v, the fp32 norms and router; for a dense model and an MoE."""
    config = preset_config(preset, attn_implementation=attn)
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    model = build_model(config, dtype=torch.float32).train()
    real = _real_saves(model, model, config.vocab_size)
    traced = _saves(trace_saved_tensors(config, _bf16_step(attn)).scopes())
    assert traced == real
    assert any(dtype == torch.bfloat16 for saves in real.values() for _, dtype, _, _ in saves)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_trace_saves_what_a_real_peft_model_saves_under_cpu_autocast(
    preset: str, checkpointing: bool
) -> None:
    """A LoRA step under bf16 autocast, save for save: the frozen weights' casts made
    anew at each call, the adapters' through autocast's cache, PEFT's fp32 input to the
    adapters; with the trainer's checkpointing, the embeddings' output requiring grad
    (``enable_input_require_grads``, as TRL's SFTTrainer and Hugging Face's
    checkpointing set it), so the first layer saves for its input's gradient too."""
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    config = preset_config(preset, attn_implementation="eager")
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    model = peft.get_peft_model(
        build_model(config, dtype=torch.float32).train(),
        peft.LoraConfig(r=8, target_modules=targets),
    )
    if checkpointing:
        model.enable_input_require_grads()
    real = _real_saves(model, model.get_base_model(), config.vocab_size)
    shape = _bf16_step("eager", lora_rank=8, lora_target_modules=tuple(targets))
    meta = build_meta_model(config, shape, activation_checkpointing=checkpointing)
    traced_collector = SavedTensorCollector(meta.model, swap_large_activations)
    with traced_collector.collect(), meta.tracing():
        meta.forward()
    assert _saves(traced_collector.saves) == real
    _, dtype, _, _ = real["model.layers.0"][0]  # the norm's input, or the adapters' cast
    assert dtype == (torch.float32 if checkpointing else torch.bfloat16)


def test_autocast_computes_in_a_lower_precision_or_not_at_all() -> None:
    with pytest.raises(PlanSettingError, match="autocast_dtype") as error:
        StepShape(seq_len=64, dtype=torch.float32, autocast_dtype=torch.float32)
    assert "bfloat16, float16, or unset" in str(error.value)


def test_a_budget_plan_made_under_autocast_is_the_step_autocast_runs() -> None:
    """A model built (and so planned) inside bf16 autocast trains under it as planned:
    no mismatch warned, and the runtime recomputes the plan's bytes; the plan says it
    was made for autocast's dtype."""
    config = preset_config("tiny-llama", attn_implementation="sdpa")
    config.num_hidden_layers = 2
    seq_len = 512
    shape = StepShape(
        seq_len=seq_len,
        batch_size=BATCH_SIZE,
        dtype=torch.float32,
        autocast_dtype=torch.bfloat16,
        attn_implementation="sdpa",
        device="cpu",
    )
    whole = plan_memory(config, shape, activation_swap="none")
    trainer = TrainerConfig(
        activation_swap="budget",
        activation_memory_budget=int(whole.timeline.peak_bytes * 0.85),
        seq_len=seq_len,
        batch_size=BATCH_SIZE,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        built = build(trainer, hf_config=copy.deepcopy(config))
    assert built.plan_executor is not None
    plan = built.plan_executor.plan
    assert plan.autocast_dtype == "bfloat16" and plan.recompute
    assert "dtype: float32 under bfloat16 autocast" in built.plan_executor.made_for
    saved = {save.dtype for layer in plan.layers for save in layer.saved_tensors}
    assert torch.bfloat16 in saved and torch.float32 in saved
    ids = torch.randint(0, config.vocab_size, (BATCH_SIZE, seq_len))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMismatchWarning)
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = built.model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        graphswap.rewrite_report(built.model).check()
    stats = built.swap_manager.stats
    assert stats.plan_mismatches == 0
    assert stats.recomputed_bytes == 2 * plan.recomputed_bytes > 0
    assert stats.offloaded_bytes == 2 * plan.swapped_bytes
