"""``plan_memory``: the planner's entry, a step traced and planned in one swap mode.

Apart from :mod:`graphswap.planning._plan` (one step's plan, ``plan_step``) and
:mod:`graphswap.planning._budget` (the ``budget`` choice, which plans each option with
``plan_step``), so that both are below it and neither imports the other back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.planning._budget import CHECKPOINTED_LEVELS, BudgetError, plan_budget
from graphswap.planning._plan import (
    DEFAULT_PROFILE,
    MemoryPlan,
    SwapMode,
    check_mode,
    plan_step,
    resolve_profile,
)
from graphswap.planning._settings import StepShape, SwapSchedule, check_int, split_settings
from graphswap.planning._trace import StepTrace
from graphswap.planning._trace_cache import trace_once
from graphswap.planning._units import RECOMPUTE_LEVELS, RecomputeKind
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
    activation_checkpointing: bool = False,
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
    plan may take (:func:`_budget_with_head`). ``activation_checkpointing``: with
    ``budget``, the trainer checkpoints every layer (its own ``activation_checkpointing``);
    the plan honours it by recomputing every whole layer, and decides how much of their
    inputs to swap; the embeddings' output requires grad, as the trainer's checkpointing
    makes it (what a LoRA step's first layer saves). A bad setting raises
    :class:`PlanSettingError` (naming the config's key) or :class:`ProfileError` before
    any model is built.
    """
    check_mode(activation_swap)
    check_budget(activation_swap, activation_memory_budget)
    if activation_checkpointing and activation_swap != "budget":
        raise PlanSettingError(
            "activation_checkpointing",
            True,
            f"is honoured by activation_swap: budget only, which owns recompute; not by"
            f" {activation_swap}, whose swap it would handle a second time",
        )
    shape_settings, schedule, figures = split_settings("plan_memory", settings)
    resolved = resolve_profile(profile, **figures)
    if "seq_len" not in shape_settings:
        raise PlanSettingError("seq_len", None, "is required: the tokens per sequence to plan")
    shape = StepShape(**shape_settings)
    chosen_policy = swap_large_activations if policy is None else policy

    def trace(at: StepShape, recompute: tuple[RecomputeKind, ...] = ()) -> StepTrace:
        # Built every time (milliseconds), so that its checks run; the trace is made once.
        meta = build_meta_model(
            config,
            at,
            activation_swap=activation_swap,
            recompute=recompute,
            activation_checkpointing=activation_checkpointing,
        )
        return trace_once(meta, at, recompute, resolved, chosen_policy, optimizer=optimizer)

    if activation_swap == "budget":
        assert activation_memory_budget is not None
        levels = CHECKPOINTED_LEVELS if activation_checkpointing else RECOMPUTE_LEVELS
        return _budget_with_head(
            config, shape, trace, activation_memory_budget, schedule, levels=levels
        )
    return plan_step(config, trace(shape), activation_swap=activation_swap, schedule=schedule)


CHUNK_SIZES_WEIGHED = 4
"""``budget`` with the chunked head weighs the configured chunk size and up to three
halvings of it, none below :data:`SMALLEST_CHUNK`."""
SMALLEST_CHUNK = 128
"""Tokens: below this a chunk's projection no longer runs a GPU at its matrix rate."""


def _budget_with_head(
    config: PretrainedConfig,
    shape: StepShape,
    trace: Callable[[StepShape, tuple[RecomputeKind, ...]], StepTrace],
    budget: int,
    schedule: SwapSchedule,
    *,
    levels: Sequence[tuple[RecomputeKind, ...]] = RECOMPUTE_LEVELS,
) -> MemoryPlan:
    """The budget's plan, the loss head one of its decisions: with the chunked head, each
    chunk size weighed (largest first) is planned at every recompute level, and the
    fastest plan within ``budget`` kept. A smaller chunk lowers the head's peak, which can
    let a cheaper level meet the budget; it costs no FLOPs. Weighing stops at a plan that
    recomputes nothing (none is faster), and the smallest chunk's refusal is raised when
    no size fits, since it names the smallest peak."""
    sizes = [shape.loss_head_chunk_size]
    if shape.loss_head == "chunked":
        while len(sizes) < CHUNK_SIZES_WEIGHED and sizes[-1] // 2 >= SMALLEST_CHUNK:
            sizes.append(sizes[-1] // 2)
    best: MemoryPlan | None = None
    for size in sizes:
        at = dataclasses.replace(shape, loss_head_chunk_size=size)
        try:
            plan = plan_budget(
                config,
                functools.partial(trace, at),
                budget=budget,
                schedule=schedule,
                levels=levels,
            )
        except BudgetError:
            if best is None and size == sizes[-1]:
                raise  # the smallest chunk's refusal: it names the smallest peak
            continue
        if best is None or plan.timeline.step_seconds < best.timeline.step_seconds:
            best = plan
        if not plan.recompute:
            break
    assert best is not None, "the last size either planned or raised"
    return best


def check_budget(activation_swap: str, activation_memory_budget: int | None) -> None:
    """``budget`` needs a budget in bytes > 0; the other modes take none."""
    if activation_swap == "budget":
        check_int(
            "activation_memory_budget",
            activation_memory_budget,
            1,
            "the device peak in bytes that activation_swap: budget plans within",
        )
    elif activation_memory_budget is not None:
        raise PlanSettingError(
            "activation_memory_budget",
            activation_memory_budget,
            f"is planned within by activation_swap: budget only, not {activation_swap}",
        )
