"""The swap pass: rewrite every decoder layer's attention (``activation_swap:
attention``) or the whole layer (``layer``, ``auto``) into swap-wrapped modules linked
layer to layer, through the mode's rule; ``auto`` first plans, from a trace of the
configured shape, which saved tensors of each layer the link can hide."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from passes.errors import PassOrderError, PassPostconditionError
from passes.layout import decoder_layers
from passes.specs import SWAP_RULES

if TYPE_CHECKING:
    from graphswap.auto_swap import AutoSwap
    from graphswap.config import TrainerConfig
    from graphswap.rewrite import RewriteReport

_PLAN_KEYS = {"seq": "seq_len", "batch": "batch_size", "tp": "tp_size"}
"""The planner's setting names that are ``TrainerConfig`` keys under another name."""


def apply_swap(
    model: nn.Module,
    *,
    mode: str = "attention",
    prefetch_depth: int = 1,
    auto: AutoSwap | None = None,
) -> RewriteReport:
    """Wrap the attentions (``attention``) or the layers (``layer``, ``auto``) in place;
    the returned report owns the ``SwapManager``. ``auto`` needs the plan to carry out
    (:func:`plan_auto_swap`)."""
    from graphswap.rewrite import AlreadyTransformedError, rewrite
    from graphswap.runtime import SwapManager

    if mode not in SWAP_RULES:
        raise ValueError(f"activation_swap: {mode} has no swap rule; use one of {list(SWAP_RULES)}")
    if (mode == "auto") != (auto is not None):
        raise ValueError("apply_swap: an auto plan goes with activation_swap: auto, and only there")
    rule = auto.rule() if auto is not None else SWAP_RULES[mode]
    try:
        report = rewrite(model, [rule], manager=SwapManager(prefetch_depth=prefetch_depth))
    except AlreadyTransformedError as error:
        raise PassOrderError(
            f"the swap pass (activation_swap: {mode}) needs the model as built: {error}"
        ) from error
    verify_swap(model, report, prefetch_depth=prefetch_depth, mode=mode)
    return report


def verify_swap(
    model: nn.Module, report: RewriteReport, *, prefetch_depth: int, mode: str = "attention"
) -> None:
    """Every layer's attention (``attention``) or every layer (``layer``, ``auto``) is
    wrapped by the report's manager, and the L layers form one prefetch chain of L - 1
    links."""
    from graphswap.runtime import is_swap_wrapped, swap_manager_of

    fqn, layers = decoder_layers(model)
    manager = report.manager
    for index, layer in enumerate(layers):
        name = f"{fqn}.{index}" if mode != "attention" else f"{fqn}.{index}.self_attn"
        module = layer if mode != "attention" else getattr(layer, "self_attn", None)
        if module is None or not is_swap_wrapped(module) or swap_manager_of(module) is not manager:
            raise PassPostconditionError(
                f"after the swap pass {name} is not swap-wrapped by the rewrite's manager"
                f" ({report}); activation_swap: {mode} would do nothing for this layer"
            )
    if len(manager.links) != len(layers) - 1:
        raise PassPostconditionError(
            f"after the swap pass the prefetch chain has {len(manager.links)} links for"
            f" {len(layers)} layers; expected {len(layers) - 1}"
        )
    if manager.prefetch_depth != prefetch_depth:
        raise PassPostconditionError(
            f"the swap manager prefetches {manager.prefetch_depth} layers ahead, but"
            f" swap_prefetch_depth: {prefetch_depth}"
        )


def plan_auto_swap(model: nn.Module, config: TrainerConfig) -> AutoSwap:
    """Trace the model's config at the configured shape and choose, per layer, what the
    link hides: ``seq_len``, ``batch_size``, ``tp_size`` and the ``swap_*`` keys from
    ``config``; dtype, attention and device from the model as built. A bandwidth of
    ``measure`` is timed here, on the model's device."""
    from graphswap.attention_kernels import PlanSettingError
    from graphswap.auto_swap import AutoSwap, check_measurable, measure_copy_bandwidth
    from graphswap.config import ConfigError
    from graphswap.planner import plan_memory

    param = next(model.parameters())
    device = param.device
    measured = None
    bandwidth = config.swap_bandwidth_gbps
    if bandwidth == "measure":
        check_measurable(device)
        measured = measure_copy_bandwidth(device)
        bandwidth = measured.gbps
    hf_config = model.config
    attn = hf_config._attn_implementation
    dtype = str(param.dtype).removeprefix("torch.")
    try:
        plan = plan_memory(
            hf_config,
            seq=config.seq_len,
            batch=config.batch_size,
            bandwidth_gbps=bandwidth,
            tflops=config.swap_tflops,
            dtype=param.dtype,
            attn_implementation=attn,
            device="cuda" if device.type == "cuda" else "cpu",
            tp=config.tp_size,
            swap="auto",
            hide_margin=config.swap_hide_margin,
        )
    except PlanSettingError as error:
        key = _PLAN_KEYS.get(error.setting, error.setting)
        raise ConfigError(key, f"{error.value}: {error.detail} (activation_swap: auto)") from error
    made_for = (
        f"seq_len: {config.seq_len}, batch_size: {config.batch_size}, dtype: {dtype},"
        f" attn_implementation: {attn}, tp_size: {config.tp_size}"
    )
    return AutoSwap(plan, made_for=made_for, measured=measured)
