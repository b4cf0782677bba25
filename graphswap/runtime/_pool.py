"""A bounded pool of host buffers per device, reused across steps.

Buffers come in size classes, so a sequence length that varies from step to step
reuses them instead of allocating a buffer per exact size. Bytes are counted as the
host allocator really holds them: pinned memory is rounded up to a power of two by
the caching host allocator, so pinned classes are powers of two. Each buffer carries
the copies that last used it; the next offload into it waits for them on the copy
stream, so a buffer is never rewritten while a reload of another step still reads it.

Nothing here frees or empties anything inside a saved-tensor hook once the pool is
warm: the first step of a shape allocates its buffers, later steps reuse them. Idle
buffers are trimmed at a step boundary (``trim``, called by the manager when nothing
swapped is alive), least recently used first, so reserved bytes come back within twice
the most ever in use; a dropped pinned buffer returns to torch's caching host
allocator, whose cache graphswap never empties (a DataLoader's ``pin_memory`` and
FSDP2's CPU offload keep their blocks there too).

The default cap is a share of the node: pinned memory cannot be paged out, so a cap
over what the container or node holds ends in an out-of-memory kill, not in the
counted ``pool_exhausted``.
"""

from __future__ import annotations

import collections
import enum
import os
import warnings
from pathlib import Path

import torch

from graphswap.errors import SwapSetupError
from graphswap.runtime._engines import Copy, CopyEngine
from graphswap.runtime.profile import HOST_SHARE

_MIN_CLASS = 4096

REUSE_SLACK = 4
"""A buffer up to this many times larger than asked for is lent rather than a new one
allocated (its slack counts as in use while lent)."""

_UNLIMITED = 1 << 60
"""cgroup v1 writes "no limit" as a number near 2**63."""


def _cgroup_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The tightest memory limit of this process's cgroup and its parents (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``); None when none is set or readable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        here = Path(path)
        for folder in (here, *here.parents):
            try:
                text = (base / folder.relative_to("/") / name).read_text().strip()
            except (OSError, ValueError):
                continue
            if text.isdigit() and int(text) < _UNLIMITED:
                limits.append(int(text))
    return min(limits) if limits else None


def node_memory() -> int:
    """Bytes of memory this process may use: physical memory, or its container's
    (cgroup) limit when that is lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_limit()
    return physical if limit is None else min(physical, limit)


def local_ranks() -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` as torchrun sets it, else 1."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise SwapSetupError(
            f"LOCAL_WORLD_SIZE={value!r} is not a positive int (torchrun sets it to the ranks"
            " on this node); fix the environment or pass max_host_bytes explicitly"
        )
    return int(value)


def default_max_host_bytes() -> int:
    """The default ``max_host_bytes``: ``HOST_SHARE`` of :func:`node_memory`, divided by
    :func:`local_ranks`, so that the ranks of a node together stay within it."""
    return int(node_memory() * HOST_SHARE) // local_ranks()


def check_host_bytes(max_bytes: int) -> int:
    """Accept ``max_bytes``; warn when the node could not hold it."""
    available = node_memory()
    if max_bytes > available:
        warnings.warn(
            f"max_host_bytes={max_bytes} ({max_bytes / 2**30:.1f} GiB) is more than this"
            f" process's container or node holds ({available / 2**30:.1f} GiB); pinned"
            " memory cannot be paged out, so running out ends in an out-of-memory kill"
            " rather than in tensors kept on device; leave max_host_bytes unset for this"
            " rank's share of the node",
            RuntimeWarning,
            stacklevel=3,
        )
    return max_bytes


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


TYPED_VIEWS = frozenset(
    {
        *(torch.float64, torch.float32, torch.float16, torch.bfloat16),
        *(torch.complex64, torch.complex128, torch.bool, torch.uint8),
        *(torch.int8, torch.int16, torch.int32, torch.int64),
    }
)
"""Dtypes a host buffer can be viewed as and copied into; tensors of others (sub-byte,
quantized, float8) are copied as bytes."""


class HostBuffer:
    """One pooled buffer, the copies that used it last, and its view last asked for:
    the same tensor shapes come back every step, so the view is made once."""

    __slots__ = (
        "_dtype",
        "_shape",
        "_view",
        "engine",
        "idle_since",
        "key",
        "last_use",
        "nbytes",
        "tensor",
        "view_stride",
    )

    def __init__(
        self, tensor: torch.Tensor, key: tuple[torch.device, bool, int], engine: CopyEngine
    ) -> None:
        self.tensor = tensor  # the host memory, ``nbytes`` of uint8
        self.key = key  # (device, pinned, size class): its idle list in the pool
        self.nbytes = key[2]  # its size class
        self.engine = engine  # the engine that allocated it, told when it is dropped
        self.last_use: tuple[Copy, ...] = ()  # copies the next offload into it waits for
        self.idle_since = 0  # the pool's release count when it came back: trim's order
        self._view = tensor  # the view ``view`` made last
        self._dtype = tensor.dtype  # its dtype
        self._shape = tensor.shape  # its shape
        self.view_stride: tuple[int, ...] = tensor.stride()
        """Its stride: the pack compares the saved tensor's with it, without a call."""

    def view(self, dtype: torch.dtype, shape: torch.Size, nbytes: int) -> torch.Tensor:
        """The buffer's first ``nbytes`` bytes as a contiguous tensor of ``dtype`` and ``shape``."""
        if dtype is not self._dtype or shape != self._shape:
            view = self._view = self.tensor[:nbytes].view(dtype).view(shape)
            self._dtype, self._shape = dtype, shape
            self.view_stride = view.stride()
        return self._view


