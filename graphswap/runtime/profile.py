"""Device profiles and the roofline cost of one operator: the clock's two inputs.

A :class:`DeviceProfile` says how fast a device computes (sustained TFLOP/s), reads
and writes its own memory (HBM GB/s) and copies to and from the host (GB/s per
direction, both directions at once). The simulated device and the planner both
cost an executed operator as ``max(FLOPs / TFLOP/s, bytes / HBM GB/s)`` with
:func:`op_seconds`, so a planned step and a clocked run of the real runtime differ
only in the schedule, which is what the comparison between them checks.

Not modelled: kernel launch latency, the host's own time, and link or HBM
contention between copies and compute.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from graphswap import _compat
from graphswap.errors import GraphswapError

HOST_SHARE = 0.5
"""The share of a node's host memory the swap's host pools take by default, divided
among the ranks on the node: the other half is left to the processes themselves, their
data loaders and the page cache."""


class ProfileError(GraphswapError, ValueError):
    """A device profile name or figure that cannot describe a device."""


_CUSTOM = " (custom)"
"""What the name of a profile with figures of its own ends with, once."""


@dataclass(frozen=True)
class DeviceProfile:
    """How fast one accelerator computes, reads its memory and talks to the host."""

    name: str
    """A preset's name, or what the user called a custom profile."""
    d2h_gbps: float
    """Device-to-host copy bandwidth, GB/s (10^9 bytes), pinned host memory, sustained
    while a host-to-device copy runs the other way."""
    h2d_gbps: float
    """Host-to-device copy bandwidth, GB/s, likewise."""
    tflops: float
    """Sustained (not peak) dense matmul throughput in the training dtype, TFLOP/s."""
    hbm_gbps: float
    """Sustained device-memory bandwidth, GB/s: the time of an operator that moves more
    bytes than it has FLOPs to hide them."""
    memory_bytes: int
    """Device memory: what ``plan-memory --fit`` fits a step into when not told."""
    attention_efficiency: float = 1.0
    """The share of ``tflops`` a fused attention kernel (flash, efficient, cuDNN) reaches on
    the scores it computes; the GPU check measures it (``tools/device_check.sh``)."""
    host_memory_bytes: int = 2 << 40
    """Host memory of a typical node that holds this device: what the host pool's default
    budget is a share of (:func:`graphswap.runtime.default_max_host_bytes`)."""
    ranks_per_node: int = 8
    """Devices (ranks) per such node: they share its host memory."""
    source: str = ""
    """Where the figures come from."""

    def __post_init__(self) -> None:
        for key in FIGURES:
            value = getattr(self, key)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ProfileError(
                    f"device profile {self.name!r}: {key} must be a finite number > 0, got "
                    f"{value!r}"
                )

    @property
    def default_max_host_bytes(self) -> int:
        """The host pool's default budget per rank on such a node (``max_host_bytes``
        unset): :data:`HOST_SHARE` of its host memory, divided among its ranks, as
        :func:`graphswap.runtime.default_max_host_bytes` takes it on the node it runs on."""
        return int(self.host_memory_bytes * HOST_SHARE) // self.ranks_per_node

    host_budget_bytes = _compat.Renamed("default_max_host_bytes")  # 0.2.0's name, until 0.3

    def with_figures(self, **figures: Any) -> DeviceProfile:
        """This profile with some figures replaced (``link_gbps`` sets both directions)."""
        link = figures.pop("link_gbps", None)
        if link is not None:
            figures = {"d2h_gbps": link, "h2d_gbps": link, **figures}
        unknown = sorted(set(figures) - set(FIGURES))
        if unknown:
            raise ProfileError(
                f"unknown device profile figure {unknown[0]!r}; figures: link_gbps, "
                f"{', '.join(FIGURES)}"
            )
        custom = self.name if self.name.endswith(_CUSTOM) else f"{self.name}{_CUSTOM}"
        return dataclasses.replace(self, name=custom, **figures)


FIGURES = (
    "d2h_gbps",
    "h2d_gbps",
    "tflops",
    "hbm_gbps",
    "memory_bytes",
    "attention_efficiency",
    "host_memory_bytes",
    "ranks_per_node",
)
"""The figures a profile spec may set, besides ``link_gbps`` (both directions)."""

_INTEGER_FIGURES = ("memory_bytes", "host_memory_bytes", "ranks_per_node")

_PCIE5 = (
    "host link: PCIe Gen5 x16, 64 GB/s per direction nominal, about 50 GB/s sustained "
    "device-host copies of pinned memory in each direction; "
)
_COMPUTE = (
    "compute: 400 TFLOP/s, about 40% of the 989 TFLOP/s dense bf16 peak of the Hopper SXM "
    "datasheet (the model FLOP utilisation large training runs report); "
    "attention kernels at the same rate until the GPU check measures them; "
)
_NODE = (
    "node: 8 GPUs and 2 TiB of host memory, the HGX H100/H200 8-GPU servers' common "
    "configuration (DGX H100: 2 TB)"
)

