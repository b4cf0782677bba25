"""The plan of one training step: per decoder layer what is saved, swapped and copied,
the copies against both of their windows, and the step's predicted timeline."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

from graphswap._compat import Renamed
from graphswap.hf.attention_kernels import EAGER_ASSUMPTION, PlanSettingError
from graphswap.planning._auto import SwapCandidate
from graphswap.planning._replay import Replay
from graphswap.planning._settings import SwapSchedule
from graphswap.planning._trace import StepTrace
from graphswap.planning._windows import StepTimes, step_times
from graphswap.planning.saved_tensors import EMBED, HEAD, LAYER_SCOPE, SavedTensor
from graphswap.runtime.profile import DeviceProfile, device_profile
from graphswap.runtime.timeline import StepTimeline

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DEFAULT_PROFILE = "h200"
"""The device a plan is made for unless told: an H200 on PCIe Gen5."""

SwapMode = Literal["none", "attention", "layer", "auto", "budget"]
"""What activation swap moves, one name everywhere (``activation_swap`` in the trainer's
config, the planner, the swap pass and ``plan-memory --activation-swap``): nothing, each
layer's attention, whole layers, per layer the saves whose copies hide (``auto``), or
per layer what to keep, swap and recompute under ``activation_memory_budget``
(``budget``)."""
SWAP_MODES: tuple[SwapMode, ...] = get_args(SwapMode)

_ASSUMPTIONS = (
    "one steady-state training step: forward, loss.backward(), AdamW step (foreach on cuda, "
    "per tensor on cpu) with its state made beforehand, zero_grad(set_to_none=True)",
    "time: every operator the step runs costs max(FLOPs / TFLOP/s, bytes / HBM GB/s) on the "
    "compute stream (graphswap.runtime.profile); no launch latency, no contention between "
    "copies and compute",
    "MoE experts: every token is routed to top_k experts; the grouped_mm experts path saves "
    "tokens*top_k rows whatever the routing, so saved bytes do not depend on it; expert FLOPs "
    "assume uniform routing (no dropped tokens)",
    "device memory: storage bytes of every tensor the step makes (activations, logits and "
    "loss, gradients, reloads in flight, optimizer temporaries) on top of parameters, "
    "buffers and AdamW state (2 x the parameters that train, in their dtype); no allocator "
    "rounding or fragmentation",
    "saved bytes are storage bytes, deduplicated by storage; parameters and their views "
    "are not activations and are left out",
)

_NO_OPTIMIZER_ASSUMPTIONS = (
    "one steady-state step without optimizer: zero_grad(set_to_none=True), forward, "
    "loss.backward(), as a benchmark that never updates runs it",
    *_ASSUMPTIONS[1:3],
    "device memory: storage bytes of every tensor the step makes (activations, logits and "
    "loss, gradients, reloads in flight) on top of parameters and buffers (no optimizer "
    "state); no allocator rounding or fragmentation",
    *_ASSUMPTIONS[4:],
)


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer: what it saves, what swap moves, and whether its copies hide."""

    name: str
    """The decoder layer's module path (``model.layers.<i>``)."""
    index: int
    """Its position in forward order."""
    saved_bytes: int
    """Saved-activation bytes the layer owns (a storage counts in the scope that saves it
    first)."""
    swappable_bytes: int
    """What the swap takes off the device for the step: storages every save of which is
    swapped (the kept last layer: what it would swap)."""
    offloaded_bytes: int
    """What the runtime copies to host in the layer's forward (a storage that another
    save keeps is copied, yet stays)."""
    forward_seconds: float
    """Compute of the whole layer's forward."""
    copy_seconds: float
    """The offloads' time on the device-to-host link."""
    reload_seconds: float
    """The reloads' time on the host-to-device link."""
    forward_window: float
    """From the start of the wrapped module's forward to the fence of its offloads
    (``swap_offload_lag`` modules later), compute only."""
    backward_window: float
    """From its prefetch (``swap_prefetch_depth`` modules later in backward) to the start of
    its backward, compute only."""
    forward_stall: float
    """Compute waiting for its offloads in the replayed step."""
    backward_stall: float
    """Compute waiting for its reloads in the replayed step."""
    kept: bool
    """Last layer in forward order: stays on device, nothing is copied."""
    refused_bytes: int = 0
    """Chosen for swap but kept on device: the host pool's budget had no room."""
    saved_tensors: tuple[SavedTensor, ...] = field(default=(), repr=False, compare=False)
    """Every save of the layer's forward, in saving order (see
    ``graphswap.planning.saved_tensors``)."""
    swapped_saves: tuple[SavedTensor, ...] = field(default=(), repr=False, compare=False)
    """``layer``, ``auto`` and ``budget``: the saves the swap moves (every save of each
    chosen storage), in saving order; their ``index`` is what the runtime policy is told."""
    recomputed: tuple[str, ...] = ()
    """``budget``: the submodules recomputed in backward (paths in the layer)."""
    recomputed_bytes: int = 0
    """``budget``: the storage bytes those submodules saved and recompute dropped."""
    recompute_seconds: float = 0.0
    """``budget``: what the layer's backward takes longer for the recompute."""

    @property
    def hides(self) -> bool:
        """Both windows hide the layer's copies: the replay shows no stall for them."""
        return self.kept or (self.forward_stall == 0 and self.backward_stall == 0)

    @property
    def kept_bytes(self) -> int:
        """Saved bytes that stay on device through the step."""
        return self.saved_bytes if self.kept else self.saved_bytes - self.swappable_bytes

    def verdict(self) -> str:
        """``kept on device``, ``none swapped``, ``hides`` or ``STALLS``."""
        if self.kept:
            return "kept on device"
        if not self.offloaded_bytes:
            return "none swapped"
        return "hides" if self.hides else "STALLS"


