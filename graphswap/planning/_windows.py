"""When each wrapped module's copies must run, on the traced step without stalls.

A module's offloads are issued as its forward saves them and fenced where the
runtime's ``swap_offload_lag`` puts the fence: at the start of the forward that many
modules later (at the end of its own forward for a lag of 0; past the last module, at
the first backward boundary). Its reloads are issued when backward reaches the module
``swap_prefetch_depth`` links later and are needed from its own first unpack. These times
are the compute stream's alone (no stall), so they are the same for every swap
choice of one scope: what ``auto`` budgets, and the windows ``plan-memory`` prints.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.planning._settings import SwapSchedule
from graphswap.planning._trace import Event, StepTrace, TracedSave
from graphswap.planning.saved_tensors import ATTENTION_SCOPE, LAYER_SCOPE


def group_of(save: TracedSave, scope: str) -> int | None:
    """The wrapped module (by decoder layer) whose forward made ``save`` under ``scope``
    (``attention`` or ``layer``); ``None`` when no wrapped module did."""
    if scope == ATTENTION_SCOPE:
        return save.layer if save.save.in_attention else None
    if scope == LAYER_SCOPE:
        return save.layer
    raise PlanSettingError(
        "scope", scope, f"the swap scopes are {ATTENTION_SCOPE} and {LAYER_SCOPE}"
    )


@dataclass(frozen=True)
class GroupWindow:
    """One wrapped module's copy windows, in seconds of compute from the step's start."""

    enter_seconds: float
    """Its forward begins."""
    exit_seconds: float
    """Its forward ends."""
    fence_seconds: float
    """Compute waits for its offloads here."""
    trigger_seconds: float | None
    """Its reloads are issued here; ``None``: nothing prefetches it (the last module)."""
    backward_seconds: float
    """Its backward begins (its first unpack): its first reload is needed from here."""

    @property
    def forward_window(self) -> float:
        """From the start of its forward to the fence of its offloads."""
        return self.fence_seconds - self.enter_seconds

    @property
    def backward_window(self) -> float:
        """From the prefetch of its saves to the start of its backward."""
        if self.trigger_seconds is None:
            return 0.0
        return self.backward_seconds - self.trigger_seconds


@dataclass(frozen=True)
class StepTimes:
    """Compute-only times of one scope's events in a traced step."""

    scope: str
    """The modules the windows are of: ``attention`` or ``layer``."""
    pack_seconds: tuple[float, ...]
    """Per traced save, when it was packed."""
    unpack_seconds: tuple[float, ...]
    """Per traced save, when backward first read it (``inf``: never)."""
    groups: tuple[GroupWindow, ...]
    """Per decoder layer, its wrapped module's windows."""


@dataclass(frozen=True)
class _Pass:
    """One scope's compute-only times in a trace, whatever the schedule."""

    pack: tuple[float, ...]
    unpack: tuple[float, ...]
    enter: tuple[float, ...]
    leave: tuple[float, ...]
    begins: tuple[float, ...]


_PASSES: dict[tuple[int, str], _Pass] = {}
"""Per live trace (by id) and scope, its pass: every mode and lag a plan tries reads the
same one, and a 48-layer trace has some 40,000 events."""


def _pass(trace: StepTrace, scope: str) -> _Pass:
    key = (id(trace), scope)
    found = _PASSES.get(key)
    if found is not None:
        return found
    layers = trace.num_layers
    groups = [group_of(save, scope) for save in trace.saves]
    pack = [0.0] * len(trace.saves)
    unpack = [math.inf] * len(trace.saves)
    enter = [0.0] * layers
    leave = [0.0] * layers
    begins = [math.inf] * layers
    t = 0.0
    # The members as locals: looking one up costs several times the comparison.
    compute, pack_event, unpack_event, enter_event, exit_event = (
        Event.COMPUTE,
        Event.PACK,
        Event.UNPACK,
        Event.ENTER,
        Event.EXIT,
    )
    for event, payload in trace.events:
        if event is compute:
            t += payload
        elif event is pack_event:
            pack[payload] = t
        elif event is unpack_event:
            if unpack[payload] == math.inf:
                unpack[payload] = t
            group = groups[payload]
            if group is not None and begins[group] == math.inf:
                begins[group] = t
        elif event is enter_event or event is exit_event:
            where, layer = payload
            if where == scope:
                (enter if event is enter_event else leave)[layer] = t
    found = _PASSES[key] = _Pass(
        tuple(pack), tuple(unpack), tuple(enter), tuple(leave), tuple(begins)
    )
    weakref.finalize(trace, _PASSES.pop, key, None)
    return found


def step_times(trace: StepTrace, scope: str, schedule: SwapSchedule) -> StepTimes:
    """The windows of ``scope``'s modules in ``trace`` at ``schedule``'s
    ``swap_offload_lag`` (:meth:`~SwapSchedule.lag`) and ``swap_prefetch_depth``, as
    ``SwapManager`` takes them."""
    offload_lag, prefetch_depth = schedule.lag(), schedule.swap_prefetch_depth
    layers = trace.num_layers
    times = _pass(trace, scope)
    enter, leave, begins = times.enter, times.leave, times.begins
    first_backward = min(begins, default=0.0)
    windows = []
    for g in range(layers):
        if offload_lag == 0:
            fence = leave[g]
        elif g + offload_lag < layers:
            fence = enter[g + offload_lag]
        else:
            fence = first_backward
        trigger = None if g == layers - 1 else begins[min(g + prefetch_depth, layers - 1)]
        windows.append(GroupWindow(enter[g], leave[g], fence, trigger, begins[g]))
    return StepTimes(scope, times.pack, times.unpack, tuple(windows))
