"""Predict what activation swap saves on a model, without a GPU, and plan ``auto``.

The saved tensors come from a meta-device trace of one forward
(:mod:`graphswap.saved_tensors`): attention runs the kernel the training device will
run, and under tensor parallelism the model is one rank's share. Per decoder layer the
plan sums the saved and the swappable bytes and sets the copy time at a link bandwidth
against the backward compute it hides behind; FLOPs come from the config.

Three swaps are planned: ``attention`` (what the attention saves), ``layer`` (what the
whole decoder layer saves) and ``auto``: per layer, the largest of the layer's
swappable tensors whose copy still fits in the backward it overlaps, less a margin.
The ``auto`` plan is data (per layer, which saves by their index in the layer's
forward), which :mod:`graphswap.auto_swap` carries out at run time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from graphswap.attention_kernels import EAGER_ASSUMPTION, PlanSettingError
from graphswap.policy import SwapPolicy, policy_name, qwen3_attention_swap_policy
from graphswap.rules import qwen3_layer_swap_policy
from graphswap.saved_tensors import (
    EMBED,
    HEAD,
    SavedTensor,
    SavedTensorTrace,
    trace_saved_tensors,
)

if TYPE_CHECKING:
    from transformers import Qwen3MoeConfig

DEFAULT_BANDWIDTH_GBPS = 50.0
"""Host link per direction: PCIe 5 x16 delivers ~50 GB/s of its 64 GB/s nominal."""

DEFAULT_TFLOPS = 400.0
"""Sustained (not peak) bf16 throughput of one H100/H200-class GPU, ~40% of peak."""

DEFAULT_HIDE_MARGIN = 0.1
"""``auto`` fills at most 90% of the backward a copy overlaps: kernel-time estimates
and link contention are not exact."""

SwapMode = Literal["attention", "layer", "auto"]
SWAP_MODES: tuple[str, ...] = ("attention", "layer", "auto")

_ASSUMPTIONS = (
    "MoE experts: every token is routed to top_k experts; the grouped_mm experts path saves "
    "tokens*top_k rows whatever the routing, so saved bytes do not depend on it; expert FLOPs "
    "assume uniform routing (no dropped tokens)",
    "FLOPs count matmuls only (projections, QK^T and PV without causal skipping, router, experts); "
    "backward = 2x forward",
    "prefetch depth 1: layer i-1 is copied in while layer i runs backward; the last layer "
    "in forward order stays on device",
    "saved bytes are storage bytes, deduplicated by storage; parameters and their views "
    "are not activations and are left out",
)


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer: what it saves, what swap moves, and whether the copy hides."""

    name: str
    index: int
    saved_bytes: int
    swappable_bytes: int
    forward_flops: float
    copy_seconds: float
    overlap_seconds: float
    """Backward compute the prefetch of this layer runs behind (the next layer's)."""
    kept: bool
    """Last layer in forward order: stays on device, nothing is copied."""
    saved_tensors: tuple[SavedTensor, ...] = field(default=(), repr=False, compare=False)
    """Every save of the layer's forward, in saving order (see ``graphswap.saved_tensors``)."""
    swapped_saves: tuple[SavedTensor, ...] = field(default=(), repr=False, compare=False)
    """``layer`` and ``auto``: the saves the swap moves (every save of each chosen
    storage), in saving order; their ``index`` is what the runtime policy is told."""

    @property
    def prefetch_hides(self) -> bool:
        return self.kept or self.copy_seconds <= self.overlap_seconds

    @property
    def kept_bytes(self) -> int:
        """Saved bytes that stay on device through the step."""
        return self.saved_bytes if self.kept else self.saved_bytes - self.swappable_bytes

    def verdict(self, swap: str) -> str:
        """``kept on device``, ``hides``, ``EXPOSED``, or for ``layer`` and ``auto`` a layer
        that swaps nothing: ``none swapped``."""
        if self.kept:
            return "kept on device"
        if swap != "attention" and not self.swapped_saves:
            return "none swapped"
        return "hides" if self.prefetch_hides else "EXPOSED"


