"""``plan_memory``: the planner's entry, a step traced and planned by one memory
strategy (:mod:`graphswap.planning._registry` finds it by the config's name)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphswap import _compat
from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.planning._plan import DEFAULT_PROFILE, MemoryPlan, SwapMode, resolve_profile
from graphswap.planning._registry import memory_strategy
from graphswap.planning._settings import DEFAULT_SCHEDULE, StepShape, SwapSchedule
from graphswap.planning._trace import StepTrace
from graphswap.planning._trace_cache import trace_once
from graphswap.planning._units import RecomputeKind
from graphswap.planning.saved_tensors import build_meta_model
from graphswap.runtime.policy import SwapPolicy, swap_large_activations
from graphswap.runtime.profile import DeviceProfile

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@_compat.flat_settings
def plan_memory(
    config: PretrainedConfig,
    shape: StepShape,
    *,
    activation_swap: SwapMode = "attention",
    schedule: SwapSchedule = DEFAULT_SCHEDULE,
    policy: SwapPolicy | None = None,
    profile: str | DeviceProfile = DEFAULT_PROFILE,
    optimizer: bool = True,
    activation_memory_budget: int | None = None,
    swap_bandwidth_gbps: float | None = None,
    swap_tflops: float | None = None,
    activation_checkpointing: bool = False,
) -> MemoryPlan:
    """Trace one training step of ``config`` of ``shape`` on meta and predict it for one
    rank, with ``activation_swap`` and without.

    ``shape``: the step (:class:`~graphswap.planning.trace.StepShape`: ``seq_len``,
    ``batch_size``, dtype, attention, device, ``tp_size``, the loss head); ``schedule``:
    the swap's (:class:`~graphswap.planning.trace.SwapSchedule`: ``swap_hide_margin``,
    ``swap_offload_lag``, ``swap_prefetch_depth``, ``state_shards``,
    ``max_host_bytes``), each checked when made; their fields are the trainer config's
    keys. ``swap_bandwidth_gbps`` (both link directions) and ``swap_tflops`` override
    the profile's figures. ``profile``: the device (a
    :data:`~graphswap.runtime.profile.PRESETS` name, a spec such as
    ``h200,link_gbps=25``, or a :class:`DeviceProfile`). ``policy`` defaults to the one
    the mode's rule runs. ``optimizer=False``: the step without AdamW (forward and
    backward after ``zero_grad``; no optimizer state on the device).
    ``activation_memory_budget``: with ``budget``, the device peak (bytes) to plan
    within; with the chunked head, ``loss_head_chunk_size`` is the largest chunk the
    plan may take (:meth:`~graphswap.planning._budget.BudgetStrategy.plan`).
    ``activation_checkpointing``: the trainer checkpoints every layer itself; ``budget``
    honours it by recomputing every whole layer and deciding how much of their inputs to
    swap (:meth:`~graphswap.planning._strategy.MemoryStrategy.checkpointed`); the
    embeddings' output requires grad, as the trainer's checkpointing makes it (what a LoRA
    step's first layer saves). A bad setting raises :class:`PlanSettingError` (naming
    the config's key) or :class:`ProfileError` before any model is built.

    The fields of ``shape`` and ``schedule`` as flat keywords (``seq_len=4096``; 0.1.0's
    ``seq=4096`` too) still work until 0.3, with a ``DeprecationWarning``
    (:mod:`graphswap._compat._flat_settings`).
    """
    strategy = memory_strategy(activation_swap)
    strategy.check_budget(activation_memory_budget)
    if activation_checkpointing:
        strategy = strategy.checkpointed()
    resolved = resolve_profile(
        profile, swap_bandwidth_gbps=swap_bandwidth_gbps, swap_tflops=swap_tflops
    )
    for name, value, kind in (("shape", shape, StepShape), ("schedule", schedule, SwapSchedule)):
        if not isinstance(value, kind):
            raise PlanSettingError(
                name, value, f"must be a {kind.__name__} (graphswap.planning.trace)"
            )
    chosen_policy = swap_large_activations if policy is None else policy

    def trace(at: StepShape, recompute: tuple[RecomputeKind, ...] = ()) -> StepTrace:
        # Built every time (milliseconds), so that its checks run; the trace is made once.
        meta = build_meta_model(
            config,
            at,
            activation_swap=strategy.name,
            recompute=recompute,
            activation_checkpointing=activation_checkpointing,
        )
        return trace_once(meta, at, recompute, resolved, chosen_policy, optimizer=optimizer)

    return strategy.plan(config, shape, trace, schedule, activation_memory_budget)
