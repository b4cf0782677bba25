"""The swap pass: rewrite every decoder layer's attention (``activation_swap:
attention``) or the whole layer (``layer``, ``auto``) into swap-wrapped modules linked
layer to layer, through the mode's rule; ``auto`` first plans, from a trace of the
configured shape, which saved tensors of each layer the link can hide."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from graphswap import _compat
from graphswap.errors import NoMatchError
from graphswap.hf import trl_head
from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.hf.checkpoints import decoder_layers
from graphswap.hf.decoder import decoder_classes
from graphswap.hf.lora import lora_settings
from graphswap.passes.errors import PassPostconditionError, PassSettingError
from graphswap.passes.plan_executor import PlanExecutor, measure_copy_bandwidth
from graphswap.passes.specs import SWAP_RULES
from graphswap.planning import DEFAULT_PROFILE, SwapMode, plan_memory
from graphswap.planning._budget import resolve_memory_budget
from graphswap.planning._registry import STRATEGIES, memory_strategy
from graphswap.planning._settings import step_settings
from graphswap.planning.saved_tensors import ATTENTION_SCOPE
from graphswap.rewriting.apply import rewrite
from graphswap.runtime import (
    CopyEngine,
    SwapManager,
    default_max_host_bytes,
    is_swap_wrapped,
    swap_manager_of,
)
from graphswap.runtime.profile import DeviceProfile, simulated_profile
from graphswap.runtime.sim import SimulatedAccelerator

if TYPE_CHECKING:
    from graphswap.passes.settings import PassSettings
    from graphswap.rewriting.apply import RewriteReport

_PLANNED_KEYS = (
    "seq_len",
    "batch_size",
    "tp_size",
    "swap_tflops",
    "swap_hide_margin",
    "swap_prefetch_depth",
    "swap_offload_lag",
    "loss_head",
    "loss_head_chunk_size",
)
"""The config's keys the planner takes as they are: the planner spells them alike."""


@_compat.renamed_kwargs(**_compat.RENAMED_SWAP_OPTIONS, auto="executor")
def apply_swap(
    model: nn.Module,
    *,
    activation_swap: SwapMode = "attention",
    swap_prefetch_depth: int = 1,
    swap_offload_lag: int | None = None,
    engine: CopyEngine | None = None,
    executor: PlanExecutor | None = None,
) -> RewriteReport:
    """Wrap the attentions (``attention``) or the layers (``layer``, ``auto``,
    ``budget``) in place; the returned report owns the ``SwapManager``. ``auto`` and
    ``budget`` need the executor of their plan (``executor=``, made by
    :func:`plan_swap`). ``engine``: the copy engine (None: the device's own).
    ``swap_offload_lag`` unset: the lag the plan was made at, else 1. 0.2.0's names
    (``prefetch_depth=``, ``offload_lag=``, ``auto=``) warn and work until 0.3."""
    if activation_swap not in SWAP_RULES:
        raise PassSettingError(
            f"activation_swap: {activation_swap} has no swap rule; use one of {list(SWAP_RULES)}"
        )
    if STRATEGIES[activation_swap].executes_plan != (executor is not None):
        raise PassSettingError(
            "apply_swap: a plan (executor=) goes with activation_swap: auto or budget, and only"
            " there; make one with plan_swap, or drop executor= for the other modes"
        )
    if executor is not None and executor.plan.activation_swap != activation_swap:
        raise PassSettingError(
            f"apply_swap: activation_swap: {activation_swap} was given a plan of"
            f" {executor.plan.activation_swap}; plan again with activation_swap: {activation_swap}"
        )
    rule = executor.rule() if executor is not None else SWAP_RULES[activation_swap]
    if swap_offload_lag is None:
        swap_offload_lag = 1 if executor is None else executor.plan.swap_offload_lag
    manager = SwapManager(
        swap_prefetch_depth=swap_prefetch_depth, swap_offload_lag=swap_offload_lag, engine=engine
    )
    report = rewrite(model, [rule], manager=manager)
    verify_swap(
        model, report, swap_prefetch_depth=swap_prefetch_depth, activation_swap=activation_swap
    )
    return report


__getattr__ = _compat.module_getattr(__name__)  # plan_auto_swap, renamed, until 0.3


def swap_engine(device: str) -> CopyEngine | None:
    """``device: sim:<profile>``: the clocked simulated accelerator; else the device's own."""
    profile = simulated_profile(device)
    return None if profile is None else SimulatedAccelerator(profile=profile)


@_compat.renamed_kwargs(**_compat.RENAMED_SWAP_OPTIONS)
def verify_swap(
    model: nn.Module,
    report: RewriteReport,
    *,
    swap_prefetch_depth: int,
    activation_swap: SwapMode = "attention",
) -> None:
    """Every layer's attention (``attention``) or every layer (``layer``, ``auto``) is
    wrapped by the report's manager, and the L layers form one prefetch chain of L - 1
    links."""
    fqn, layers = decoder_layers(model)
    manager = report.manager
    attention = decoder_classes(model, rule=SWAP_RULES["attention"]).attention
    for index, layer in enumerate(layers):
        name, module = f"{fqn}.{index}", layer
        if STRATEGIES[activation_swap].scope == ATTENTION_SCOPE:
            # The attention child, wrapped or not, whatever the family names it.
            child = next(
                (
                    n
                    for n, c in layer.named_children()
                    if is_swap_wrapped(c) or type(c) in attention
                ),
                "self_attn",
            )
            name, module = f"{name}.{child}", getattr(layer, child, None)
        if module is None or not is_swap_wrapped(module) or swap_manager_of(module) is not manager:
            raise PassPostconditionError(
                f"after the swap pass {name} is not swap-wrapped by the rewrite's manager"
                f" ({report}); activation_swap: {activation_swap} would do nothing for this layer"
            )
    if len(manager.links) != len(layers) - 1:
        raise PassPostconditionError(
            f"after the swap pass the prefetch chain has {len(manager.links)} links for"
            f" {len(layers)} layers; expected {len(layers) - 1}"
        )
    if manager.swap_prefetch_depth != swap_prefetch_depth:
        raise PassPostconditionError(
            f"the swap manager prefetches {manager.swap_prefetch_depth} layers ahead, but"
            f" swap_prefetch_depth: {swap_prefetch_depth}"
        )


