"""The memory strategies that plan from one traced step: ``none``, ``attention``,
``layer`` and ``auto``, one object each, sharing :class:`MemoryStrategy`'s protocol.

A strategy turns a trace into one :class:`~graphswap.planning.MemoryPlan` of per-layer
decisions: which modules its rule wraps (:attr:`MemoryStrategy.scope`), which saves
each layer swaps (:meth:`MemoryStrategy.decide`) and what the plan assumes. ``budget``,
which plans a trace per recompute level, is :class:`~graphswap.planning._budget.BudgetStrategy`;
:func:`~graphswap.planning._registry.memory_strategy` finds any of the five by the name a
config holds, once, at the edge (the config, the CLI, ``plan_memory``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.planning._auto import SwapCandidate, layer_candidates, plan_auto
from graphswap.planning._plan import (
    SWAP_MODES,
    MemoryPlan,
    StepDecision,
    SwapMode,
    assemble_plan,
)
from graphswap.planning._replay import Replay, SwapChoice, replay, replay_without_swap
from graphswap.planning._settings import DEFAULT_SCHEDULE, StepShape, SwapSchedule
from graphswap.planning._trace import StepTrace
from graphswap.planning._units import RecomputeKind
from graphswap.planning._windows import group_of
from graphswap.planning.saved_tensors import ATTENTION_SCOPE, LAYER_SCOPE

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Traces = Callable[[StepShape, tuple[RecomputeKind, ...]], StepTrace]
"""The step of a shape with the recompute levels given, traced (once) on demand."""

AUTO_LAGS = (1, 2)
"""The offload lags ``auto`` plans at when the lag is not set: a layer's copies get one or
two later layers' forward to finish; the lag with the lower peak is kept."""


class MemoryStrategy:
    """One memory strategy: from a traced step, one plan of per-layer decisions.

    Subclasses set the class attributes and :meth:`decide`; the planner, the fit and the
    swap pass ask these, never the strategy's name."""

    name: ClassVar[SwapMode]
    """The config's ``activation_swap`` value that selects it."""
    scope: ClassVar[str | None]
    """The modules its rule wraps: ``attention``, ``layer``, or ``None`` (none)."""
    names_saves: ClassVar[bool] = False
    """Its plan names every save it swaps (per layer, by index), for the runtime."""
    executes_plan: ClassVar[bool] = False
    """The swap pass carries it out from a plan of the model's shape (the plan executor),
    not from the rule's size policy alone."""
    takes_budget: ClassVar[bool] = False
    """It plans within ``activation_memory_budget``."""
    recomputes: ClassVar[bool] = False
    """Its plan may recompute submodules in backward (a recompute level per layer)."""
    weighs_others: ClassVar[bool] = False
    """It weighs other strategies' plans (a fit plans it after them, to reuse theirs)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def check_budget(self, budget: int | None) -> None:
        """A budget is for ``budget`` only: any other strategy refuses one."""
        if budget is not None:
            raise PlanSettingError(
                "activation_memory_budget",
                budget,
                f"is planned within by activation_swap: budget only, not {self.name}",
            )

    def checkpointed(self) -> MemoryStrategy:
        """The strategy for a trainer that checkpoints every layer itself: only one that
        owns recompute (``budget``) honours it; the others refuse, since their swap would
        handle the checkpointed layers a second time."""
        raise PlanSettingError(
            "activation_checkpointing",
            True,
            f"is honoured by activation_swap: budget only, which owns recompute; not by"
            f" {self.name}, whose swap it would handle a second time",
        )

    def plan(
        self,
        config: PretrainedConfig,
        shape: StepShape,
        traces: Traces,
        schedule: SwapSchedule,
        budget: int | None,
    ) -> MemoryPlan:
        """``plan_memory``'s plan: the step of ``shape``, traced, planned."""
        return self.plan_step(config, traces(shape, ()), schedule)

    def plan_step(
        self,
        config: PretrainedConfig,
        trace: StepTrace,
        schedule: SwapSchedule = DEFAULT_SCHEDULE,
        baseline: Replay | None = None,
    ) -> MemoryPlan:
        """The plan on a traced step; ``baseline``: the step replayed without swap, when
        already at hand."""
        if baseline is None:
            baseline = replay_without_swap(trace, schedule)
        candidates = layer_candidates(trace.saved)
        per_layer = [candidates[layer.name] for layer in trace.saved.layers]
        decision = self.decide(trace, per_layer, schedule, baseline)
        return assemble_plan(config, trace, self, decision, schedule, baseline)

    def fit_plan(
        self,
        config: PretrainedConfig,
        trace: StepTrace,
        levels: Callable[[tuple[RecomputeKind, ...]], StepTrace],
        schedule: SwapSchedule,
        baseline: Replay,
        memory: int,
        made: Mapping[tuple[tuple[RecomputeKind, ...], str], MemoryPlan],
    ) -> MemoryPlan:
        """A fit's plan at one length: ``trace`` (``levels``: the length's trace per
        recompute level) within ``memory``, reusing ``made``, the plans of the strategies
        already planned there, by recompute level and name."""
        return self.plan_step(config, trace, schedule, baseline)

    def decide(
        self,
        trace: StepTrace,
        candidates: Sequence[Sequence[SwapCandidate]],
        schedule: SwapSchedule,
        baseline: Replay,
    ) -> StepDecision:
        """What each layer swaps, from ``candidates`` (per layer, what ``layer`` would);
        a strategy that does not plan from one trace (``budget``) refuses."""
        from_name_refusal(self.name)

    def assumptions(self, schedule: SwapSchedule, lag_chosen: bool) -> tuple[str, ...]:
        """What its plan, made at ``schedule`` (its lag set), takes for granted about the
        copies, in words; ``lag_chosen``: the strategy chose the lag."""
        return ()


