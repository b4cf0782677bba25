"""Predict what activation swap saves on a model, without a GPU.

The model is built on the ``meta`` device and run forward once under saved-tensor
hooks: every tensor autograd saves is recorded with the decoder layer (and whether
the attention) that saved it, and the swap policy is asked about it, exactly as the
runtime would. Storage sizes come from the meta tensors, so nothing is allocated and
a 94-layer model at 32k tokens traces in a few seconds. FLOPs come from the config.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphswap.policy import (
    CheckpointPolicy,
    SwapPolicy,
    is_parameter_like,
    policy_name,
    qwen3_attention_swap_policy,
)

if TYPE_CHECKING:
    from transformers import Qwen3MoeConfig

DEFAULT_BANDWIDTH_GBPS = 50.0
"""Host link per direction: PCIe 5 x16 delivers ~50 GB/s of its 64 GB/s nominal."""

DEFAULT_TFLOPS = 400.0
"""Sustained (not peak) bf16 throughput of one H100/H200-class GPU, ~40% of peak."""

EMBED = "embed"
HEAD = "head"

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

    @property
    def prefetch_hides(self) -> bool:
        return self.kept or self.copy_seconds <= self.overlap_seconds


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
    assumptions: tuple[str, ...] = _ASSUMPTIONS

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
            "policy": self.policy,
            "bandwidth_gbps": self.bandwidth_gbps,
            "tflops": self.tflops,
            "layers": [
                {**dataclasses.asdict(layer), "prefetch_hides": layer.prefetch_hides}
                for layer in self.layers
            ],
            "embed_saved_bytes": self.embed_saved_bytes,
            "head_saved_bytes": self.head_saved_bytes,
            "total_saved_bytes": self.total_saved_bytes,
            "swapped_bytes": self.swapped_bytes,
            "end_of_forward_with_swap_bytes": self.end_of_forward_with_swap_bytes,
            "peak_without_swap_bytes": self.peak_without_swap_bytes,
            "peak_with_swap_bytes": self.peak_with_swap_bytes,
            "all_prefetches_hide": self.all_prefetches_hide,
            "assumptions": list(self.assumptions),
        }

    def format_table(self) -> str:
        header = (
            f"{'layer':<22} {'saved':>11} {'swappable':>11} {'copy ms':>9} "
            f"{'overlap ms':>10}  prefetch"
        )
        lines = [
            f"seq={self.seq} batch={self.batch} dtype={self.dtype} "
            f"attn={self.attn_implementation} policy={self.policy} "
            f"link={self.bandwidth_gbps:g} GB/s compute={self.tflops:g} TFLOP/s",
            header,
            "-" * len(header),
        ]
        for layer in self.layers:
            verdict = (
                "kept on device" if layer.kept else ("hides" if layer.prefetch_hides else "EXPOSED")
            )
            lines.append(
                f"{layer.name:<22} {format_bytes(layer.saved_bytes):>11} "
                f"{format_bytes(layer.swappable_bytes):>11} {layer.copy_seconds * 1e3:>9.3f} "
                f"{layer.overlap_seconds * 1e3:>10.3f}  {verdict}"
            )
        saving = self.peak_without_swap_bytes - self.peak_with_swap_bytes
        lines += [
            "-" * len(header),
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


@dataclass
class _StorageRecord:
    """Every save of one storage; swappable only if each save would be swapped."""

    nbytes: int
    scope: str
    swappable: bool


class _ShapeOnlyGroupedMM(TorchDispatchMode):
    """On meta, ``_grouped_mm`` rejects non-bf16 inputs (a CUDA kernel limit it checks).

    Its output shape is all the trace needs; autograd above this mode still records the
    op and saves its inputs, so saved bytes are exact.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].device.type == "meta":
            mat_a, mat_b = args[0], args[1]
            if mat_a.dim() == 2 and mat_b.dim() == 3:
                return torch.empty(
                    mat_a.shape[0], mat_b.shape[-1], dtype=mat_a.dtype, device=mat_a.device
                )
        return func(*args, **kwargs)


