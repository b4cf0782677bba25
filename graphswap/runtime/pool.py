"""A bounded pool of host buffers, reused across steps so host memory stays flat."""

from __future__ import annotations

import threading
from collections import defaultdict

import torch


class HostPool:
    """Byte buffers keyed by exact size (shapes repeat every step, so exact reuse wins).

    ``acquire`` returns ``None`` instead of raising when the cap would be exceeded:
    the caller keeps the tensor on device, which is always correct.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_host_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self.reserved_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0

    def acquire(self, nbytes: int, *, pin: bool) -> torch.Tensor | None:
        with self._lock:
            free = self._free[(nbytes, pin)]
            if free:
                buf = free.pop()
            else:
                if not self._make_room(nbytes):
                    return None
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
                self.reserved_bytes += nbytes
            self.in_use_bytes += nbytes
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
            return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self.in_use_bytes -= buf.numel()
            self._free[(buf.numel(), buf.is_pinned())].append(buf)

    def _make_room(self, nbytes: int) -> bool:
        """Drop idle buffers of other sizes, largest first, until ``nbytes`` fits."""
        if self.reserved_bytes + nbytes <= self.max_bytes:
            return True
        idle = sorted(
            ((key, buf) for key, bufs in self._free.items() for buf in bufs),
            key=lambda item: item[0][0],
            reverse=True,
        )
        for key, buf in idle:
            self._free[key].remove(buf)
            self.reserved_bytes -= buf.numel()
            if self.reserved_bytes + nbytes <= self.max_bytes:
                return True
        return self.reserved_bytes + nbytes <= self.max_bytes