class NoSwap(MemoryStrategy):
    """``none``: nothing is wrapped or swapped; the step as it runs."""

    name = "none"
    scope = None

    def decide(
        self,
        trace: StepTrace,
        candidates: Sequence[Sequence[SwapCandidate]],
        schedule: SwapSchedule,
        baseline: Replay,
    ) -> StepDecision:
        return StepDecision([[] for _ in candidates], baseline, at_lag(schedule, schedule.lag()))


def at_lag(schedule: SwapSchedule, lag: int) -> SwapSchedule:
    """``schedule`` at the offload lag ``lag``: the one a strategy plans at."""
    return dataclasses.replace(schedule, swap_offload_lag=lag)


def _copies(schedule: SwapSchedule) -> str:
    offload_lag, prefetch_depth = schedule.lag(), schedule.swap_prefetch_depth
    return (
        f"copies: a module's offloads run on one device-to-host queue after the compute that "
        f"made them and must be done when the forward {offload_lag} module(s) later begins "
        f"(swap_offload_lag {offload_lag}; compute waits there); its reloads are issued, "
        f"first-needed first, when backward reaches the module {prefetch_depth} link(s) later "
        f"(swap_prefetch_depth {prefetch_depth}) and run on one host-to-device queue, both "
        "directions at once; the last module in forward order keeps its tensors"
    )


_WHOLE_LAYER = (
    "layer and auto: the swapped bytes count a storage only when every save of it is in "
    "one layer and the policy swaps the first (later saves share its copy, as in the "
    "runtime; the rotary cos/sin, saved by every layer, stay)"
)


class _WrapSwap(MemoryStrategy):
    """A rule's wrapped modules, each swapping what the rule's size policy swaps."""

    scope: ClassVar[str]

    def decide(
        self,
        trace: StepTrace,
        candidates: Sequence[Sequence[SwapCandidate]],
        schedule: SwapSchedule,
        baseline: Replay,
    ) -> StepDecision:
        scope = self.scope
        swaps = frozenset(
            i
            for i, s in enumerate(trace.saves)
            if s.save.policy_swaps and group_of(s, scope) is not None
        )
        made_at = at_lag(schedule, schedule.lag())
        replayed = replay(trace, SwapChoice(scope, swaps), made_at)
        return StepDecision(candidates, replayed, made_at)


class AttentionSwap(_WrapSwap):
    """``attention``: each layer's attention wrapped; what its size policy swaps moves."""

    name = "attention"
    scope = ATTENTION_SCOPE

    def assumptions(self, schedule: SwapSchedule, lag_chosen: bool) -> tuple[str, ...]:
        return (_copies(schedule),)


