"""The swap runtime: the manager, the wrappers (swap and recompute), the copy engines,
the host pool, and the chunked projection and cross-entropy of the loss head. The
simulated accelerator is :mod:`graphswap.runtime.sim`, which this package does not
import."""

from graphswap._compat import module_getattr
from graphswap.runtime._engines import (
    AcceleratorCopyEngine,
    CopyEngine,
    HazardError,
    NoOpAccelerator,
)
from graphswap.runtime._group import GroupInfo
from graphswap.runtime._loss_head import chunked_linear_cross_entropy
from graphswap.runtime._manager import SwapManager
from graphswap.runtime._pool import host_budget
from graphswap.runtime._recompute import (
    is_recompute_wrapped,
    recompute_wrapper,
    unwrap_recompute,
)
from graphswap.runtime._stats import GroupStats, SwapStats
from graphswap.runtime._wrapper import (
    is_swap_wrapped,
    swap_manager_of,
    swap_wrapper,
    unwrap_swap,
)
from graphswap.runtime.timeline import step_labels

__all__ = [
    "AcceleratorCopyEngine",
    "CopyEngine",
    "GroupInfo",
    "GroupStats",
    "HazardError",
    "NoOpAccelerator",
    "SwapManager",
    "SwapStats",
    "chunked_linear_cross_entropy",
    "host_budget",
    "is_recompute_wrapped",
    "is_swap_wrapped",
    "recompute_wrapper",
    "step_labels",
    "swap_manager_of",
    "swap_wrapper",
    "unwrap_recompute",
    "unwrap_swap",
]

__getattr__ = module_getattr(__name__)  # 0.1.0 names that moved, until 0.3