_LAYER_SUMMARY_FIELDS = tuple(
    f for f in dataclasses.fields(LayerPlan) if f.name not in ("saved_tensors", "swapped_saves")
)


@dataclass(frozen=True)
class TimelinePoint:
    label: str
    without_swap_bytes: int
    with_swap_bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    """Predicted saved-activation memory of one training step, with and without swap."""

    config: dict[str, Any]
    seq: int
    batch: int
    dtype: str
    attn_implementation: str
    policy: str
    bandwidth_gbps: float
    tflops: float
    layers: tuple[LayerPlan, ...]
    embed_saved_bytes: int
    head_saved_bytes: int
    device: str = "cuda"
    attn_kernel: str | None = None
    """The sdpa kernel traced; ``None`` for eager attention."""
    tp: int = 1
    """Tensor-parallel ranks: the bytes and FLOPs are one rank's."""
    assumptions: tuple[str, ...] = _ASSUMPTIONS
    swap: str = "attention"
    """What is swapped: ``attention``, ``layer`` or ``auto``."""
    hide_margin: float | None = None
    """``auto``: the share of each overlap left free of copies."""
    layer_swappable_bytes: int = 0
    """``auto``: what ``layer`` would swap (every layer's but the kept one)."""
    smallest_swappable: tuple[str, int] | None = None
    """``auto``: the layer and bytes of the smallest tensor ``layer`` would swap, for the
    message when nothing is chosen."""

    @property
    def total_saved_bytes(self) -> int:
        return self.embed_saved_bytes + self.head_saved_bytes + self.layer_saved_bytes

    @property
    def layer_saved_bytes(self) -> int:
        return sum(layer.saved_bytes for layer in self.layers)

    @property
    def swapped_bytes(self) -> int:
        """Bytes that leave the device during forward: every layer's but the kept one."""
        return sum(layer.swappable_bytes for layer in self.layers if not layer.kept)

    @property
    def end_of_forward_with_swap_bytes(self) -> int:
        """Device-resident saved bytes once forward is done and every offload finished."""
        return self.total_saved_bytes - self.swapped_bytes

    @property
    def peak_without_swap_bytes(self) -> int:
        return self.total_saved_bytes

    @property
    def peak_with_swap_bytes(self) -> int:
        """End of forward plus the largest one-layer prefetch in flight.

        An upper bound of :meth:`timeline`: it keeps the head's tensors, which backward
        frees before the first prefetch starts.
        """
        in_flight = max(
            (layer.swappable_bytes for layer in self.layers if not layer.kept), default=0
        )
        return self.end_of_forward_with_swap_bytes + in_flight

    @property
    def all_prefetches_hide(self) -> bool:
        return all(layer.prefetch_hides for layer in self.layers)

    def auto_verdict(self) -> str:
        """One line on what ``auto`` chose; says so when it swaps nothing."""
        margin = self.hide_margin or 0.0
        if self.swapped_bytes == 0:
            if self.smallest_swappable is None:
                return "auto swaps nothing: no layer saves a tensor the swap could move"
            name, smallest = self.smallest_swappable
            overlap = next(layer.overlap_seconds for layer in self.layers if layer.name == name)
            copy = smallest / (self.bandwidth_gbps * 1e9)
            return (
                f"auto swaps nothing: the smallest swappable tensor ({format_bytes(smallest)}, "
                f"{name}) copies in {copy * 1e3:.3f} ms at {self.bandwidth_gbps:g} GB/s, more "
                f"than {1 - margin:.0%} of the backward it overlaps ({overlap * 1e3:.3f} ms at "
                f"{self.tflops:g} TFLOP/s), and so does every other: every tensor stays on "
                "device; a faster link (swap_bandwidth_gbps) or slower compute (swap_tflops) "
                "would let copies hide, activation_swap: layer swaps regardless"
            )
        return (
            f"auto swaps {format_bytes(self.swapped_bytes)} of the "
            f"{format_bytes(self.layer_swappable_bytes)} that layer swap would move; each "
            f"layer's copy fits in {1 - margin:.0%} of the backward it overlaps"
        )

    def timeline(self) -> list[TimelinePoint]:
        """Resident saved bytes after each layer's forward and on entering each backward.

        Forward: a layer's swappable bytes stay until its offload is done, which the next
        layer's forward covers. Backward: entering layer i, its tensors are back and
        layer i-1's are in flight.
        """
        resident = [layer.saved_bytes - layer.swappable_bytes for layer in self.layers]
        points = [TimelinePoint(EMBED, self.embed_saved_bytes, self.embed_saved_bytes)]
        without = with_swap = self.embed_saved_bytes
        for i, layer in enumerate(self.layers):
            without += layer.saved_bytes
            with_swap += resident[i]
            points.append(TimelinePoint(f"F{i}", without, with_swap + layer.swappable_bytes))
        without += self.head_saved_bytes
        with_swap += self.head_saved_bytes
        last = self.layers[-1].swappable_bytes if self.layers else 0
        points.append(TimelinePoint(HEAD, without, with_swap + last))
        # The loss and lm_head backward free the head's tensors before layer backward starts.
        without -= self.head_saved_bytes
        with_swap -= self.head_saved_bytes
        for i in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[i]
            in_flight = self.layers[i - 1].swappable_bytes if i > 0 else 0
            points.append(
                TimelinePoint(f"B{i}", without, with_swap + layer.swappable_bytes + in_flight)
            )
            without -= layer.saved_bytes
            with_swap -= resident[i]
        return points

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "seq": self.seq,
            "batch": self.batch,
            "dtype": self.dtype,
            "attn_implementation": self.attn_implementation,
            "device": self.device,
            "attn_kernel": self.attn_kernel,
            "tp": self.tp,
            "policy": self.policy,
            "bandwidth_gbps": self.bandwidth_gbps,
            "tflops": self.tflops,
            "layers": self.layer_dicts(),
            "embed_saved_bytes": self.embed_saved_bytes,
            "head_saved_bytes": self.head_saved_bytes,
            "total_saved_bytes": self.total_saved_bytes,
            "swapped_bytes": self.swapped_bytes,
            "end_of_forward_with_swap_bytes": self.end_of_forward_with_swap_bytes,
            "peak_without_swap_bytes": self.peak_without_swap_bytes,
            "peak_with_swap_bytes": self.peak_with_swap_bytes,
            "all_prefetches_hide": self.all_prefetches_hide,
            "assumptions": list(self.assumptions),
            "swap": self.swap,
            **(
                {
                    "hide_margin": self.hide_margin,
                    "layer_swappable_bytes": self.layer_swappable_bytes,
                    "verdict": self.auto_verdict(),
                }
                if self.swap == "auto"
                else {}
            ),
        }

    def layer_dicts(self) -> list[dict[str, Any]]:
        return [
            {
                **{f.name: getattr(layer, f.name) for f in _LAYER_SUMMARY_FIELDS},
                "kept_bytes": layer.kept_bytes,
                "prefetch_hides": layer.prefetch_hides,
                **(
                    {"swapped_saves": [_save_dict(save) for save in layer.swapped_saves]}
                    if self.swap != "attention"
                    else {}
                ),
            }
            for layer in self.layers
        ]

    def format_layers(self) -> list[str]:
        """The per-layer table: bytes, copy against overlap time, the verdict; for
        ``auto`` and ``layer`` also which saves (by index in the layer's forward) move."""
        moved = "swapped" if self.swap == "auto" else "swappable"
        saves = "" if self.swap == "attention" else "  swapped saves (#)"
        header = (
            f"{'layer':<22} {'saved':>11} {moved:>11} {'kept':>11} {'copy ms':>9} "
            f"{'overlap ms':>10}  " + (f"{'prefetch':<14}{saves}" if saves else "prefetch")
        )
        margin = "" if self.hide_margin is None else f" margin={self.hide_margin:g}"
        lines = [
            f"seq={self.seq} batch={self.batch} dtype={self.dtype} device={self.device} "
            f"attn={self.attn_implementation}"
            + ("" if self.attn_kernel is None else f" kernel={self.attn_kernel}")
            + f" tp={self.tp} swap={self.swap} policy={self.policy} "
            f"link={self.bandwidth_gbps:g} GB/s compute={self.tflops:g} TFLOP/s{margin}",
            header,
            "-" * len(header),
        ]
        for layer in self.layers:
            verdict = layer.verdict(self.swap)
            indices = ",".join(str(save.index) for save in layer.swapped_saves) or "-"
            lines.append(
                f"{layer.name:<22} {format_bytes(layer.saved_bytes):>11} "
                f"{format_bytes(layer.swappable_bytes):>11} {format_bytes(layer.kept_bytes):>11} "
                f"{layer.copy_seconds * 1e3:>9.3f} {layer.overlap_seconds * 1e3:>10.3f}  "
                + (f"{verdict:<14}  {indices}" if saves else verdict)
            )
        lines.append("-" * len(header))
        if self.swap == "auto":
            lines.append(self.auto_verdict())
        return lines

    def format_table(self) -> str:
        saving = self.peak_without_swap_bytes - self.peak_with_swap_bytes
        lines = [
            *self.format_layers(),
            f"outside the layers: embedding {format_bytes(self.embed_saved_bytes)}, "
            f"head (final norm, lm_head, loss) {format_bytes(self.head_saved_bytes)}",
            f"peak saved activations without swap: {format_bytes(self.peak_without_swap_bytes)}",
            f"peak saved activations with swap:    {format_bytes(self.peak_with_swap_bytes)} "
            f"(end of forward {format_bytes(self.end_of_forward_with_swap_bytes)} "
            f"+ one layer in flight)",
            f"saved by swap: {format_bytes(saving)} "
            f"({100.0 * saving / max(self.peak_without_swap_bytes, 1):.1f}%); "
            f"every prefetch hides: {'yes' if self.all_prefetches_hide else 'NO'}",
            "assumptions:",
            *(f"  - {text}" for text in self.assumptions),
        ]
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def layer_forward_flops(config: Qwen3MoeConfig, *, seq: int, batch: int, moe: bool) -> float:
    """Matmul FLOPs of one decoder layer's forward (2 per multiply-add)."""
    tokens = batch * seq
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_width = config.num_attention_heads * head_dim
    kv_width = config.num_key_value_heads * head_dim
    projections = 2 * tokens * hidden * (2 * q_width + 2 * kv_width)
    scores = 2 * 2 * batch * config.num_attention_heads * seq * seq * head_dim
    if moe:
        router = 2 * tokens * hidden * config.num_experts
        experts = (
            2 * 3 * tokens * config.num_experts_per_tok * hidden * config.moe_intermediate_size
        )
        mlp = router + experts
    else:
        mlp = 2 * 3 * tokens * hidden * config.intermediate_size
    return float(projections + scores + mlp)