class LayerSwap(_WrapSwap):
    """``layer``: whole decoder layers wrapped; every storage the policy swaps moves."""

    name = "layer"
    scope = LAYER_SCOPE
    names_saves = True

    def assumptions(self, schedule: SwapSchedule, lag_chosen: bool) -> tuple[str, ...]:
        return (_copies(schedule), _WHOLE_LAYER)


class AutoSwap(MemoryStrategy):
    """``auto``: whole layers wrapped; per layer, the storages whose copies hide in both
    windows (:func:`~graphswap.planning._auto.plan_auto`), at the lag with the lower peak
    when the lag is not set."""

    name = "auto"
    scope = LAYER_SCOPE
    names_saves = True
    executes_plan = True

    def decide(
        self,
        trace: StepTrace,
        candidates: Sequence[Sequence[SwapCandidate]],
        schedule: SwapSchedule,
        baseline: Replay,
    ) -> StepDecision:
        offload_lag = schedule.swap_offload_lag
        lags = AUTO_LAGS if offload_lag is None else (offload_lag,)
        plans = [plan_auto(trace, candidates, at_lag(schedule, lag)) for lag in lags]
        best = min(range(len(lags)), key=lambda i: plans[i].replay.timeline.peak_bytes)
        auto = plans[best]
        fields = {
            "swap_hide_margin": float(schedule.swap_hide_margin),
            "auto_dropped": auto.dropped,
            "swap_offload_lag_chosen": offload_lag is None,
            **_layer_would_swap(candidates, trace.saved.layers),
        }
        return StepDecision(list(auto.chosen), auto.replay, at_lag(schedule, lags[best]), fields)

    def assumptions(self, schedule: SwapSchedule, lag_chosen: bool) -> tuple[str, ...]:
        return (
            _copies(schedule),
            _WHOLE_LAYER,
            "auto: per layer, largest first, the tensors whose offload meets its fence and whose "
            "reload meets its unpack and whose host buffer fits the host budget, both queues "
            "simulated at (1 - margin) of the link; then replayed at the full link, dropping a "
            "stalling layer's smallest until none stalls"
            + (
                f"; planned at swap_offload_lag {' and '.join(map(str, AUTO_LAGS))}, keeping "
                f"{schedule.lag()}, whose peak is lower"
                if lag_chosen
                else ""
            ),
        )


def _layer_would_swap(
    candidates: Sequence[Sequence[SwapCandidate]], layers: Sequence[Any]
) -> dict[str, Any]:
    """What ``layer`` would have swapped, for the report of what ``auto`` chose."""
    swapped = [
        (c.nbytes, layer.name)
        for layer, cs in zip(layers[:-1], candidates[:-1], strict=True)
        for c in cs
    ]
    smallest = min(swapped, default=None)
    return {
        "layer_swappable_bytes": sum(nbytes for nbytes, _ in swapped),
        "smallest_swappable": None if smallest is None else (smallest[1], smallest[0]),
    }


def plan_step(
    config: PretrainedConfig,
    trace: StepTrace,
    *,
    activation_swap: SwapMode,
    schedule: SwapSchedule = DEFAULT_SCHEDULE,
    baseline: Replay | None = None,
) -> MemoryPlan:
    """The plan of ``activation_swap`` on a traced step, with the policy it was traced
    with and ``schedule``; ``baseline``: the step replayed without swap, when already at
    hand. ``budget`` plans a trace per recompute level: ``plan_memory`` makes it."""
    strategy = STEP_STRATEGIES.get(activation_swap)
    if strategy is None:
        from_name_refusal(activation_swap)
    return strategy.plan_step(config, trace, schedule, baseline)


STEP_STRATEGIES: dict[str, MemoryStrategy] = {
    s.name: s for s in (NoSwap(), AttentionSwap(), LayerSwap(), AutoSwap())
}
"""The strategies that plan from one trace, by name."""


def from_name_refusal(name: object) -> NoReturn:
    """Refuse a strategy name that :data:`STEP_STRATEGIES` lacks: ``budget`` (planned from
    a trace per recompute level), or one that names none."""
    if name == "budget":
        raise PlanSettingError(
            "activation_swap",
            "budget",
            "is planned from a trace per recompute level: use plan_memory or plan_budget",
        )
    raise PlanSettingError("activation_swap", name, f"must be one of {', '.join(SWAP_MODES)}")
