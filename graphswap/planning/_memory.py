"""``plan_memory``: the planner's entry, a step traced and planned by one memory
strategy (:mod:`graphswap.planning._registry` finds it by the config's name)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.planning._plan import DEFAULT_PROFILE, MemoryPlan, SwapMode, resolve_profile
from graphswap.planning._registry import memory_strategy
from graphswap.planning._settings import StepShape, split_settings
from graphswap.planning._trace import StepTrace
from graphswap.planning._trace_cache import trace_once
from graphswap.planning._units import RecomputeKind
from graphswap.planning.saved_tensors import build_meta_model
from graphswap.runtime.policy import SwapPolicy, swap_large_activations
from graphswap.runtime.profile import DeviceProfile

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def plan_memory(
    config: PretrainedConfig,
    *,
    activation_swap: SwapMode = "attention",
    policy: SwapPolicy | None = None,
    profile: str | DeviceProfile = DEFAULT_PROFILE,
    optimizer: bool = True,
    activation_memory_budget: int | None = None,
    **settings: Any,
) -> MemoryPlan:
    """Trace one training step of ``config`` on meta and predict it for one rank, with
    ``activation_swap`` and without.

    ``settings`` are flat keywords named as the trainer config's keys, as users and the
    swap pass hold them: the fields of :class:`~graphswap.planning.trace.StepShape`
    (``seq_len``, required; ``batch_size``, ``dtype``, ``attn_implementation``,
    ``device``, ``attn_kernel``, ``tp_size``, ``loss_head``, ``loss_head_chunk_size``) and
    of
    :class:`~graphswap.planning.trace.SwapSchedule` (``swap_hide_margin``,
    ``swap_offload_lag``, ``swap_prefetch_depth``, ``state_shards``,
    ``max_host_bytes``), each made once and checked there, and the profile's overrides
    ``swap_bandwidth_gbps`` (both link directions) and ``swap_tflops``. 0.1.0's names
    (``seq``, ``batch``, ``tp``, ``hide_margin``, ``offload_lag``, ``prefetch_depth``,
    ``bandwidth_gbps``, ``tflops``) work with a ``DeprecationWarning`` until 0.3.
    ``profile``: the device (a :data:`~graphswap.runtime.profile.PRESETS` name, a spec
    such as ``h200,link_gbps=25``, or a :class:`DeviceProfile`). ``policy`` defaults to
    the one the mode's rule runs. ``optimizer=False``: the step without AdamW (forward
    and backward after ``zero_grad``; no optimizer state on the device).
    ``activation_memory_budget``: with ``budget``, the device peak (bytes) to plan
    within; with the chunked head, ``loss_head_chunk_size`` is the largest chunk the
    plan may take (:meth:`~graphswap.planning._budget.BudgetStrategy.plan`). A bad setting raises
    :class:`PlanSettingError` (naming the config's key) or :class:`ProfileError` before
    any model is built.
    """
    strategy = memory_strategy(activation_swap)
    strategy.check_budget(activation_memory_budget)
    shape_settings, schedule, figures = split_settings("plan_memory", settings)
    resolved = resolve_profile(profile, **figures)
    if "seq_len" not in shape_settings:
        raise PlanSettingError("seq_len", None, "is required: the tokens per sequence to plan")
    shape = StepShape(**shape_settings)
    chosen_policy = swap_large_activations if policy is None else policy

    def trace(at: StepShape, recompute: tuple[RecomputeKind, ...] = ()) -> StepTrace:
        # Built every time (milliseconds), so that its checks run; the trace is made once.
        meta = build_meta_model(config, at, activation_swap=strategy.name, recompute=recompute)
        return trace_once(meta, at, recompute, resolved, chosen_policy, optimizer=optimizer)

    return strategy.plan(config, shape, trace, schedule, activation_memory_budget)
