"""``budget``: keep, swap or recompute each saved tensor so that the step's device peak
stays within a memory budget, at the least predicted step time.

The decisions have three prices. Keeping costs memory. Swapping costs nothing while its
copies hide and a stall when they do not (the replay says which). Recomputing costs
the recomputed submodules' roofline time at their backward, on the compute stream
(which also widens the window the layer's reloads hide in). The plan tries what
each layer recomputes in :data:`~graphswap.planning._units.RECOMPUTE_LEVELS` order,
cheapest first, each traced for real (the trace runs the recompute in backward, so
its time and its memory come from the same run the clock checks), and at each level
two swaps: ``auto`` (what hides) and ``layer`` (everything, stalls included). The
fastest option whose peak is within the budget wins; past the first level whose
``auto`` fits, the levels only cost more, so the search stops there. A trainer that
checkpoints every layer (its ``activation_checkpointing``) is honoured by weighing the
whole-layer level alone (:data:`CHECKPOINTED_LEVELS`): graphswap owns the recompute it
asked for, and decides only how much of the layers' inputs to swap.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.planning._plan import LayerPlan, MemoryPlan
from graphswap.planning._replay import Replay, replay_without_swap
from graphswap.planning._settings import DEFAULT_SCHEDULE, StepShape, SwapSchedule, check_int
from graphswap.planning._strategy import (
    STEP_STRATEGIES,
    MemoryStrategy,
    Traces,
    from_name_refusal,
)
from graphswap.planning._trace import Event, StepTrace
from graphswap.planning._units import RECOMPUTE_LEVELS, RecomputeKind
from graphswap.planning.saved_tensors import LAYER_SCOPE
from graphswap.runtime.timeline import backward_label

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)\s*([A-Za-z]*)\s*")
SIZE_EXAMPLES = "141GiB, 80GB or 8e10 (bytes); units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"


def parse_size(text: str) -> int | None:
    """``141GiB``, ``80GB``, ``8e10``: bytes; ``None`` when ``text`` is not a finite size."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        return None
    value = float(match.group(1)) * _UNITS[unit]
    return int(value) if math.isfinite(value) else None


def read_memory_budget(value: int | float | str) -> int | float:
    """``activation_memory_budget`` as the user wrote it: bytes (an ``int``), or a
    fraction of the device's memory (a ``float`` in (0, 1]).

    A number reads alike whether YAML, an override or a flag spells it: up to 1 it is a
    fraction (``0.85``, ``"0.85"``), above 1 bytes (``2e7``, ``8e10``); an integer is
    bytes (``1`` is one byte, ``1.0`` the whole memory); with a unit it is a size
    (``120GiB``)."""
    setting = "activation_memory_budget"
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise PlanSettingError(
                setting,
                value,
                f"expected a size such as {SIZE_EXAMPLES}, or a fraction of the device's"
                " memory such as 0.85",
            )
        number = match.group(1)
        if match.group(2):
            value = float(number) * _UNITS[match.group(2).lower()]
        else:
            value = int(number) if number.isdigit() else float(number)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanSettingError(setting, value, "expected bytes, a size or a fraction")
    if not math.isfinite(value):
        raise PlanSettingError(
            setting, value, f"is not a finite number of bytes; give a size such as {SIZE_EXAMPLES}"
        )
    if isinstance(value, float) and 0 < value <= 1:
        return value
    if value < 1:
        raise PlanSettingError(
            setting,
            value,
            "must be at least one byte, or a fraction of the device's memory in (0, 1]"
            " such as 0.85",
        )
    return int(value)


def resolve_memory_budget(
    value: int | float | str, device_memory: int | None, *, device: str = "the device"
) -> int:
    """``activation_memory_budget`` in bytes (:func:`read_memory_budget`): a fraction is
    taken of ``device_memory``, which bytes may not exceed; ``device`` names what has
    that memory (a profile), for the error."""
    setting = "activation_memory_budget"
    budget = read_memory_budget(value)
    if device_memory is None:
        if isinstance(budget, float):
            raise PlanSettingError(
                setting,
                value,
                "is a fraction of the device's memory, but this device has none to take it "
                "of; give a size such as 120GiB",
            )
        return budget
    if isinstance(budget, float):
        return int(budget * device_memory)
    if budget > device_memory:
        raise PlanSettingError(
            setting,
            value,
            f"is {budget} bytes, more than the {device_memory} bytes"
            f" ({device_memory / 2**30:.2f} GiB) of {device}'s memory; give at most that,"
            " or a fraction of it such as 0.85",
        )
    return budget


CHECKPOINTED_LEVELS: tuple[tuple[RecomputeKind, ...], ...] = (("layer",),)
"""The levels weighed when the trainer checkpoints every layer: at least the whole layer,
as its activation checkpointing recomputes it, with the layer's inputs kept or swapped."""

