"""The simulated accelerator: the runtime's copy engine over a device simulated on CPU
tensors, which lags the host, raises ``HazardError`` on every ordering hazard and, given a
device profile, keeps the clock the planner is checked against.

Tests, clocked runs (``device: sim:<profile>``) and the planner's checks use it; a
training run on a real device never does, so ``import graphswap`` does not load it.
"""

from graphswap.runtime.sim._engine import SimulatedAccelerator

__all__ = ["SimulatedAccelerator"]