PRESETS: Mapping[str, DeviceProfile] = {
    "h100": DeviceProfile(
        name="h100",
        d2h_gbps=50.0,
        h2d_gbps=50.0,
        tflops=400.0,
        hbm_gbps=2850.0,
        memory_bytes=80 * 10**9,
        source=_PCIE5
        + _COMPUTE
        + "HBM: 85% of the 3.35 TB/s HBM3 of the H100 SXM datasheet; memory: its 80 GB; "
        + _NODE,
    ),
    "h200": DeviceProfile(
        name="h200",
        d2h_gbps=50.0,
        h2d_gbps=50.0,
        tflops=400.0,
        hbm_gbps=4080.0,
        memory_bytes=141 * 10**9,
        source=_PCIE5
        + _COMPUTE
        + "HBM: 85% of the 4.8 TB/s HBM3e of the H200 SXM datasheet; memory: its 141 GB; "
        + _NODE,
    ),
}
"""Hopper GPUs on a PCIe Gen5 host; the first GPU run calibrates them
(``tools/device_check.sh`` prints measured beside predicted)."""


def device_profile(spec: str | DeviceProfile) -> DeviceProfile:
    """A profile from a preset name, optionally with figures replaced:
    ``h200``, ``h200,link_gbps=25``, ``h100,tflops=300,hbm_gbps=2000``."""
    if isinstance(spec, DeviceProfile):
        return spec
    if not isinstance(spec, str):
        raise ProfileError(f"a device profile is a preset name or a DeviceProfile, got {spec!r}")
    name, *pairs = (part.strip() for part in spec.split(","))
    if name not in PRESETS:
        raise ProfileError(
            f"unknown device profile {name!r}; presets: {', '.join(sorted(PRESETS))} "
            "(figures may follow: h200,link_gbps=25,tflops=300)"
        )
    figures: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ProfileError(f"device profile {spec!r}: {pair!r} is not key=value")
        if key.strip() in figures:
            raise ProfileError(f"device profile {spec!r}: {key.strip()} given twice; keep one")
        try:
            figures[key.strip()] = float(value)
        except ValueError:
            raise ProfileError(
                f"device profile {spec!r}: {key.strip()} must be a number, got {value!r}"
            ) from None
    for key in _INTEGER_FIGURES:
        figure = figures.get(key)
        if figure is not None and math.isfinite(figure):  # inf, nan: refused with the figures
            figures[key] = int(figure)
    return PRESETS[name].with_figures(**figures) if figures else PRESETS[name]


_ops = torch.ops.aten

_NO_KERNEL = frozenset(
    {
        _ops.empty,
        _ops.empty_like,
        _ops.empty_strided,
        _ops.new_empty,
        _ops.new_empty_strided,
        _ops.set_,
        _ops.detach,
        _ops.alias,
        _ops.lift_fresh,
        _ops._local_scalar_dense,
    }
)
"""Operators that launch no kernel: allocation, metadata and host reads of a scalar."""


_ATTENTION_FORWARD = frozenset(
    {
        _ops._scaled_dot_product_flash_attention,
        _ops._scaled_dot_product_efficient_attention,
        _ops._scaled_dot_product_cudnn_attention,
        _ops._scaled_dot_product_flash_attention_for_cpu,
    }
)
"""The fused attention kernels, counted here rather than by torch's flop registry, which
before torch 2.13 refuses grouped-query heads (fewer key/value heads than query heads)."""

_ATTENTION_BACKWARD = frozenset(
    {
        _ops._scaled_dot_product_flash_attention_backward,
        _ops._scaled_dot_product_efficient_attention_backward,
        _ops._scaled_dot_product_cudnn_attention_backward,
        _ops._scaled_dot_product_flash_attention_for_cpu_backward,
    }
)


def _argument(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], name: str) -> Any:
    """The value ``func`` was called with for its schema argument ``name`` (None if absent)."""
    if name in kwargs:
        return kwargs[name]
    for position, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return args[position] if position < len(args) else argument.default_value
    return None


def causal_share(queries: int, keys: int) -> float:
    """The share of the ``queries`` x ``keys`` scores a causal mask leaves (query ``i``
    sees keys ``0..i``, as sdpa's ``is_causal`` aligns them): about half for
    self-attention, the work a fused kernel that skips masked tiles does."""
    diagonal = min(queries, keys)
    seen = diagonal * (diagonal + 1) // 2 + max(0, queries - keys) * keys
    return seen / (queries * keys)