def _save_dict(save: SavedTensor) -> dict[str, Any]:
    return {
        "index": save.index,
        "shape": list(save.shape),
        "dtype": str(save.dtype).removeprefix("torch."),
        "nbytes": save.nbytes,
        "storage": save.storage,
    }


@dataclass(frozen=True)
class SwapCandidate:
    """One storage ``layer`` swap would move: its bytes and every save of it."""

    nbytes: int
    saves: tuple[SavedTensor, ...]


def layer_candidates(trace: SavedTensorTrace) -> dict[str, list[SwapCandidate]]:
    """Per layer, the storages whole-layer swap moves, in order of first save.

    A storage qualifies when the policy swaps every save of it and all those saves are
    in this layer's forward: a copy frees nothing while another save keeps the storage
    (the rotary cos/sin that every layer saves).
    """
    scopes: dict[int, set[str]] = {}
    every_save_swaps: dict[int, bool] = {}
    for scope, saves in trace.scopes().items():
        for save in saves:
            scopes.setdefault(save.storage, set()).add(scope)
            every_save_swaps[save.storage] = (
                every_save_swaps.get(save.storage, True) and save.policy_swaps
            )
    candidates: dict[str, list[SwapCandidate]] = {}
    for layer in trace.layers:
        by_storage: dict[int, list[SavedTensor]] = {}
        for save in layer.saves:
            by_storage.setdefault(save.storage, []).append(save)
        candidates[layer.name] = [
            SwapCandidate(saves[0].storage_nbytes, tuple(saves))
            for storage, saves in by_storage.items()
            if every_save_swaps[storage] and scopes[storage] == {layer.name}
        ]
    return candidates