_LAYER_SUMMARY_FIELDS = tuple(
    f for f in dataclasses.fields(LayerPlan) if f.name not in ("saved_tensors", "swapped_saves")
)
_PLANNED_MODES = ("layer", "auto", "budget")
"""The modes whose plan names each save it swaps."""


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's predicted training step with a swap mode, beside the step without it."""

    config: dict[str, Any]
    """The model's shape (layers, widths, heads, experts, vocabulary)."""
    seq_len: int
    """Tokens per sequence."""
    batch_size: int
    """Sequences per batch."""
    dtype: str
    """The training dtype."""
    autocast_dtype: str | None
    """The dtype the step computes in under autocast; ``None``: no autocast."""
    attn_implementation: str
    """Hugging Face attention: ``sdpa`` or ``eager``."""
    device: str
    """The device training runs on (``cuda`` or ``cpu``): it chose kernel and optimizer."""
    attn_kernel: str | None
    """The sdpa kernel traced; ``None`` for eager attention."""
    tp_size: int
    """Tensor-parallel ranks: the bytes and FLOPs are one rank's."""
    loss_head: str
    """The head the step's loss runs: ``full`` (every token's logits at once),
    ``chunked`` (graphswap's chunked head) or ``trl`` (TRL's fused head)."""
    loss_head_chunk_size: int | None
    """``chunked``: tokens per chunk (in ``budget``, the size chosen); else ``None``."""
    activation_swap: SwapMode
    """What is swapped: ``none``, ``attention``, ``layer`` or ``auto``."""
    policy: str
    """The swap policy's name (``none`` for no swap)."""
    profile: DeviceProfile
    """The device the step was timed on."""
    swap_offload_lag: int
    """The ``SwapManager``'s: offloads are fenced that many modules later."""
    swap_prefetch_depth: int
    """The ``SwapManager``'s: reloads are issued that many modules ahead."""
    state_shards: int
    """Ranks the parameters, gradients and optimizer state are sharded over."""
    max_host_bytes: int
    """The host pool's budget per rank the plan was made against (``max_host_bytes``;
    by default the profile's node's share)."""
    host_peak_bytes: int
    """The most pinned host memory the swap holds at once on this rank, in the pool's
    size classes."""
    attention_timing: tuple[str, ...]
    """How the fused attention kernels were timed: ``causal``, ``full``, both, or none
    (eager attention)."""
    layers: tuple[LayerPlan, ...]
    """Per decoder layer, in forward order."""
    embed_saved_bytes: int
    """Saved by the embedding, before the first layer."""
    head_saved_bytes: int
    """Saved after the last layer: final norm, lm_head and loss."""
    timeline: StepTimeline
    """The step with this swap, replayed under the clock contract."""
    baseline: StepTimeline
    """The same step without swap."""
    assumptions: tuple[str, ...]
    """What the prediction takes for granted, in words."""
    swap_hide_margin: float | None = None
    """``auto``: the share of each copy's window left free."""
    layer_swappable_bytes: int = 0
    """``auto``: what ``layer`` would swap (every layer's but the kept one)."""
    smallest_swappable: tuple[str, int] | None = None
    """``auto``: the layer and bytes of the smallest tensor ``layer`` would swap, for the
    message when nothing is chosen."""
    auto_dropped: int = 0
    """``auto``: tensors the verifying replays took back from the simulated choice."""
    swap_offload_lag_chosen: bool = False
    """``auto``: the plan chose ``swap_offload_lag`` (of
    :data:`~graphswap.planning._strategy.AUTO_LAGS`), the user did not."""
    activation_memory_budget: int | None = None
    """``budget``: the device peak the plan keeps within, in bytes."""
    recompute: tuple[str, ...] = ()
    """``budget``: the kinds of submodule every layer recomputes (``norms``, ``mlp``)."""
    budget_swap: str | None = None
    """``budget``: the swap it pairs them with (``none``, ``auto`` or ``layer``)."""
    budget_options: tuple[Any, ...] = ()
    """``budget``: every option weighed (:class:`~graphswap.planning._budget.BudgetOption`)."""
    lora_rank: int | None = None
    """The rank of the LoRA adapters that train (the base weights frozen); ``None``:
    every parameter trains."""

    # 0.1.0's names of the settings, now the trainer config's keys (one spelling per
    # setting), readable until 0.3.
    seq = Renamed("seq_len")
    batch = Renamed("batch_size")
    tp = Renamed("tp_size")
    offload_lag = Renamed("swap_offload_lag")
    prefetch_depth = Renamed("swap_prefetch_depth")
    hide_margin = Renamed("swap_hide_margin")
    offload_lag_chosen = Renamed("swap_offload_lag_chosen")

    @property
    def recomputed_bytes(self) -> int:
        """``budget``: the bytes recompute dropped, every layer's."""
        return sum(layer.recomputed_bytes for layer in self.layers)

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
    def refused_bytes(self) -> int:
        """Chosen for swap but kept on device because the host budget was full."""
        return sum(layer.refused_bytes for layer in self.layers)

    @property
    def end_of_forward_with_swap_bytes(self) -> int:
        """Device-resident saved bytes once forward is done and every offload finished."""
        return self.total_saved_bytes - self.swapped_bytes

    @property
    def step_ratio(self) -> float:
        """Step time with swap over step time without."""
        return self.timeline.step_seconds / self.baseline.step_seconds

    @property
    def all_hide(self) -> bool:
        """Every layer's copies hide in both windows."""
        return all(layer.hides for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "dtype": self.dtype,
            "autocast_dtype": self.autocast_dtype,
            "attn_implementation": self.attn_implementation,
            "device": self.device,
            "attn_kernel": self.attn_kernel,
            "tp_size": self.tp_size,
            "loss_head": self.loss_head,
            "loss_head_chunk_size": self.loss_head_chunk_size,
            "lora_rank": self.lora_rank,
            "activation_swap": self.activation_swap,
            "policy": self.policy,
            "profile": dataclasses.asdict(self.profile),
            "swap_offload_lag": self.swap_offload_lag,
            "swap_prefetch_depth": self.swap_prefetch_depth,
            "state_shards": self.state_shards,
            "max_host_bytes": self.max_host_bytes,
            "host_peak_bytes": self.host_peak_bytes,
            "refused_bytes": self.refused_bytes,
            "attention_timing": list(self.attention_timing),
            "layers": self.layer_dicts(),
            "embed_saved_bytes": self.embed_saved_bytes,
            "head_saved_bytes": self.head_saved_bytes,
            "total_saved_bytes": self.total_saved_bytes,
            "swapped_bytes": self.swapped_bytes,
            "end_of_forward_with_swap_bytes": self.end_of_forward_with_swap_bytes,
            "timeline": self.timeline.to_dict(),
            "baseline": self.baseline.to_dict(),
            "step_ratio": self.step_ratio,
            "all_hide": self.all_hide,
            "assumptions": list(self.assumptions),
            **(
                {
                    "swap_hide_margin": self.swap_hide_margin,
                    "layer_swappable_bytes": self.layer_swappable_bytes,
                    "smallest_swappable": None
                    if self.smallest_swappable is None
                    else {
                        "layer": self.smallest_swappable[0],
                        "nbytes": self.smallest_swappable[1],
                    },
                    "auto_dropped": self.auto_dropped,
                    "swap_offload_lag_chosen": self.swap_offload_lag_chosen,
                }
                if self.activation_swap == "auto"
                else {}
            ),
            **(
                {
                    "activation_memory_budget": self.activation_memory_budget,
                    "recompute": list(self.recompute),
                    "budget_swap": self.budget_swap,
                    "recomputed_bytes": self.recomputed_bytes,
                    "budget_options": [o.to_dict() for o in self.budget_options],
                }
                if self.activation_swap == "budget"
                else {}
            ),
        }

    def layer_dicts(self) -> list[dict[str, Any]]:
        return [
            {
                **{f.name: getattr(layer, f.name) for f in _LAYER_SUMMARY_FIELDS},
                "kept_bytes": layer.kept_bytes,
                "hides": layer.hides,
                "verdict": layer.verdict(),
                **(
                    {"swapped_saves": [_save_dict(save) for save in layer.swapped_saves]}
                    if self.activation_swap in _PLANNED_MODES
                    else {}
                ),
            }
            for layer in self.layers
        ]


