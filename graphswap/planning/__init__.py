"""Predict one training step with activation swap, without a GPU, and plan ``auto``.

One steady-state step (forward, backward, AdamW) is traced on the meta device
(:mod:`graphswap.planning._trace`): attention runs the kernel the training device
runs, under tensor parallelism the model is one rank's share, and every operator is
timed on a device profile (:mod:`graphswap.runtime.profile`). The step is then
replayed under the clock contract the simulated device implements
(:mod:`graphswap.planning._replay`): compute, the device-to-host queue fenced
``swap_offload_lag`` modules later, the kept last layer, reloads ``swap_prefetch_depth``
modules ahead, first-needed first, and device memory over the whole step. Each mode
(``none``, ``attention``, ``layer``, ``auto``) gives a
:class:`~graphswap.runtime.timeline.StepTimeline`, the same figures a clocked run of the
real runtime reports.

``auto`` swaps, per layer, the tensors whose copies still hide in both windows
(:mod:`graphswap.planning._auto`); the plan is data (per layer, which saves by their
index in the layer's forward), which the swap pass's executor
(:mod:`graphswap.passes.plan_executor`) carries out at run time. :func:`fit_sequence`
finds the longest sequence each mode fits in a device's memory
(:mod:`graphswap.planning._fit`).

``__all__`` is what a user of the planner calls, what it returns and what it raises;
the steps behind a plan (a trace replayed per choice) are :mod:`graphswap.planning.trace`.
"""

from graphswap._compat import module_getattr
from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.planning._fit import FitResult, ModeFit, fit_sequence
from graphswap.planning._memory import plan_memory
from graphswap.planning._plan import DEFAULT_PROFILE, LayerPlan, MemoryPlan, SwapMode
from graphswap.runtime.profile import ProfileError

__all__ = [
    "DEFAULT_PROFILE",
    "FitResult",
    "LayerPlan",
    "MemoryPlan",
    "ModeFit",
    "PlanSettingError",
    "ProfileError",
    "SwapMode",
    "fit_sequence",
    "plan_memory",
]

__getattr__ = module_getattr(__name__)  # auto_swap, moved to the swap pass, until 0.3
