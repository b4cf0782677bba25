"""The planner traces the step of a LoRA fine-tune: the adapters alone train (gradients,
AdamW state, weight gradients in backward), run as PEFT runs them, so the plan's peak is
the clocked peak of a real ``PeftModel``; PEFT's own config is read from the model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from graphswap.errors import NoMatchError
from graphswap.hf.checkpoints import build_model, decoder_layers
from graphswap.hf.lora import LORA_TARGET_MODULES, lora_settings
from graphswap.hf.presets import preset_config
from graphswap.planning import PlanSettingError, fit_sequence, plan_memory
from graphswap.planning._settings import StepShape
from graphswap.planning._trace import BlockKind, storage_bytes, trace_step
from graphswap.planning.saved_tensors import build_meta_model
from graphswap.runtime.profile import device_profile

SEQ, BATCH = 256, 2


def _meta(dtype: torch.dtype = torch.float32, **lora: object) -> torch.nn.Module:
    shape = StepShape(seq_len=SEQ, batch_size=BATCH, dtype=dtype, device="cpu", **lora)  # type: ignore[arg-type]
    return build_meta_model(preset_config("tiny-llama"), shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lora_step_trains_the_adapters_alone(dtype: torch.dtype) -> None:
    """Every base weight frozen, an adapter on each usual projection (in float32 over a
    bfloat16 model, as PEFT keeps them); the traced step makes gradients for the adapters
    only and holds AdamW state for them only, its parameters still all of the model's."""
    meta = _meta(dtype, lora_rank=8)
    model = meta.model  # type: ignore[attr-defined]
    trained = [p for p in model.parameters() if p.requires_grad]
    adapted = {fqn.rpartition(".")[0] for fqn, p in model.named_parameters() if p.requires_grad}
    _, layers = decoder_layers(model)
    assert len(adapted) == 2 * len(LORA_TARGET_MODULES) * len(layers)
    assert {p.dtype for p in trained} == {torch.float32}
    trace = trace_step(meta, device_profile("h200"))  # type: ignore[arg-type]
    gradients = [b.nbytes for b in trace.blocks if b.kind is BlockKind.GRADIENT]
    assert sum(gradients) == storage_bytes(trained) and len(gradients) == len(trained)
    assert trace.optimizer_state_bytes == 2 * storage_bytes(trained)
    assert trace.parameter_bytes == storage_bytes(list(model.parameters()))
    assert trace.lora_rank == 8


def test_a_fit_of_a_lora_step_counts_gradients_and_state_for_the_adapters() -> None:
    """The state a fit holds whatever the length: every parameter, but the gradients and
    AdamW's moments of the adapters alone."""
    config = preset_config("tiny-qwen3")
    config.num_hidden_layers = 1
    shape = StepShape(seq_len=512, device="cpu", lora_rank=4)
    fit = fit_sequence(config, shape, memory_bytes=1 << 30, modes=("none",))
    full = fit_sequence(
        config, StepShape(seq_len=512, device="cpu"), memory_bytes=1 << 30, modes=("none",)
    )
    model = build_meta_model(config, shape).model
    adapters = storage_bytes([p for p in model.parameters() if p.requires_grad])
    assert fit.lora_rank == 4 and fit.parameter_bytes == full.parameter_bytes + adapters
    assert fit.gradient_bytes == adapters and fit.optimizer_state_bytes == 2 * adapters
    assert adapters < full.gradient_bytes // 4


@pytest.mark.parametrize(
    ("settings", "named", "detail"),
    [
        ({"lora_target_modules": ["q_proj"]}, "lora_target_modules", "set lora_rank"),
        ({"lora_dropout": 0.1}, "lora_dropout", "set lora_rank"),
        ({"lora_rank": 0}, "lora_rank", ">= 1"),
        ({"lora_rank": 8, "lora_target_modules": []}, "lora_target_modules", "non-empty"),
        ({"lora_rank": 8, "lora_dropout": 1.0}, "lora_dropout", "[0, 1)"),
        (
            {"lora_rank": 8, "lora_target_modules": ["c_attn"]},
            "lora_target_modules",
            "its linear layers are named: down_proj, gate_proj, k_proj",
        ),
    ],
)
def test_lora_settings_that_change_nothing_or_match_nothing_are_refused(
    settings: dict[str, object], named: str, detail: str
) -> None:
    with pytest.raises(PlanSettingError) as info:
        plan_memory(preset_config("tiny-llama"), StepShape(seq_len=64, device="cpu", **settings))
    assert info.value.setting == named and detail in str(info.value)


@pytest.mark.parametrize(("dtype", "dropout"), [(torch.float32, 0.0), (torch.bfloat16, 0.05)])
def test_the_plan_of_a_lora_step_is_the_clocked_peft_step(
    dtype: torch.dtype, dropout: float, clocked_step: Callable[..., Any]
) -> None:
    """The planned peak and step time are those of a PeftModel made with the same
    LoraConfig, clocked on the simulated H200 (float32 adapters over bfloat16 weights
    with their input casts, and dropout's saves, included)."""
    peft = pytest.importorskip("peft")
    config = preset_config("tiny-llama")
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=8, target_modules=list(LORA_TARGET_MODULES), lora_dropout=dropout)
    net = peft.get_peft_model(build_model(config).to(dtype), lora)
    settings = lora_settings(net)
    assert settings is not None and settings["lora_dropout"] == dropout
    shape = StepShape(
        seq_len=SEQ,
        batch_size=BATCH,
        dtype=dtype,
        attn_implementation=config._attn_implementation,
        device="cpu",
        **settings,
    )
    plan = plan_memory(config, shape, activation_swap="none")
    ids = torch.randint(2, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    clocked = clocked_step(net, ids)
    assert plan.timeline.peak_bytes == pytest.approx(clocked.peak_bytes, rel=0.03)
    assert plan.timeline.base_bytes == clocked.base_bytes


def test_a_peft_model_other_than_linear_lora_is_refused_by_name() -> None:
    """The planner traces LoRA on linear layers: PEFT's adapters on a mixture of experts'
    fused expert parameters, another PEFT method, a layer trained whole
    (``modules_to_save``), or bfloat16 adapters (the planner's are PEFT's default, float32
    over bfloat16) are refused naming what to change."""
    peft = pytest.importorskip("peft")
    experts = peft.get_peft_model(
        build_model(preset_config("tiny")),
        peft.LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]),
    )
    with pytest.raises(NoMatchError, match="target_parameters"):
        lora_settings(experts)
    ia3 = peft.get_peft_model(
        build_model(preset_config("tiny-llama")),
        peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
    )
    with pytest.raises(NoMatchError, match="IA3, not LoRA"):
        lora_settings(ia3)
    saved = peft.get_peft_model(
        build_model(preset_config("tiny-llama")),
        peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
    )
    with pytest.raises(NoMatchError, match="besides LoRA adapters on linear layers"):
        lora_settings(saved)
    bf16 = peft.get_peft_model(
        build_model(preset_config("tiny-llama")).to(torch.bfloat16),
        peft.LoraConfig(r=4, target_modules=["q_proj"]),
        autocast_adapter_dtype=False,
    )
    with pytest.raises(NoMatchError, match="autocast_adapter_dtype=True"):
        lora_settings(bf16)
    assert lora_settings(build_model(preset_config("tiny-llama"))) is None
