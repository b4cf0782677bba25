"""The longest sequence each swap mode fits in a device's memory, and its step ratio.

A sequence length fits when the replayed step's device peak (parameters, gradients
and optimizer state included) is at most the memory. Lengths are searched in steps
of ``seq_step`` up to the model's ``max_position_embeddings``; every length is traced
once and replayed for every mode. The search brackets each mode's answer from a
fitting and a failing length and probes between them where a straight line through
the two peaks crosses the memory (halfway when that stops narrowing), so a peak that
grows about linearly with the sequence is found in few traces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.planning._plan import (
    DEFAULT_HIDE_MARGIN,
    DEFAULT_PROFILE,
    SWAP_MODES,
    MemoryPlan,
    SwapMode,
    check_settings,
    plan_step,
    resolve_profile,
)
from graphswap.planning._replay import SwapChoice, replay
from graphswap.planning._trace import StepTrace, storage_bytes, trace_step
from graphswap.planning.saved_tensors import MetaModel, build_meta_model
from graphswap.runtime.profile import DeviceProfile

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DEFAULT_SEQ_STEP = 512
"""``fit_sequence`` answers in multiples of this many tokens."""


@dataclass(frozen=True)
class ModeFit:
    """One mode's longest sequence."""

    activation_swap: SwapMode
    """The mode: ``none``, ``attention``, ``layer`` or ``auto``."""
    seq: int | None
    """The longest multiple of the step that fits; ``None``: not even one step."""
    plan: MemoryPlan | None
    """The plan at that length."""
    capped: bool
    """It fits even at the longest length searched (the model's ``max_position_embeddings``)."""