def choose_hidden(candidates: Sequence[SwapCandidate], budget_bytes: float) -> list[SwapCandidate]:
    """Largest first, every candidate that still fits in ``budget_bytes``, in saving order."""
    chosen: list[SwapCandidate] = []
    used = 0
    for candidate in sorted(candidates, key=lambda c: (-c.nbytes, c.saves[0].index)):
        if used + candidate.nbytes <= budget_bytes:
            chosen.append(candidate)
            used += candidate.nbytes
    return sorted(chosen, key=lambda c: c.saves[0].index)


def _swapped_saves(chosen: Sequence[SwapCandidate]) -> tuple[SavedTensor, ...]:
    return tuple(sorted((save for c in chosen for save in c.saves), key=lambda s: s.index))


def plan_memory(
    config: Qwen3MoeConfig,
    *,
    seq: int,
    batch: int = 1,
    bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS,
    tflops: float = DEFAULT_TFLOPS,
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str = "sdpa",
    device: str = "cuda",
    attn_kernel: str | None = None,
    tp: int = 1,
    policy: SwapPolicy | None = None,
    swap: SwapMode = "attention",
    hide_margin: float = DEFAULT_HIDE_MARGIN,
) -> MemoryPlan:
    """Trace one forward of ``config`` on meta and predict one rank's saved memory per layer.

    ``device``, ``attn_kernel`` and ``tp`` are those of :func:`trace_saved_tensors`; a
    bad setting raises :class:`PlanSettingError` before any model is built. ``swap``:
    what moves (``attention``, ``layer`` or ``auto``); ``policy`` defaults to the one
    that swap's rule runs. ``hide_margin``: ``auto`` fills at most ``1 - hide_margin``
    of the backward each copy overlaps.
    """
    for name, value in (("bandwidth_gbps", bandwidth_gbps), ("tflops", tflops)):
        if not value > 0:
            raise PlanSettingError(name, value, "must be > 0")
    if swap not in SWAP_MODES:
        raise PlanSettingError("swap", swap, f"must be one of {', '.join(SWAP_MODES)}")
    if not 0 <= hide_margin < 1:
        raise PlanSettingError(
            "hide_margin", hide_margin, "must be in [0, 1): the share of each overlap left free"
        )
    if policy is None:
        policy = qwen3_attention_swap_policy if swap == "attention" else qwen3_layer_swap_policy
    trace = trace_saved_tensors(
        config,
        seq=seq,
        batch=batch,
        dtype=dtype,
        attn_implementation=attn_implementation,
        device=device,
        attn_kernel=attn_kernel,
        tp=tp,
        policy=policy,
    )
    by_scope = trace.bytes_by_scope()
    flops = [
        layer_forward_flops(trace.rank_config, seq=seq, batch=batch, moe=layer.moe)
        for layer in trace.layers
    ]
    bytes_per_second = bandwidth_gbps * 1e9
    candidates = layer_candidates(trace)
    plans = []
    for i, layer in enumerate(trace.layers):
        saved, swappable = by_scope.get(layer.name, (0, 0))
        kept = i == len(trace.layers) - 1
        overlap = 0.0 if kept else 2 * flops[i + 1] / (tflops * 1e12)
        moved: tuple[SavedTensor, ...] = ()
        if swap != "attention":
            chosen = candidates[layer.name]
            if swap == "auto":
                budget = (1 - hide_margin) * overlap * bytes_per_second
                chosen = [] if kept else choose_hidden(chosen, budget)
            swappable = sum(c.nbytes for c in chosen)
            moved = () if kept else _swapped_saves(chosen)
        plans.append(
            LayerPlan(
                name=layer.name,
                index=i,
                saved_bytes=saved,
                swappable_bytes=swappable,
                forward_flops=flops[i],
                copy_seconds=0.0 if kept else swappable / bytes_per_second,
                overlap_seconds=overlap,
                kept=kept,
                saved_tensors=layer.saves,
                swapped_saves=moved,
            )
        )
    return MemoryPlan(
        config=_config_summary(config),
        seq=seq,
        batch=batch,
        dtype=str(dtype).removeprefix("torch."),
        attn_implementation=attn_implementation,
        policy=policy_name(policy),
        bandwidth_gbps=float(bandwidth_gbps),
        tflops=float(tflops),
        layers=tuple(plans),
        embed_saved_bytes=by_scope.get(EMBED, (0, 0))[0],
        head_saved_bytes=by_scope.get(HEAD, (0, 0))[0],
        device=device,
        attn_kernel=None if trace.kernel is None else trace.kernel.name,
        tp=tp,
        assumptions=_ASSUMPTIONS + _trace_assumptions(trace, config) + _swap_assumptions(swap),
        swap=swap,
        **(_auto_fields(candidates, trace, hide_margin) if swap == "auto" else {}),
    )