def _save_dict(save: SavedTensor) -> dict[str, Any]:
    return {
        "index": save.index,
        "shape": list(save.shape),
        "dtype": str(save.dtype).removeprefix("torch."),
        "nbytes": save.nbytes,
        "storage": save.storage,
    }


def _swapped_saves(chosen: Sequence[SwapCandidate]) -> tuple[SavedTensor, ...]:
    return tuple(sorted((save for c in chosen for save in c.saves), key=lambda s: s.index))


def resolve_profile(
    profile: str | DeviceProfile,
    *,
    swap_bandwidth_gbps: float | None = None,
    swap_tflops: float | None = None,
) -> DeviceProfile:
    """``profile`` (a preset name or spec, see :func:`device_profile`) with the link
    (both directions) or the compute replaced. A bad override raises
    :class:`PlanSettingError`, a bad profile :class:`ProfileError`."""
    overrides: dict[str, float] = {}
    for name, key, value in (
        ("swap_bandwidth_gbps", "link_gbps", swap_bandwidth_gbps),
        ("swap_tflops", "tflops", swap_tflops),
    ):
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise PlanSettingError(name, value, "must be a finite number > 0")
        overrides[key] = float(value)
    resolved = device_profile(profile)
    return resolved.with_figures(**overrides) if overrides else resolved


