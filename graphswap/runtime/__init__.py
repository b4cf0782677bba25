"""The swap runtime: managers, wrappers, copy engines, host pool."""

from graphswap.runtime.engines import (
    AcceleratorCopyEngine,
    CopyEngine,
    HazardError,
    SimulatedAccelerator,
)
from graphswap.runtime.manager import (
    GroupInfo,
    SwapExclusionError,
    SwapIntegrityError,
    SwapManager,
)
from graphswap.runtime.stats import GroupStats, SwapStats
from graphswap.runtime.wrapper import (
    is_swap_wrapped,
    original_type,
    swap_manager_of,
    swap_wrapper,
    unwrap_swap,
)

__all__ = [
    "AcceleratorCopyEngine",
    "CopyEngine",
    "GroupInfo",
    "GroupStats",
    "HazardError",
    "SimulatedAccelerator",
    "SwapExclusionError",
    "SwapIntegrityError",
    "SwapManager",
    "SwapStats",
    "is_swap_wrapped",
    "original_type",
    "swap_manager_of",
    "swap_wrapper",
    "unwrap_swap",
]
