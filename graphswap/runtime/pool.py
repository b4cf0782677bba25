"""A bounded pool of host buffers per device, reused across steps.

Buffers come in size classes, so a sequence length that varies from step to step
reuses them instead of allocating a buffer per exact size. Bytes are counted as the
host allocator really holds them: pinned memory is rounded up to a power of two by
the caching host allocator, so pinned classes are powers of two. Each buffer carries
the copies that last used it; the next offload into it waits for them on the copy
stream, so a buffer is never rewritten while a reload of another step still reads it.
Idle buffers are trimmed, least recently used first, so reserved bytes stay within
twice the most ever in use.
"""

from __future__ import annotations

import collections
import enum
import threading

import torch

from graphswap.runtime.engines import Copy, CopyEngine

_MIN_CLASS = 4096


def size_class(nbytes: int, *, pinned: bool) -> int:
    """Bytes a buffer for ``nbytes`` holds: a power of two when pinned, else rounded up
    to an eighth of its octave (at most 12.5% slack)."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    if pinned:
        return 1 << (nbytes - 1).bit_length()
    step = 1 << ((nbytes - 1).bit_length() - 4)
    return -(-nbytes // step) * step


class Refusal(enum.Enum):
    """Why the pool gave no buffer: the tensor stays on device."""

    POOL_FULL = "pool_exhausted"
    ALLOC_FAILED = "alloc_failures"


class HostBuffer:
    """One pooled buffer, the copies that used it last, and its view last asked for:
    the same tensor shapes come back every step, so the view is made once."""

    __slots__ = ("_dtype", "_shape", "_view", "key", "last_use", "nbytes", "tensor")

    def __init__(self, tensor: torch.Tensor, key: tuple[torch.device, bool, int]) -> None:
        self.tensor = tensor
        self.key = key
        self.nbytes = key[2]
        self.last_use: tuple[Copy, ...] = ()
        self._view = tensor
        self._dtype = tensor.dtype
        self._shape = tensor.shape

    def view(self, dtype: torch.dtype, shape: torch.Size, nbytes: int) -> torch.Tensor:
        """The buffer's first ``nbytes`` bytes as a contiguous tensor of ``dtype`` and ``shape``."""
        if dtype is not self._dtype or shape != self._shape:
            self._view = self.tensor[:nbytes].view(dtype).view(shape)
            self._dtype, self._shape = dtype, shape
        return self._view


def _empty_host_cache() -> None:
    """Return dropped pinned blocks to the OS; the caching host allocator keeps them."""
    empty = getattr(torch._C, "_accelerator_emptyHostCache", None) or getattr(
        torch._C, "_host_emptyCache", None
    )
    if empty is not None:
        empty()


class HostPool:
    """Host buffers keyed by (device, pinned, size class), capped at ``max_bytes``.

    ``acquire`` returns a ``Refusal`` instead of raising when the cap would be
    exceeded or the allocation fails: the caller keeps the tensor on device, which
    is always correct.
    """

    def __init__(self, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_host_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._idle: dict[tuple[torch.device, bool, int], list[HostBuffer]] = (
            collections.defaultdict(list)
        )
        self._lru: dict[HostBuffer, None] = {}
        self._lock = threading.Lock()
        self.reserved_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self._high_water = 0

    def acquire(
        self, device: torch.device, nbytes: int, engine: CopyEngine
    ) -> HostBuffer | Refusal:
        """A buffer for copies of ``nbytes`` between ``device`` and the host; a new one is
        allocated by ``engine`` (pinned if it pins), whose device may keep it apart from
        the memory it accounts for."""
        pin = engine.pin
        key = (device, pin, size_class(nbytes, pinned=pin))
        size = key[2]
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                buf = idle.pop()
                del self._lru[buf]
            else:
                if not self._make_room(size):
                    return Refusal.POOL_FULL
                try:
                    tensor = engine.host_buffer(device, size)
                except RuntimeError:
                    return Refusal.ALLOC_FAILED
                buf = HostBuffer(tensor, key)
                self.reserved_bytes += size
            in_use = self.in_use_bytes = self.in_use_bytes + size
            if in_use > self.peak_in_use_bytes:  # the high water is never below the peak
                self.peak_in_use_bytes = in_use
                self._high_water = max(self._high_water, in_use)
            if self.reserved_bytes > 2 * self._high_water:
                self._trim(2 * self._high_water)
            return buf

    def release(self, buf: HostBuffer, last_use: tuple[Copy, ...]) -> None:
        """Back to the pool; the next offload into ``buf`` waits for ``last_use``."""
        buf.last_use = last_use
        with self._lock:
            self.in_use_bytes -= buf.nbytes
            self._idle[buf.key].append(buf)
            self._lru[buf] = None

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.max_bytes - self.in_use_bytes:
            return False
        self._trim(self.max_bytes - nbytes)
        return True

    def _trim(self, limit: int) -> None:
        """Drop idle buffers, least recently used first, until reserved <= ``limit``."""
        dropped_pinned = False
        while self.reserved_bytes > limit and self._lru:
            buf = next(iter(self._lru))
            del self._lru[buf]
            self._idle[buf.key].remove(buf)
            self.reserved_bytes -= buf.nbytes
            dropped_pinned |= buf.key[1]
        if dropped_pinned:
            _empty_host_cache()