class StepStrategy(Protocol):
    """What :func:`assemble_plan` reads of the strategy that decided a step
    (:class:`~graphswap.planning._strategy.MemoryStrategy`)."""

    @property
    def name(self) -> SwapMode: ...
    @property
    def scope(self) -> str | None: ...
    @property
    def names_saves(self) -> bool: ...

    def assumptions(self, schedule: SwapSchedule, lag_chosen: bool) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class StepDecision:
    """What a strategy decided for one traced step: the input of :func:`assemble_plan`."""

    chosen: Sequence[Sequence[SwapCandidate]]
    """Per decoder layer, the storages swapped (read where the strategy names saves)."""
    replayed: Replay
    """The step with the decision's swap, replayed under the clock contract."""
    schedule: SwapSchedule
    """The schedule the decision was made at, its ``swap_offload_lag`` set (the one the
    strategy chose where the user did not)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The strategy's own :class:`MemoryPlan` fields (``auto``'s margin, its drops)."""


def assemble_plan(
    config: PretrainedConfig,
    trace: StepTrace,
    strategy: StepStrategy,
    decision: StepDecision,
    schedule: SwapSchedule,
    baseline: Replay,
) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``strategy``'s ``decision`` on a traced step: per layer
    its bytes, copies, windows and stalls, and the step's timelines and assumptions."""
    saved, scope, made_at = trace.saved, strategy.scope, decision.schedule
    max_host_bytes = schedule.max_host_bytes_on(trace.profile)
    replayed = decision.replayed
    windows = None
    if scope is not None:
        windows = step_times(trace, scope, made_at).groups
    whole = step_times(trace, LAYER_SCOPE, made_at)
    by_scope = saved.bytes_by_scope()
    profile = trace.profile
    layers = []
    for i, layer in enumerate(saved.layers):
        kept = i == len(saved.layers) - 1
        saved_bytes, swappable = by_scope.get(layer.name, (0, 0))
        moved: tuple[SavedTensor, ...] = ()
        if strategy.names_saves:
            swappable = sum(c.nbytes for c in decision.chosen[i])
            moved = () if kept else _swapped_saves(decision.chosen[i])
        elif scope is None:
            swappable = 0
        group = replayed.groups[i]
        window = None if windows is None else windows[i]
        layers.append(
            LayerPlan(
                name=layer.name,
                index=i,
                saved_bytes=saved_bytes,
                swappable_bytes=swappable,
                offloaded_bytes=group.offloaded_bytes,
                forward_seconds=_forward_seconds(whole, i),
                copy_seconds=group.offloaded_bytes / (profile.d2h_gbps * 1e9),
                reload_seconds=group.reloaded_bytes / (profile.h2d_gbps * 1e9),
                forward_window=0.0 if window is None else window.forward_window,
                backward_window=0.0 if window is None else window.backward_window,
                forward_stall=group.forward_stall,
                backward_stall=group.backward_stall,
                kept=kept,
                refused_bytes=group.refused_bytes,
                saved_tensors=layer.saves,
                swapped_saves=moved,
            )
        )
    return MemoryPlan(
        config=_config_summary(config),
        seq_len=trace.seq_len,
        batch_size=trace.batch_size,
        dtype=str(trace.dtype).removeprefix("torch."),
        autocast_dtype=None
        if trace.autocast_dtype is None
        else str(trace.autocast_dtype).removeprefix("torch."),
        attn_implementation=trace.attn_implementation,
        device=trace.device,
        attn_kernel=None if saved.kernel is None else saved.kernel.name,
        tp_size=saved.tp,
        loss_head=trace.loss_head,
        loss_head_chunk_size=trace.loss_head_chunk_size,
        lora_rank=trace.lora_rank,
        activation_swap=strategy.name,
        policy="none" if scope is None else trace.policy,
        profile=profile,
        swap_offload_lag=made_at.lag(),
        swap_prefetch_depth=made_at.swap_prefetch_depth,
        state_shards=schedule.state_shards,
        max_host_bytes=max_host_bytes,
        host_peak_bytes=replayed.host_peak_bytes,
        attention_timing=trace.attention_timing,
        layers=tuple(layers),
        embed_saved_bytes=by_scope.get(EMBED, (0, 0))[0],
        head_saved_bytes=by_scope.get(HEAD, (0, 0))[0],
        timeline=replayed.timeline,
        baseline=baseline.timeline,
        assumptions=(_ASSUMPTIONS if trace.optimizer else _NO_OPTIMIZER_ASSUMPTIONS)
        + _trace_assumptions(trace, config)
        + strategy.assumptions(made_at, schedule.swap_offload_lag is None)
        + _host_assumptions(scope, trace, max_host_bytes, schedule.max_host_bytes is None)
        + _shard_assumptions(schedule.state_shards),
        **decision.fields,
    )