BUDGET_SWAPS = ("auto", "layer")
"""The swaps tried at each recompute level: what hides, and everything."""


class BudgetError(PlanSettingError):
    """No plan keeps the step's device peak within the budget; ``options`` are those
    weighed, ``smallest`` the one that comes closest."""

    def __init__(self, budget: int, options: tuple[BudgetOption, ...]) -> None:
        smallest = min(options, key=lambda o: o.peak_bytes)
        self.options = options
        self.smallest = smallest
        super().__init__(
            "activation_memory_budget",
            budget,
            f"no plan fits: the smallest peak any plan reaches is {smallest.peak_bytes} bytes "
            f"({smallest.peak_bytes / 2**30:.2f} GiB, recomputing "
            f"{' and '.join(smallest.recompute) or 'nothing'} and swapping with "
            f"{smallest.swap}); give at least that, or shard the state over more ranks",
        )


@dataclass(frozen=True)
class BudgetOption:
    """One option the budget plan weighed."""

    recompute: tuple[RecomputeKind, ...]
    """What every layer recomputes."""
    swap: str
    """``auto`` (what hides) or ``layer`` (everything the layer swap moves)."""
    peak_bytes: int
    """The step's device peak with it."""
    step_ratio: float
    """Its step time against the step with nothing swapped or recomputed."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _backward_seconds(trace: StepTrace) -> list[float]:
    """Compute seconds under each layer's backward label."""
    labels = {backward_label(i): i for i in range(trace.num_layers)}
    seconds = [0.0] * trace.num_layers
    layer: int | None = None
    label, compute = Event.LABEL, Event.COMPUTE  # locals: a member's lookup is slow
    for event, payload in trace.events:
        if event is label:
            layer = labels.get(payload)
        elif event is compute and layer is not None:
            seconds[layer] += payload
    return seconds


def plan_budget(
    config: PretrainedConfig,
    traces: Callable[[tuple[RecomputeKind, ...]], StepTrace],
    *,
    budget: int,
    schedule: SwapSchedule,
    baseline: Replay | None = None,
    known: Mapping[tuple[tuple[RecomputeKind, ...], str], MemoryPlan] | None = None,
    levels: Sequence[tuple[RecomputeKind, ...]] = RECOMPUTE_LEVELS,
) -> MemoryPlan:
    """The fastest plan whose device peak is at most ``budget`` bytes; ``traces(kinds)``
    is the step with ``kinds`` recomputed in every layer. Raises :class:`BudgetError`
    naming the smallest budget a plan meets when none fits. ``known``: plans already made
    with ``schedule``, by recompute level and swap (a fit's ``auto`` and ``layer``).
    ``levels``: the recompute levels weighed, cheapest first (:data:`CHECKPOINTED_LEVELS`
    where the trainer checkpoints every layer)."""
    plain = traces(())
    if baseline is None:
        baseline = replay_without_swap(plain, schedule)
    base_seconds = baseline.timeline.step_seconds
    plain_backward = _backward_seconds(plain)
    options: list[BudgetOption] = []
    best: tuple[float, MemoryPlan, StepTrace, BudgetOption] | None = None
    if () in levels and baseline.timeline.peak_bytes <= budget:
        keep = (known or {}).get(((), "none")) or STEP_STRATEGIES["none"].plan_step(
            config, plain, schedule, baseline
        )
        option = BudgetOption((), "none", keep.timeline.peak_bytes, keep.step_ratio)
        options.append(option)
        best = (keep.timeline.step_seconds, keep, plain, option)
    else:
        for kinds in levels:
            trace = plain if not kinds else traces(kinds)
            fits_hidden = False
            for swap in BUDGET_SWAPS:
                if fits_hidden:
                    break  # what hides fits: swapping everything only adds stalls
                # Every option is timed against the plain step (the chosen plan's
                # baseline is replaced by it below): a recomputed level's own step
                # without swap would be replayed for nothing.
                plan = (known or {}).get((kinds, swap)) or STEP_STRATEGIES[swap].plan_step(
                    config, trace, schedule, baseline
                )
                seconds = plan.timeline.step_seconds
                option = BudgetOption(kinds, swap, plan.timeline.peak_bytes, seconds / base_seconds)
                options.append(option)
                if option.peak_bytes > budget:
                    continue
                fits_hidden = fits_hidden or swap == "auto"
                if best is None or seconds < best[0]:
                    best = (seconds, plan, trace, option)
            if fits_hidden:
                break
    if best is None:
        raise BudgetError(budget, tuple(options))
    _, chosen, trace, option = best
    recompute_seconds = [
        max(0.0, after - before)
        for after, before in zip(_backward_seconds(trace), plain_backward, strict=True)
    ]
    layers = tuple(
        _with_recompute(layer, trace, recompute_seconds[i]) for i, layer in enumerate(chosen.layers)
    )
    return dataclasses.replace(
        chosen,
        activation_swap="budget",
        layers=layers,
        baseline=baseline.timeline,
        activation_memory_budget=budget,
        recompute=option.recompute,
        budget_swap=option.swap,
        budget_options=tuple(options),
        assumptions=chosen.assumptions + _budget_assumptions(option, levels),
    )