@dataclass(frozen=True)
class FitResult:
    """What fits in ``memory_bytes``, per mode, on one rank."""

    memory_bytes: int
    """The device memory searched in."""
    profile: DeviceProfile
    """The device the steps were timed on."""
    batch: int
    """Sequences per batch."""
    seq_step: int
    """Answers are multiples of this many tokens."""
    max_seq: int
    """The longest length searched: the model's ``max_position_embeddings``."""
    state_shards: int
    """Ranks the parameters, gradients and optimizer state are sharded over."""
    parameter_bytes: int
    """One rank's share of the parameters."""
    gradient_bytes: int
    """One rank's share of the gradients (the parameters' size and dtype)."""
    optimizer_state_bytes: int
    """One rank's share of AdamW's two moments (twice the parameters, in their dtype)."""
    buffer_bytes: int
    """The model's buffers (replicated)."""
    modes: tuple[ModeFit, ...]
    """Empty when the state alone does not fit."""
    traced: tuple[int, ...]
    """The sequence lengths traced, in order."""

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients, optimizer state and buffers: held at the peak whatever
        the sequence."""
        return (
            self.parameter_bytes
            + self.gradient_bytes
            + self.optimizer_state_bytes
            + self.buffer_bytes
        )

    @property
    def state_fits(self) -> bool:
        return self.state_bytes < self.memory_bytes

    @property
    def shards_needed(self) -> int:
        """The fewest ``state_shards`` whose state leaves some of the memory free."""
        sharded = (self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes) * (
            self.state_shards
        )
        free = self.memory_bytes - self.buffer_bytes
        return max(1, sharded // free + 1) if free > 0 else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory_bytes": self.memory_bytes,
            "profile": dataclasses.asdict(self.profile),
            "batch": self.batch,
            "seq_step": self.seq_step,
            "max_seq": self.max_seq,
            "state_shards": self.state_shards,
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "buffer_bytes": self.buffer_bytes,
            "state_bytes": self.state_bytes,
            "state_fits": self.state_fits,
            "shards_needed": self.shards_needed,
            "modes": [
                {
                    "activation_swap": mode.activation_swap,
                    "seq": mode.seq,
                    "capped": mode.capped,
                    "plan": None if mode.plan is None else mode.plan.to_dict(),
                }
                for mode in self.modes
            ],
            "traced": list(self.traced),
        }


def fit_sequence(
    config: PretrainedConfig,
    *,
    memory_bytes: int | None = None,
    batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str = "sdpa",
    device: str = "cuda",
    attn_kernel: str | None = None,
    tp: int = 1,
    hide_margin: float = DEFAULT_HIDE_MARGIN,
    profile: str | DeviceProfile = DEFAULT_PROFILE,
    bandwidth_gbps: float | None = None,
    tflops: float | None = None,
    offload_lag: int = 1,
    prefetch_depth: int = 1,
    state_shards: int = 1,
    seq_step: int = DEFAULT_SEQ_STEP,
    modes: Sequence[SwapMode] = SWAP_MODES,
) -> FitResult:
    """The longest sequence (a multiple of ``seq_step``) each of ``modes`` fits in
    ``memory_bytes`` (default: the profile's memory), with the plan at that length.

    The settings are :func:`~graphswap.planning.plan_memory`'s. When parameters,
    gradients and AdamW state alone leave no memory, nothing is traced and
    :attr:`FitResult.modes` is empty (see :attr:`FitResult.shards_needed`).
    """
    for mode in modes:
        check_settings(
            activation_swap=mode,
            hide_margin=hide_margin,
            offload_lag=offload_lag,
            prefetch_depth=prefetch_depth,
            state_shards=state_shards,
        )
    resolved = resolve_profile(profile, bandwidth_gbps=bandwidth_gbps, tflops=tflops)
    memory = resolved.memory_bytes if memory_bytes is None else memory_bytes
    if isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0:
        raise PlanSettingError("memory_bytes", memory, "must be a positive number of bytes")
    if isinstance(seq_step, bool) or not isinstance(seq_step, int) or seq_step < 1:
        raise PlanSettingError("seq_step", seq_step, "must be a positive integer")

    def meta_model(seq: int) -> MetaModel:
        return build_meta_model(
            config,
            seq=seq,
            batch=batch,
            dtype=dtype,
            attn_implementation=attn_implementation,
            device=device,
            attn_kernel=attn_kernel,
            tp=tp,
        )

    first = meta_model(seq_step)
    params = [p for p in first.model.parameters() if p.requires_grad]
    share = -(-storage_bytes(params) // state_shards)
    max_seq = max(seq_step, first.rank_config.max_position_embeddings)
    empty = FitResult(
        memory_bytes=memory,
        profile=resolved,
        batch=batch,
        seq_step=seq_step,
        max_seq=max_seq,
        state_shards=state_shards,
        parameter_bytes=share,
        gradient_bytes=share,
        optimizer_state_bytes=2 * share,
        buffer_bytes=storage_bytes(list(first.model.buffers())),
        modes=(),
        traced=(),
    )
    if not empty.state_fits:
        return empty
    probe = _Probe(
        lambda steps: first if steps == 1 else meta_model(steps * seq_step),
        lambda meta: _plan_modes(
            config,
            trace_step(meta, resolved),
            modes,
            hide_margin=hide_margin,
            offload_lag=offload_lag,
            prefetch_depth=prefetch_depth,
            state_shards=state_shards,
        ),
    )
    limit = max_seq // seq_step
    answers = {mode: _search(mode, probe, memory, limit) for mode in modes}
    return dataclasses.replace(
        empty,
        modes=tuple(
            ModeFit(
                mode,
                None if steps == 0 else steps * seq_step,
                None if steps == 0 else probe.plans[steps][mode],
                steps == limit,
            )
            for mode, steps in answers.items()
        ),
        traced=tuple(steps * seq_step for steps in probe.plans),
    )


def _plan_modes(
    config: PretrainedConfig,
    trace: StepTrace,
    modes: Sequence[str],
    *,
    hide_margin: float,
    offload_lag: int,
    prefetch_depth: int,
    state_shards: int,
) -> dict[str, MemoryPlan]:
    """Every mode's plan on one trace (every rule runs ``swap_large_activations``)."""
    baseline = replay(
        trace,
        SwapChoice(None, frozenset()),
        offload_lag=offload_lag,
        prefetch_depth=prefetch_depth,
        state_shards=state_shards,
    )
    return {
        mode: plan_step(
            config,
            trace,
            activation_swap=mode,
            hide_margin=hide_margin,
            offload_lag=offload_lag,
            prefetch_depth=prefetch_depth,
            state_shards=state_shards,
            baseline=baseline,
        )
        for mode in modes
    }


class _Probe:
    """Plans every mode at a length (in steps), tracing each length once."""

    def __init__(
        self,
        build: Callable[[int], MetaModel],
        plan: Callable[[MetaModel], dict[str, MemoryPlan]],
    ) -> None:
        self._build = build
        self._plan = plan
        self.plans: dict[int, dict[str, MemoryPlan]] = {}
        """Per length traced, in order, every mode's plan."""

    def peaks(self, mode: str) -> dict[int, int]:
        return {steps: plans[mode].timeline.peak_bytes for steps, plans in self.plans.items()}

    def fits(self, mode: str, steps: int, memory: int) -> bool:
        plans = self.plans.get(steps)
        if plans is None:
            plans = self.plans[steps] = self._plan(self._build(steps))
        return plans[mode].timeline.peak_bytes <= memory


def _search(mode: str, probe: _Probe, memory: int, limit: int) -> int:
    """The most steps (1 to ``limit``) whose plan of ``mode`` fits ``memory``; 0: none."""
    if not probe.fits(mode, 1, memory):
        return 0
    width: int | None = None
    while True:
        peaks = probe.peaks(mode)
        lo = max(steps for steps, peak in peaks.items() if peak <= memory)
        hi = min((s for s, peak in peaks.items() if peak > memory and s > lo), default=None)
        if hi is None and lo == limit:
            return lo
        if hi is not None and hi - lo <= 1:
            return lo
        if hi is None:
            below = max((s for s in peaks if s < lo), default=None)
            guess = 2 * lo
            if below is not None:
                guess = _crossing(below, peaks[below], lo, peaks[lo], memory, guess)
            guess = min(limit, max(lo + 1, guess))
        elif width is not None and 2 * (hi - lo) > width:
            guess = (lo + hi) // 2  # the line stopped narrowing the bracket: halve it
        else:
            guess = _crossing(lo, peaks[lo], hi, peaks[hi], memory, (lo + hi) // 2)
            guess = min(hi - 1, max(lo + 1, guess))
        width = None if hi is None else hi - lo
        probe.fits(mode, guess, memory)


def _crossing(a: int, peak_a: int, b: int, peak_b: int, memory: int, fallback: int) -> int:
    """Where the line through ``(a, peak_a)`` and ``(b, peak_b)`` reaches ``memory``
    (rounded down); ``fallback`` when the line is flat."""
    if peak_a == peak_b or a == b:
        return fallback
    return int(a + (memory - peak_a) * (b - a) / (peak_b - peak_a))
