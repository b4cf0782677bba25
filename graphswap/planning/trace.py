"""A step traced once, and what is made of it: a plan per mode, a replay per choice of
what is swapped. For callers that compare several choices or timings on one trace (the
benchmark, the long-sequence and budget tools); :func:`~graphswap.planning.plan_memory`
traces again at every call.

:func:`trace_step` records one step of a :class:`StepShape` on the meta device;
:func:`plan_step` makes a mode's :class:`~graphswap.planning.MemoryPlan` from that trace
under a :class:`SwapSchedule`; :func:`replay` plays the runtime's schedule over it for one
:class:`SwapChoice`, which :func:`swap_choice` builds from a per-layer pick of
:func:`layer_candidates`.
"""

from graphswap.planning._auto import layer_candidates, swap_choice
from graphswap.planning._replay import SwapChoice, replay
from graphswap.planning._settings import StepShape, SwapSchedule
from graphswap.planning._strategy import plan_step
from graphswap.planning._trace import StepTrace, trace_step

__all__ = [
    "StepShape",
    "StepTrace",
    "SwapChoice",
    "SwapSchedule",
    "layer_candidates",
    "plan_step",
    "replay",
    "swap_choice",
    "trace_step",
]