def _with_recompute(layer: LayerPlan, trace: StepTrace, seconds: float) -> LayerPlan:
    if not trace.recomputed:
        return layer
    return dataclasses.replace(
        layer,
        recomputed=trace.recomputed[layer.index],
        recomputed_bytes=trace.recomputed_bytes[layer.index],
        recompute_seconds=seconds,
    )


def _budget_assumptions(
    option: BudgetOption, levels: Sequence[tuple[RecomputeKind, ...]]
) -> tuple[str, ...]:
    if tuple(levels) == RECOMPUTE_LEVELS:
        tried = (
            "recompute levels tried cheapest first (nothing, the norms, the norms and what lies"
            " between the feed-forward block's matmuls, that and its down projections, the"
            " norms and the whole block, the whole layer; in every layer)"
        )
    else:
        tried = "recompute levels tried: " + ", ".join(
            " and ".join(kinds) or "nothing" for kinds in levels
        )
    return (
        f"budget: {tried}, each traced with the recompute running in backward; at each, the"
        " swap of what hides (auto) and of everything (layer); the fastest option whose device"
        " peak is within the budget is kept"
        f" (here: recompute {' and '.join(option.recompute) or 'nothing'}, swap {option.swap})",
    )


CHUNK_SIZES_WEIGHED = 4
"""``budget`` with the chunked head weighs the configured chunk size and up to three
halvings of it, none below :data:`SMALLEST_CHUNK`."""
SMALLEST_CHUNK = 128
"""Tokens: below this a chunk's projection no longer runs a GPU at its matrix rate."""


class BudgetStrategy(MemoryStrategy):
    """``budget``: per layer what to keep, swap and recompute, and the loss head's chunk,
    within ``activation_memory_budget`` at the least predicted step time
    (:func:`plan_budget`)."""

    name = "budget"
    scope = LAYER_SCOPE
    names_saves = True
    executes_plan = True
    takes_budget = True
    recomputes = True
    weighs_others = True

    def __init__(self, levels: Sequence[tuple[RecomputeKind, ...]] = RECOMPUTE_LEVELS) -> None:
        self.levels = tuple(levels)
        """The recompute levels weighed, cheapest first (:data:`CHECKPOINTED_LEVELS`
        where the trainer checkpoints every layer)."""

    def __repr__(self) -> str:
        if self.levels == RECOMPUTE_LEVELS:
            return "BudgetStrategy()"
        return f"BudgetStrategy(levels={self.levels!r})"

    def checkpointed(self) -> BudgetStrategy:
        """The trainer checkpoints every layer: weigh the whole-layer level alone
        (:data:`CHECKPOINTED_LEVELS`); graphswap owns that recompute and decides only how
        much of the layers' inputs to swap."""
        return BudgetStrategy(CHECKPOINTED_LEVELS)

    def check_budget(self, budget: int | None) -> None:
        """``budget`` needs a budget in bytes > 0."""
        check_int(
            "activation_memory_budget",
            budget,
            1,
            "the device peak in bytes that activation_swap: budget plans within",
        )

    def plan(
        self,
        config: PretrainedConfig,
        shape: StepShape,
        traces: Traces,
        schedule: SwapSchedule,
        budget: int | None,
    ) -> MemoryPlan:
        """The budget's plan, the loss head one of its decisions: with the chunked head,
        each chunk size weighed (largest first) is planned at every recompute level, and
        the fastest plan within ``budget`` kept. A smaller chunk lowers the head's peak,
        which can let a cheaper level meet the budget; it costs no FLOPs. Weighing stops
        at a plan that recomputes nothing (none is faster), and the smallest chunk's
        refusal is raised when no size fits, since it names the smallest peak."""
        assert budget is not None, "check_budget refused a missing budget"
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
                    functools.partial(traces, at),
                    budget=budget,
                    schedule=schedule,
                    levels=self.levels,
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
        """The fit's budget is its memory: the fastest plan within it, the others' plans
        reused (raises :class:`BudgetError` when none fits)."""
        return plan_budget(
            config,
            levels,
            budget=memory,
            schedule=schedule,
            baseline=baseline,
            known=made,
            levels=self.levels,
        )

    def plan_step(
        self,
        config: PretrainedConfig,
        trace: StepTrace,
        schedule: SwapSchedule = DEFAULT_SCHEDULE,
        baseline: Replay | None = None,
    ) -> MemoryPlan:
        """Refused: a budget's plan weighs a trace per recompute level, not one."""
        from_name_refusal(self.name)
