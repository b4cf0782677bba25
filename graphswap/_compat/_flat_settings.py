"""``plan_memory``'s flat keywords of 0.2's first days (``plan_memory(config,
seq_len=4096, swap_offload_lag=2)``), kept working until 0.3 with a
``DeprecationWarning``: the typed call is ``plan_memory(config, StepShape(seq_len=4096),
schedule=SwapSchedule(swap_offload_lag=2))``. As everywhere in this package, the planner's
names are imported on use, so the package stays under every layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from graphswap._compat._warn import resolve, warn
from graphswap.errors import GraphswapError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Plan = TypeVar("Plan")

TYPED = frozenset(
    (
        "shape",
        "activation_swap",
        "schedule",
        "policy",
        "profile",
        "optimizer",
        "activation_memory_budget",
        "swap_bandwidth_gbps",
        "swap_tflops",
        "activation_checkpointing",
    )
)
"""``plan_memory``'s own keywords; any other is a flat setting."""


def flat_settings(plan: Callable[..., Plan]) -> Callable[..., Plan]:
    """``plan`` (``plan_memory``) also called with flat settings instead of ``shape`` and
    ``schedule``: they are made from them, with one warning naming the typed call, and
    refused in the order the flat call refused them (the mode, the budget, the names,
    the profile, ``seq_len``)."""

    @functools.wraps(plan)
    def planned(config: PretrainedConfig, *args: Any, **keywords: Any) -> Plan:
        flat = {name: keywords.pop(name) for name in list(keywords) if name not in TYPED}
        if not flat and (args or "shape" in keywords):
            return plan(config, *args, **keywords)
        memory_strategy = resolve("graphswap.planning._registry:memory_strategy")
        split_settings = resolve("graphswap.planning._settings:split_settings")
        resolve_profile = resolve("graphswap.planning._plan:resolve_profile")
        if args or "shape" in keywords or "schedule" in keywords:
            given = ", ".join(flat) or "no shape"
            raise _setting_error(
                "shape",
                given,
                "plan_memory takes a StepShape and a SwapSchedule, or (deprecated) their "
                "fields as keywords, not both; pass shape=StepShape(...) and "
                "schedule=SwapSchedule(...)",
            )
        memory_strategy(keywords.get("activation_swap", "attention")).check_budget(
            keywords.get("activation_memory_budget")
        )
        shape_settings, schedule, figures = split_settings("plan_memory", flat)
        keywords.update(figures)
        resolve_profile(
            keywords.get("profile", resolve("graphswap.planning._plan:DEFAULT_PROFILE")),
            swap_bandwidth_gbps=keywords.get("swap_bandwidth_gbps"),
            swap_tflops=keywords.get("swap_tflops"),
        )
        if "seq_len" not in shape_settings:
            raise _setting_error("seq_len", None, "is required: the tokens per sequence to plan")
        warn(
            f"plan_memory({'=..., '.join(flat)}=...) is deprecated: pass the step as "
            "plan_memory(config, StepShape(...), schedule=SwapSchedule(...)) "
            "(graphswap.planning.trace)",
            inside="graphswap.planning",
        )
        shape = resolve("graphswap.planning._settings:StepShape")(**shape_settings)
        return plan(config, shape, schedule=schedule, **keywords)

    return planned


def _setting_error(setting: str, value: object, detail: str) -> GraphswapError:
    """The planner's ``PlanSettingError`` (of :mod:`graphswap.hf`), imported on use."""
    error: GraphswapError = resolve("graphswap.hf.attention_kernels:PlanSettingError")(
        setting, value, detail
    )
    return error