class SavedTensorCollector:
    """Records each tensor autograd saves, attributed to the running decoder layer.

    Scopes are ``embed`` (before the first layer), ``model.layers.<i>`` and ``head``
    (after the last). Storages of parameters and buffers are never counted.
    """

    def __init__(self, model: torch.nn.Module, policy: SwapPolicy = qwen3_attention_swap_policy):
        self.model = model
        self.policy = policy
        self.records: dict[int, _StorageRecord] = {}
        self._held: list[torch.Tensor] = []
        self._scope = EMBED
        self._in_attention = 0
        self._param_storages = {
            t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())
        }

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._param_storages or is_parameter_like(t):
            return t
        swap = self._in_attention > 0 and self.policy(t) is CheckpointPolicy.MUST_SWAP
        record = self.records.get(key)
        if record is None:
            # Holding the tensor keeps its storage address from being reused by a later one.
            self._held.append(t)
            self.records[key] = _StorageRecord(storage.nbytes(), self._scope, swap)
        else:
            record.swappable = record.swappable and swap
        return t

    @contextmanager
    def collect(self) -> Iterator[SavedTensorCollector]:
        handles = []
        layers = decoder_layers(self.model)
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(self._enter_layer(f"model.layers.{i}")))
            handles.append(layer.register_forward_hook(self._leave_layer))
            handles.append(layer.self_attn.register_forward_pre_hook(self._enter_attention))
            handles.append(layer.self_attn.register_forward_hook(self._leave_attention))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _identity):
                yield self
        finally:
            for handle in handles:
                handle.remove()

    def _enter_layer(self, name: str) -> Callable[[torch.nn.Module, Any], None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._scope = name

        return hook

    def _leave_layer(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._scope = HEAD  # until the next layer starts; after the last one it stays

    def _enter_attention(self, module: torch.nn.Module, args: Any) -> None:
        self._in_attention += 1

    def _leave_attention(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._in_attention -= 1

    def bytes_by_scope(self) -> dict[str, tuple[int, int]]:
        """``scope -> (saved bytes, swappable bytes)``."""
        totals: dict[str, tuple[int, int]] = {}
        for record in self.records.values():
            saved, swappable = totals.get(record.scope, (0, 0))
            totals[record.scope] = (
                saved + record.nbytes,
                swappable + (record.nbytes if record.swappable else 0),
            )
        return totals


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__} has no .model.layers: the planner expects a Hugging Face "
            "Qwen3MoeForCausalLM (graphswap.models.build_model)"
        )
    return layers


def plan_memory(
    config: Qwen3MoeConfig,
    *,
    seq: int,
    batch: int = 1,
    bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS,
    tflops: float = DEFAULT_TFLOPS,
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str = "eager",
    policy: SwapPolicy = qwen3_attention_swap_policy,
) -> MemoryPlan:
    """Trace one forward of ``config`` on meta and predict saved memory per layer."""
    for name, value in (("seq", seq), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for name, value in (("bandwidth_gbps", bandwidth_gbps), ("tflops", tflops)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    experts = getattr(config, "_experts_implementation", None)
    if experts == "eager":
        raise ValueError(
            "experts_implementation='eager' routes tokens with data-dependent shapes, which a "
            "meta-device trace cannot follow; plan with experts_implementation='grouped_mm' "
            "(the Hugging Face default), whose saved bytes match it"
        )
    from graphswap.models import build_model

    config = copy.deepcopy(config)
    config._attn_implementation = attn_implementation
    model = build_model(config, device="meta", dtype=dtype).train()
    collector = SavedTensorCollector(model, policy)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    with collector.collect(), _ShapeOnlyGroupedMM():
        # The default cache stays on: without one, the mask code checks position ids for
        # packed sequences, a data-dependent branch meta cannot take. Saved tensors are the same.
        model(input_ids=ids, labels=ids)
    by_scope = collector.bytes_by_scope()

    layers = decoder_layers(model)
    flops = [
        layer_forward_flops(config, seq=seq, batch=batch, moe=_is_moe(layer)) for layer in layers
    ]
    bytes_per_second = bandwidth_gbps * 1e9
    plans = []
    for i in range(len(layers)):
        name = f"model.layers.{i}"
        saved, swappable = by_scope.get(name, (0, 0))
        kept = i == len(layers) - 1
        plans.append(
            LayerPlan(
                name=name,
                index=i,
                saved_bytes=saved,
                swappable_bytes=swappable,
                forward_flops=flops[i],
                copy_seconds=0.0 if kept else swappable / bytes_per_second,
                overlap_seconds=0.0 if kept else 2 * flops[i + 1] / (tflops * 1e12),
                kept=kept,
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
        assumptions=_ASSUMPTIONS + _attention_assumptions(attn_implementation),
    )


def _attention_assumptions(attn_implementation: str) -> tuple[str, ...]:
    if attn_implementation == "eager":
        return ()
    return (
        f"attention {attn_implementation!r} is traced with the kernel the meta device picks "
        "(sdpa: the math path, which saves the attention probabilities); a GPU's fused "
        "kernel saves far less",
    )


def _is_moe(layer: torch.nn.Module) -> bool:
    return hasattr(layer.mlp, "experts")


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