def _attention_flops(
    func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, backward: bool
) -> tuple[float, bool]:
    """Scores and weighted sum per query head (two batched matmuls); backward recomputes
    the scores and makes four more (2.5x), as torch's flop counter counts them. A causal
    call without a mask (``is_causal``) computes only the scores the mask leaves; with a
    mask every score is computed, as the kernels do. Also says whether it was causal."""
    q = _argument(func, args, kwargs, "query")
    k = _argument(func, args, kwargs, "key")
    batch_heads = math.prod(q.shape[:-2])
    queries, keys = q.shape[-2], k.shape[-2]
    flops = 4.0 * batch_heads * queries * keys * q.shape[-1]
    mask = _argument(func, args, kwargs, "attn_mask")
    if mask is None:
        mask = _argument(func, args, kwargs, "attn_bias")
    causal = mask is None and bool(_argument(func, args, kwargs, "is_causal"))
    if causal:
        flops *= causal_share(queries, keys)
    return (2.5 * flops if backward else flops), causal


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor) -> float:
    """``_grouped_mm``: 2D x 3D (tokens x K by experts x K x N), or 2D x 2D (a weight
    gradient, K x tokens by tokens x N): every row multiplies one group's matrix."""
    if b.dim() == 3:
        return 2.0 * math.prod(a.shape[:-1]) * a.shape[-1] * b.shape[-1]
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[-1]


def op_flops(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> float:
    """Multiply-add FLOPs (2 per multiply-add) of one operator; 0 for elementwise ones."""
    packet = func._overloadpacket
    if packet in _ATTENTION_FORWARD or packet in _ATTENTION_BACKWARD:
        return _attention_flops(func, args, kwargs, backward=packet in _ATTENTION_BACKWARD)[0]
    if packet is _ops._grouped_mm:
        return _grouped_mm_flops(args[0], args[1])
    counted = flop_registry.get(packet)
    if counted is None:
        return 0.0
    if "out" in kwargs:
        # An ``out=`` overload (``addmm(..., out_dtype=torch.float32, out=acc)``, how a
        # bf16 product is summed into fp32) names its output as a keyword, and may take
        # an output dtype among its arguments: the counter knows neither.
        names = [a.name for a in func._schema.arguments]
        args = tuple(a for name, a in zip(names, args, strict=False) if name != "out_dtype")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("out", "out_dtype")}
    return float(counted(*args, **kwargs, out_val=out))


def op_bytes(args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> int:
    """Bytes an operator reads and writes: its tensor inputs and outputs, each whole."""
    return sum(
        t.numel() * t.element_size()
        for t in tree_leaves((args, kwargs, out))
        if isinstance(t, torch.Tensor)
    )


@dataclass(frozen=True)
class OpCost:
    """What one executed operator's kernel does: the inputs of its roofline time."""

    __slots__ = ("attention", "flops", "nbytes")

    flops: float
    """Multiply-add FLOPs (2 per multiply-add)."""
    nbytes: int
    """Bytes it reads and writes."""
    attention: str | None
    """A fused attention kernel, which computes at the profile's ``attention_efficiency``:
    ``causal`` (it computed the scores a causal mask leaves) or ``full`` (every score);
    None for any other operator."""

    def seconds(self, profile: DeviceProfile) -> float:
        """Roofline time on ``profile``'s device."""
        rate = profile.tflops * 1e12
        if self.attention is not None:
            rate *= profile.attention_efficiency
        return max(self.flops / rate, self.nbytes / (profile.hbm_gbps * 1e9))


def op_cost(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> OpCost | None:
    """The cost of one executed operator; None for one that launches no kernel."""
    packet = func._overloadpacket
    if func.is_view or packet in _NO_KERNEL:
        return None
    nbytes = op_bytes(args, kwargs, out)
    if packet in _ATTENTION_FORWARD or packet in _ATTENTION_BACKWARD:
        flops, causal = _attention_flops(func, args, kwargs, backward=packet in _ATTENTION_BACKWARD)
        return OpCost(flops, nbytes, "causal" if causal else "full")
    return OpCost(op_flops(func, args, kwargs, out), nbytes, None)


def op_seconds(
    profile: DeviceProfile, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any
) -> float:
    """Roofline time of one executed operator on ``profile``'s device."""
    cost = op_cost(func, args, kwargs, out)
    return 0.0 if cost is None else cost.seconds(profile)


SIM_PREFIX = "sim:"
"""How a device setting names the clocked simulated accelerator: ``sim:<profile>``."""


def simulated_profile(device: str) -> DeviceProfile | None:
    """The profile of a ``sim:<profile>`` device setting; None for a real device."""
    if not device.startswith(SIM_PREFIX):
        return None
    return device_profile(device.removeprefix(SIM_PREFIX))