class HostPool:
    """Host buffers keyed by (device, pinned, size class), capped at ``max_bytes``.

    ``acquire`` returns a ``Refusal`` instead of raising when the cap would be
    exceeded or the allocation fails: the caller keeps the tensor on device, which
    is always correct. Not thread-safe: the manager calls it under its own lock, which
    it holds anyway where it acquires and releases (one lock per hook, not two).
    """

    def __init__(self, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise SwapSetupError(f"max_host_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes  # the cap on reserved bytes
        self._idle: dict[tuple[torch.device, bool, int], list[HostBuffer]] = (
            collections.defaultdict(list)
        )  # buffers not lent, by (device, pinned, size class)
        self._releases = 0  # buffers given back so far: their ``idle_since``
        self.reserved_bytes = 0  # bytes of every buffer the pool holds, lent or idle
        self.in_use_bytes = 0  # bytes of the buffers lent now
        self.peak_in_use_bytes = 0  # the most in use since the manager's last reset_stats
        self._high_water = 0  # the most ever in use: trim keeps twice as much

    def acquire(
        self, device: torch.device, nbytes: int, engine: CopyEngine
    ) -> HostBuffer | Refusal:
        """A buffer for copies of ``nbytes`` between ``device`` and the host: an idle one
        of its size class, else of the smallest idle class up to ``REUSE_SLACK`` times
        larger (after a step at the longest sequence, shorter ones allocate nothing),
        else a new one allocated by ``engine`` (pinned if it pins), whose device may keep
        it apart from the memory it accounts for."""
        pin = engine.pin
        key = (device, pin, size_class(nbytes, pinned=pin))
        size = key[2]
        idle = self._idle.get(key) or self._larger_idle(key)
        if idle:
            buf = idle.pop()
        else:
            if not self._make_room(size):
                return Refusal.POOL_FULL
            try:
                tensor = engine.host_buffer(device, size)
            except RuntimeError:
                return Refusal.ALLOC_FAILED
            buf = HostBuffer(tensor, key, engine)
            self.reserved_bytes += size
        in_use = self.in_use_bytes = self.in_use_bytes + buf.nbytes
        if in_use > self.peak_in_use_bytes:  # the high water is never below the peak
            self.peak_in_use_bytes = in_use
            self._high_water = max(self._high_water, in_use)
        return buf

    def release(self, buf: HostBuffer, last_use: tuple[Copy, ...]) -> None:
        """Back to the pool; the next offload into ``buf`` waits for ``last_use``."""
        buf.last_use = last_use
        buf.idle_since = self._releases = self._releases + 1
        self.in_use_bytes -= buf.nbytes
        self._idle[buf.key].append(buf)

    def _larger_idle(self, key: tuple[torch.device, bool, int]) -> list[HostBuffer] | None:
        """The idle buffers of the smallest larger class within ``REUSE_SLACK``."""
        device, pin, size = key
        best = None
        for (d, p, other), idle in self._idle.items():
            fits = idle and d == device and p == pin and size < other <= size * REUSE_SLACK
            if fits and (best is None or other < best[0]):
                best = (other, idle)
        return None if best is None else best[1]

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.max_bytes - self.in_use_bytes:
            return False
        self._trim(self.max_bytes - nbytes)
        return True

    def trim(self) -> None:
        """At a step boundary: drop idle buffers until reserved bytes are within twice
        the most ever in use (a step of another shape left buffers no step uses)."""
        if self.reserved_bytes > 2 * self._high_water:
            self._trim(2 * self._high_water)

    def _trim(self, limit: int) -> None:
        """Drop idle buffers, least recently used first, until reserved <= ``limit``.

        The order is found here, off the hot path, rather than kept at every release."""
        if self.reserved_bytes <= limit:
            return
        idle = sorted(
            (buf for bufs in self._idle.values() for buf in bufs), key=lambda b: b.idle_since
        )
        for buf in idle:
            if self.reserved_bytes <= limit:
                return
            self._idle[buf.key].remove(buf)
            self.reserved_bytes -= buf.nbytes
            buf.engine.free_host_buffer(buf.key[0], buf.tensor)
