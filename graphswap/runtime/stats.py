"""Counters of what the swap did, per group (wrapped module) and in total."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GroupStats:
    """``offloaded``/``reloaded`` count storages copied (aliases are copied once);
    ``kept`` counts tensors the policy chose to swap that stayed on device (the kept
    last layer, or an exhausted host pool, also counted in ``pool_exhausted``)."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    reloaded_tensors: int = 0
    reloaded_bytes: int = 0
    kept_tensors: int = 0
    kept_bytes: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    pool_exhausted: int = 0

    def add(self, other: GroupStats) -> None:
        for f in dataclasses.fields(GroupStats):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class SwapStats(GroupStats):
    """A snapshot: totals over all groups, host-pool figures and ``per_group``."""

    peak_host_bytes: int = 0
    host_reserved_bytes: int = 0
    host_in_use_bytes: int = 0
    per_group: dict[str, GroupStats] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