def _forward_seconds(times: StepTimes, layer: int) -> float:
    window = times.groups[layer]
    return window.exit_seconds - window.enter_seconds


def _host_assumptions(
    scope: str | None, trace: StepTrace, max_host_bytes: int, from_node: bool
) -> tuple[str, ...]:
    if scope is None:  # nothing is swapped: no host pool
        return ()
    profile = trace.profile
    budget = (
        f"the {profile.name} node's default: half of its {profile.host_memory_bytes / 2**40:g} "
        f"TiB of host memory over its {profile.ranks_per_node} ranks"
        if from_node
        else "max_host_bytes as given"
    )
    classes = (
        "powers of two (pinned, as the caching host allocator rounds them)"
        if trace.device == "cuda"
        else "eighths of an octave (unpinned)"
    )
    return (
        f"host: each offload holds a buffer of its size class, {classes}, from a pool capped "
        f"at {max_host_bytes / 2**30:.1f} GiB per rank ({budget}); an offload the cap refuses "
        "stays on device, as the runtime keeps it",
    )


def _shard_assumptions(state_shards: int) -> tuple[str, ...]:
    if state_shards == 1:
        return ()
    return (
        f"state sharded FSDP-style over {state_shards} ranks (an approximation): one rank holds "
        f"1/{state_shards} of the parameters, gradients and AdamW state and runs 1/"
        f"{state_shards} of the optimizer step; the all-gathered parameters of the layer being "
        "computed, the gradients before their reduce-scatter and the communication are not "
        "modelled",
    )