def plan_swap(
    model: nn.Module,
    config: PassSettings,
    *,
    state_shards: int = 1,
    device: torch.device | None = None,
    autocast_dtype: torch.dtype | None = None,
    activation_checkpointing: bool = False,
) -> PlanExecutor:
    """Trace the model's config at the configured shape and choose, per layer, what the
    link hides: ``seq_len``, ``batch_size``, ``tp_size``, the loss head and the ``swap_*``
    keys from ``config`` (the bandwidth and TFLOP/s, when set, override the device profile: the
    simulated device's, else the planner's default; ``swap_prefetch_depth`` and
    ``swap_offload_lag`` are the manager's, the lag chosen by the plan when unset; the host
    budget the manager takes on this node); dtype, attention and device from the model as
    built. A bandwidth of ``measure`` is timed
    here, on the model's device. ``activation_swap: budget`` plans what to keep, swap and
    recompute within ``activation_memory_budget`` (a fraction: of the device's memory,
    the simulated profile's on ``sim:``). ``state_shards``: the ranks FSDP shards the
    parameters, gradients and optimizer state over, so that a rank's budget is weighed
    against its own share of them, not the whole model's. ``device``: where training
    runs, when the model is not there (built on meta to check the plan before a build;
    default: the model's device). ``autocast_dtype``: the dtype the step computes in
    under ``torch.autocast`` (a trainer's ``bf16``/``fp16`` around fp32 weights);
    default: autocast's on the device if it is on here, else none.
    ``activation_checkpointing``: ``budget`` honours the
    trainer's request to checkpoint every layer: it recomputes every whole layer and
    plans how much of their inputs to swap."""
    param = next(model.parameters())
    device = param.device if device is None else device
    if autocast_dtype is None:
        autocast_dtype = active_autocast_dtype(device.type)
    hf_config = model.config
    attn = hf_config._attn_implementation
    profile = simulated_profile(config.device) or DEFAULT_PROFILE
    try:
        measured = None
        bandwidth = config.swap_bandwidth_gbps
        if bandwidth == "measure":
            measured = measure_copy_bandwidth(device)
            bandwidth = measured.gbps
        budget = None
        if memory_strategy(config.activation_swap).takes_budget:
            budget = resolve_memory_budget(
                config.activation_memory_budget,
                _device_memory(device, profile),
                device=f"device: {config.device}",
            )
        planned = {key: getattr(config, key) for key in _PLANNED_KEYS}
        if trl_head.installed(model):
            # SFTTrainer's own head, which the model already runs: plan the step it runs.
            planned["loss_head"] = "trl"
        # A PeftModel trains its adapters alone: plan that step.
        planned.update(lora_settings(model) or {})
        shape, schedule, figures = step_settings(
            "plan_memory",
            {
                **planned,
                "dtype": param.dtype,
                "autocast_dtype": autocast_dtype,
                "attn_implementation": attn,
                "device": "cuda" if device.type == "cuda" else "cpu",
                "max_host_bytes": default_max_host_bytes(),
                "state_shards": state_shards,
            },
        )
        plan = plan_memory(
            hf_config,
            shape,
            schedule=schedule,
            swap_bandwidth_gbps=bandwidth,
            activation_swap=config.activation_swap,
            activation_memory_budget=budget,
            profile=profile,
            activation_checkpointing=activation_checkpointing,
            **figures,
        )
    except PlanSettingError as error:
        # The planner names a setting by its config key: the message starts with it.
        raise PassSettingError(
            f"{error.setting}: {error.value} {error.detail}"
            f" (activation_swap: {config.activation_swap})"
        ) from error
    except NoMatchError as error:
        raise PassSettingError(
            f"activation_swap: {config.activation_swap} plans the step the model trains: {error}"
        ) from error
    dtype = str(param.dtype).removeprefix("torch.")
    if autocast_dtype is not None:
        dtype += f" under {str(autocast_dtype).removeprefix('torch.')} autocast"
    made_for = (
        f"seq_len: {config.seq_len}, batch_size: {config.batch_size}, dtype: {dtype},"
        f" attn_implementation: {attn}, tp_size: {config.tp_size}"
        + (f", loss_head: {plan.loss_head}" if plan.loss_head != "full" else "")
        + (
            f", loss_head_chunk_size: {plan.loss_head_chunk_size}"
            if plan.loss_head_chunk_size is not None
            else ""
        )
        + (f", lora_rank: {plan.lora_rank}" if plan.lora_rank is not None else "")
        + (f", state sharded over {state_shards} ranks" if state_shards > 1 else "")
        + (", activation_checkpointing: true" if activation_checkpointing else "")
    )
    return PlanExecutor(plan, made_for=made_for, measured=measured)


def active_autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type`` if it is on now (a model
    rewritten inside the trainer's autocast region); else ``None``."""
    if not torch.amp.is_autocast_available(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _device_memory(device: torch.device, profile: DeviceProfile | str) -> int | None:
    """What a fraction of ``activation_memory_budget`` is taken of: the CUDA device's
    memory, the simulated profile's, or none on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if isinstance(profile, DeviceProfile):
        return profile.memory_bytes
    return None
