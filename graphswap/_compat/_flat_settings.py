"""The planner's flat keywords of 0.2.0, kept working until 0.3 with a
``DeprecationWarning``: ``plan_memory(config, seq_len=4096, swap_offload_lag=2)``, whose
typed call is ``plan_memory(config, StepShape(seq_len=4096),
schedule=SwapSchedule(swap_offload_lag=2))``; ``fit_sequence(config, seq_step=1024,
state_shards=8)``, whose is ``fit_sequence(config, StepShape(seq_len=1024),
schedule=SwapSchedule(state_shards=8))``; and ``replay(trace, choice, offload_lag=2,
prefetch_depth=1, host_budget=...)``, whose is ``replay(trace, choice,
SwapSchedule(swap_offload_lag=2, max_host_bytes=...))``. As everywhere in this package, the
planner's names are imported on use, so the package stays under every layer.
"""

from __future__ import annotations

import functools
import sys
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


FIT_TYPED = frozenset(
    (
        "shape",
        "schedule",
        "memory_bytes",
        "profile",
        "modes",
        "max_step_ratio",
        "swap_bandwidth_gbps",
        "swap_tflops",
    )
)
"""``fit_sequence``'s own keywords; any other (``seq_step`` among them) is a flat setting."""


def flat_fit_settings(fit: Callable[..., Plan]) -> Callable[..., Plan]:
    """``fit`` (``fit_sequence``) also called with flat settings instead of ``shape`` and
    ``schedule``: ``seq_step`` (the fit's step, now the shape's ``seq_len``) and the
    shape's and schedule's fields; they are made into both, with one warning naming the
    typed call, and refused in the order the flat call refused them (the modes, the
    ratio, the names, ``seq_step``, ``seq_len``), but for the profile and the memory,
    which the fit checks after them."""

    @functools.wraps(fit)
    def fitted(config: PretrainedConfig, *args: Any, **keywords: Any) -> Plan:
        flat = {name: keywords.pop(name) for name in list(keywords) if name not in FIT_TYPED}
        if not flat:
            return fit(config, *args, **keywords)
        if args or "shape" in keywords or "schedule" in keywords:
            raise _setting_error(
                "shape",
                ", ".join(flat),
                "fit_sequence takes a StepShape and a SwapSchedule, or (deprecated) their "
                "fields and seq_step as keywords, not both; pass shape=StepShape(seq_len="
                "<the step>, ...) and schedule=SwapSchedule(...)",
            )
        for mode in keywords.get("modes", resolve("graphswap.planning._plan:SWAP_MODES")):
            resolve("graphswap.planning._registry:memory_strategy")(mode)
        resolve("graphswap.planning._fit:check_max_step_ratio")(keywords.get("max_step_ratio"))
        given = list(flat)
        seq_step = flat.pop("seq_step", resolve("graphswap.planning._fit:DEFAULT_SEQ_STEP"))
        shape, schedule, figures = resolve("graphswap.planning._fit:fit_settings")(
            "fit_sequence", flat, seq_step
        )
        warn(
            f"fit_sequence({'=..., '.join(given)}=...) is deprecated: pass the step as "
            "fit_sequence(config, StepShape(seq_len=<the step>, ...), "
            "schedule=SwapSchedule(...)) (graphswap.planning.trace)",
            inside="graphswap.planning",
        )
        return fit(config, shape, schedule=schedule, **keywords, **figures)

    return fitted


REPLAY_KEYWORDS = {
    "offload_lag": "swap_offload_lag",
    "prefetch_depth": "swap_prefetch_depth",
    "state_shards": "state_shards",
    "host_budget": "max_host_bytes",
}
"""``replay``'s keywords before it took a ``SwapSchedule`` -> that schedule's fields."""


def schedule_keywords(replay: Callable[..., Plan]) -> Callable[..., Plan]:
    """``replay`` also called with its schedule as keywords of their own (before it took
    a ``SwapSchedule``): the schedule is made of them, with one warning naming the typed
    call. ``host_budget=None`` was no cap: a cap no pool reaches."""

    @functools.wraps(replay)
    def replayed(trace: Any, choice: Any, *args: Any, **keywords: Any) -> Plan:
        old = {name: keywords.pop(name) for name in list(keywords) if name in REPLAY_KEYWORDS}
        if not old:
            return replay(trace, choice, *args, **keywords)
        if args or keywords:
            raise _setting_error(
                "schedule",
                ", ".join([*old, *keywords]),
                "replay takes a SwapSchedule, or (deprecated) its fields as keywords, not "
                "both; pass replay(trace, choice, SwapSchedule(...))",
            )
        fields = {REPLAY_KEYWORDS[name]: value for name, value in old.items()}
        uncapped = fields.get("max_host_bytes") is None
        warn(
            f"replay({'=..., '.join(old)}=...) is deprecated: pass "
            f"replay(trace, choice, SwapSchedule({'=..., '.join(fields)}=...)) "
            "(graphswap.planning.trace)"
            + (
                "; host_budget unset was no cap, where an unset max_host_bytes is the "
                "profile's node's share"
                if uncapped
                else ""
            ),
            inside="graphswap.planning",
        )
        if uncapped:
            fields["max_host_bytes"] = sys.maxsize
        return replay(trace, choice, resolve("graphswap.planning._settings:SwapSchedule")(**fields))

    return replayed


def _setting_error(setting: str, value: object, detail: str) -> GraphswapError:
    """The planner's ``PlanSettingError`` (of :mod:`graphswap.hf`), imported on use."""
    error: GraphswapError = resolve("graphswap.hf.attention_kernels:PlanSettingError")(
        setting, value, detail
    )
    return error