def _attention_timing(trace: StepTrace) -> str:
    timing = trace.attention_timing
    if not timing:
        return (
            "attention time: every score is computed (eager attention and sdpa's math path "
            "apply the mask after the scores), as the matmuls' FLOPs"
        )
    parts = {
        "causal": "causal calls without a mask (is_causal) compute only the scores the mask "
        "leaves, (s + 1) / 2s of them",
        "full": "calls with a mask compute every score",
    }
    efficiency = trace.profile.attention_efficiency
    return (
        f"attention time ({', '.join(timing)}): "
        + "; ".join(parts[kind] for kind in timing)
        + f"; the fused kernels run at {efficiency:g} x the profile's TFLOP/s "
        "(attention_efficiency, which the GPU check measures)"
    )


def _trace_assumptions(trace: StepTrace, config: PretrainedConfig) -> tuple[str, ...]:
    saved = trace.saved
    attention = EAGER_ASSUMPTION if saved.kernel is None else saved.kernel.describe()
    timing = _attention_timing(trace)
    if saved.tp == 1:
        return (attention, timing)
    rank = saved.rank_config
    return (
        attention,
        timing,
        f"tensor parallel over {saved.tp} ranks: bytes and FLOPs are one rank's; its "
        f"attention holds {rank.num_attention_heads} of {config.num_attention_heads} query "
        f"heads and {rank.num_key_value_heads} of {config.num_key_value_heads} key/value heads "
        "(q/k/v column-parallel, o row-parallel, as passes/tensor_parallel.py shards them); "
        "the embedding, norms, router, experts, lm_head and loss are replicated and saved "
        "in full on every rank",
    )


def _config_summary(config: PretrainedConfig) -> dict[str, Any]:
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
