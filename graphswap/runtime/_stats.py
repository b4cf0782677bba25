"""Counters of what the swap did, per group (wrapped module) and in total."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from graphswap import _compat


@dataclass
class GroupStats:
    """``offloaded``/``reloaded`` count storages copied (aliases are copied once; a
    storage is reloaded once per backward, however many autograd nodes saved it).
    ``kept`` counts tensors the policy chose to swap that stayed on device, for one of
    the reasons counted beside it: the kept last layer (``kept_last_layer``), a full
    host pool (``pool_exhausted``), a failed host allocation (``alloc_failures``), a
    stream capturing a graph (``kept_capturing``), or a storage saved again after an
    in-place change, whose copy may hold either version (``kept_changed``).
    ``plan_mismatches`` counts saves that a planned policy (``activation_swap: auto`` or
    ``budget``) met with another shape or dtype than planned (they stay on device), and
    forwards that recomputed or offloaded other bytes than planned: the rewrite report's
    ``check()`` raises. ``recomputed_tensors`` and
    ``recomputed_bytes`` count the storages that submodules recomputed in backward
    saved in forward and dropped (``activation_swap: budget``): never copied, never
    kept. ``offloaded_not_freed_bytes``
    counts offloaded bytes that another reference kept on device from their release
    until their reload was issued (or their graph died): copied, and freed nothing
    (a returned key/value cache, autocast's weight cache, a tensor the caller keeps)."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    offloaded_not_freed_bytes: int = 0
    reloaded_tensors: int = 0
    reloaded_bytes: int = 0
    kept_tensors: int = 0
    kept_bytes: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    kept_last_layer: int = 0
    pool_exhausted: int = 0
    alloc_failures: int = 0
    kept_capturing: int = 0
    kept_changed: int = 0
    plan_mismatches: int = 0
    recomputed_tensors: int = 0
    recomputed_bytes: int = 0

    def add(self, other: GroupStats) -> None:
        for f in dataclasses.fields(GroupStats):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class SwapStats(GroupStats):
    """A snapshot: totals over all groups, host-pool figures and ``per_group``.

    ``host_reserved_bytes`` counts buffers as the host allocator holds them (size
    classes; powers of two when pinned); ``host_in_use_bytes`` the part lent to saved
    tensors now; ``peak_host_bytes`` the most in use since the last ``reset_stats``;
    ``max_host_bytes`` the cap on reserved bytes (the ``SwapManager``'s)."""

    max_host_bytes: int = 0
    peak_host_bytes: int = 0
    host_reserved_bytes: int = 0
    host_in_use_bytes: int = 0
    per_group: dict[str, GroupStats] = field(default_factory=dict)

    host_budget_bytes = _compat.Renamed("max_host_bytes")  # 0.2.0's name, until 0.3

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