def _auto_fields(
    candidates: Mapping[str, Sequence[SwapCandidate]], trace: SavedTensorTrace, hide_margin: float
) -> dict[str, Any]:
    """What ``layer`` would have swapped, for the report of what ``auto`` chose."""
    swapped = [
        (c.nbytes, layer.name) for layer in trace.layers[:-1] for c in candidates[layer.name]
    ]
    smallest = min(swapped, default=None)
    return {
        "hide_margin": float(hide_margin),
        "layer_swappable_bytes": sum(nbytes for nbytes, _ in swapped),
        "smallest_swappable": None if smallest is None else (smallest[1], smallest[0]),
    }


def _swap_assumptions(swap: str) -> tuple[str, ...]:
    if swap == "attention":
        return ()
    whole = (
        "layer and auto swap a storage only when every save of it is in one layer and the "
        "policy swaps each (the rotary cos/sin, saved by every layer, stay)"
    )
    if swap == "layer":
        return (whole,)
    return (
        whole,
        "auto: per layer, largest first, the tensors whose copy still fits in (1 - margin) x "
        "the backward of the next layer, which the prefetch of this one overlaps; the "
        "offload in forward is not modelled",
    )


def _trace_assumptions(trace: SavedTensorTrace, config: Qwen3MoeConfig) -> tuple[str, ...]:
    attention = EAGER_ASSUMPTION if trace.kernel is None else trace.kernel.describe()
    if trace.tp == 1:
        return (attention,)
    rank = trace.rank_config
    return (
        attention,
        f"tensor parallel over {trace.tp} ranks: bytes and FLOPs are one rank's; its "
        f"attention holds {rank.num_attention_heads} of {config.num_attention_heads} query "
        f"heads and {rank.num_key_value_heads} of {config.num_key_value_heads} key/value heads "
        "(q/k/v column-parallel, o row-parallel, as passes/tensor_parallel.py shards them); "
        "the embedding, norms, router, experts, lm_head and loss are replicated and saved "
        "in full on every rank",
    )


def _config_summary(config: Qwen3MoeConfig) -> dict[str, Any]:
    keys = (
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "vocab_size",
    )
    return {key: getattr(config, key, None) for key in keys}
