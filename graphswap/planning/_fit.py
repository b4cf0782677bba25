"""The longest sequence each swap mode fits in a device's memory, and its step ratio.

A length fits when the replayed step's device peak (parameters, gradients and
optimizer state included) is at most the memory. With swap the peak does not grow
monotonically with the sequence (the copy windows grow as seq², the bytes as seq, so
``auto`` moves a larger share of a longer step, and a host budget refuses more of it),
so every multiple of the step (the given shape's ``seq_len``) up to the model's window
(``max_position_embeddings``, or longer where rope scaling stretches it:
:func:`~graphswap.hf.rope.context_window`) is planned: a mode's answer is the longest
length below which every length fits, and the lengths that fit are reported as
intervals when they are not one. A few traces give every length's step
(:mod:`graphswap.planning._lengths`). Asked for a ``max_step_ratio``, each mode also
answers the longest of those lengths whose step runs at that ratio or
less: the ratio is not monotone in the length (a budget that must take a heavier
recompute level at one length pays less of the step for it at longer ones), so a
shorter length may run above it.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphswap import _compat
from graphswap._compat import Renamed
from graphswap.errors import RewriteError
from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.hf.rope import context_window
from graphswap.planning._budget import BudgetError, BudgetOption
from graphswap.planning._lengths import TraceLengths
from graphswap.planning._plan import (
    DEFAULT_PROFILE,
    SWAP_MODES,
    MemoryPlan,
    SwapMode,
    resolve_profile,
)
from graphswap.planning._registry import STRATEGIES, memory_strategy
from graphswap.planning._replay import replay_without_swap, state_bytes
from graphswap.planning._settings import (
    DEFAULT_SCHEDULE,
    StepShape,
    SwapSchedule,
    check_int,
    split_settings,
)
from graphswap.planning._trace import BlockKind, StepTrace, storage_bytes
from graphswap.planning._trace_cache import trace_once
from graphswap.planning._units import RecomputeKind
from graphswap.planning.saved_tensors import MetaModel, build_meta_model
from graphswap.rewriting.rules import SWAP_MODE_RULES, check_rule
from graphswap.runtime.policy import MIN_SWAP_TENSOR_BYTES, SwapPolicy, policy_name
from graphswap.runtime.policy import swap_large_activations as default_policy
from graphswap.runtime.profile import DeviceProfile

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DEFAULT_SEQ_STEP = 512
"""``fit_sequence`` answers in multiples of this many tokens unless its shape says
otherwise (``StepShape(seq_len=...)``; ``plan-memory --seq-step``)."""


@dataclass(frozen=True)
class LengthPoint:
    """One mode's step at one length of the fit's grid."""

    seq_len: int
    """Tokens per sequence."""
    peak_bytes: int
    """The step's device peak."""
    step_ratio: float
    """Its time against the step without swap."""
    host_peak_bytes: int
    """The most pinned host memory its swap holds at once."""

    seq = Renamed("seq_len")


@dataclass(frozen=True)
class ModeFit:
    """One mode's longest sequence, and every length of the grid it fits at."""

    activation_swap: SwapMode
    """The mode: ``none``, ``attention``, ``layer`` or ``auto``."""
    seq_len: int | None
    """The longest multiple of the step at and below which every multiple fits; ``None``:
    not even one step."""
    plan: MemoryPlan | None
    """The plan at that length."""
    capped: bool
    """It fits even at the longest length searched (the model's window)."""
    fits: tuple[tuple[int, int], ...] = ()
    """The lengths that fit, as ``(first, last)`` runs of consecutive multiples; more than
    one run: the peak came back under the memory at a longer length."""
    points: tuple[LengthPoint, ...] = ()
    """The mode's step at every length planned, in order."""
    refused: str | None = None
    """Why the mode's swap rule refuses this model (a hybrid stack's attention): nothing
    is planned for it."""
    seq_len_at_max_step_ratio: int | None = None
    """With a ``max_step_ratio``: the longest multiple of the step that fits, and every
    shorter one too (the run :attr:`seq_len` ends), and runs at that step ratio or less;
    ``None``: none does, or no ratio asked."""

    seq = Renamed("seq_len")  # 0.1.0's name, until 0.3

    @property
    def contiguous(self) -> bool:
        """The lengths that fit are one run from the step up (or there are none)."""
        return len(self.fits) <= 1


@dataclass(frozen=True)
class FitResult:
    """What fits in ``memory_bytes``, per mode, on one rank."""

    memory_bytes: int
    """The device memory searched in."""
    profile: DeviceProfile
    """The device the steps were timed on."""
    batch_size: int
    """Sequences per batch."""
    seq_step: int
    """Answers are multiples of this many tokens."""
    max_seq: int
    """The longest length searched: the model's window, ``max_position_embeddings`` or its
    rope scaling's (:func:`~graphswap.hf.rope.context_window`)."""
    state_shards: int
    """Ranks the parameters, gradients and optimizer state are sharded over."""
    parameter_bytes: int
    """One rank's share of the parameters."""
    gradient_bytes: int
    """One rank's share of the gradients (the trained parameters' size and dtype: with
    LoRA, the adapters')."""
    optimizer_state_bytes: int
    """One rank's share of AdamW's two moments (twice the trained parameters, in their
    dtype)."""
    buffer_bytes: int
    """The model's buffers (replicated)."""
    max_host_bytes: int
    """The host pool's budget per rank the swaps were planned against."""
    modes: tuple[ModeFit, ...]
    """Empty when the state alone does not fit."""
    traced: tuple[int, ...]
    """The sequence lengths traced, in order; every other length planned was
    interpolated from them."""
    planned: int = 0
    """The lengths planned: every multiple of the step up to ``max_seq``, or fewer where
    the state and what the embedding and the head save (which no mode swaps or recomputes)
    exceed the memory at the next one: no mode fits there, nor at any longer length."""
    lora_rank: int | None = None
    """The rank of the LoRA adapters that train (what the gradients and AdamW state
    count); ``None``: every parameter trains."""
    max_step_ratio: float | None = None
    """The step ratio each mode's :attr:`ModeFit.seq_len_at_max_step_ratio` keeps within;
    ``None``: not asked."""

    batch = Renamed("batch_size")

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
            "batch_size": self.batch_size,
            "seq_step": self.seq_step,
            "max_seq": self.max_seq,
            "state_shards": self.state_shards,
            "lora_rank": self.lora_rank,
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "buffer_bytes": self.buffer_bytes,
            "max_host_bytes": self.max_host_bytes,
            "state_bytes": self.state_bytes,
            "state_fits": self.state_fits,
            "shards_needed": self.shards_needed,
            "max_step_ratio": self.max_step_ratio,
            "modes": [
                {
                    "activation_swap": mode.activation_swap,
                    "seq_len": mode.seq_len,
                    "seq_len_at_max_step_ratio": mode.seq_len_at_max_step_ratio,
                    "capped": mode.capped,
                    "fits": [list(run) for run in mode.fits],
                    "refused": mode.refused,
                    "plan": None if mode.plan is None else mode.plan.to_dict(),
                    "points": [dataclasses.asdict(point) for point in mode.points],
                }
                for mode in self.modes
            ],
            "traced": list(self.traced),
            "planned": self.planned,
        }


@_compat.flat_fit_settings
def fit_sequence(
    config: PretrainedConfig,
    shape: StepShape | None = None,
    *,
    schedule: SwapSchedule = DEFAULT_SCHEDULE,
    memory_bytes: int | None = None,
    profile: str | DeviceProfile = DEFAULT_PROFILE,
    modes: Sequence[SwapMode] = SWAP_MODES,
    max_step_ratio: float | None = None,
    swap_bandwidth_gbps: float | None = None,
    swap_tflops: float | None = None,
) -> FitResult:
    """The longest sequence (a multiple of ``shape``'s ``seq_len``) each of ``modes``
    fits in ``memory_bytes`` (default: the profile's memory) at every multiple up to it,
    with the plan at that length and every length that fits; with ``max_step_ratio``
    (>= 1), also the longest of those whose step runs at that ratio or less.

    ``shape``: the fit's first and shortest step (default: ``StepShape(seq_len=512)``,
    :data:`DEFAULT_SEQ_STEP`); its ``seq_len`` is the fit's step, and the fit plans the
    shape at every multiple of it up to the model's window
    (:func:`~graphswap.hf.rope.context_window`: rope scaling in the config stretches it).
    ``schedule``, ``profile`` and the figures are :func:`~graphswap.planning.plan_memory`'s.
    When parameters, gradients and AdamW state alone leave no memory, nothing is traced
    and :attr:`FitResult.modes` is empty (see :attr:`FitResult.shards_needed`).

    The flat keywords of 0.2.0 (``seq_step=``, ``state_shards=``, ...; 0.1.0's
    names too) still work until 0.3, with a ``DeprecationWarning``
    (:mod:`graphswap._compat._flat_settings`).
    """
    for mode in modes:
        memory_strategy(mode)
    check_max_step_ratio(max_step_ratio)
    resolved = resolve_profile(
        profile, swap_bandwidth_gbps=swap_bandwidth_gbps, swap_tflops=swap_tflops
    )
    memory = resolved.memory_bytes if memory_bytes is None else memory_bytes
    if isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0:
        raise PlanSettingError("memory_bytes", memory, "must be a positive number of bytes")
    shape = StepShape(seq_len=DEFAULT_SEQ_STEP) if shape is None else shape
    for name, value, kind in (("shape", shape, StepShape), ("schedule", schedule, SwapSchedule)):
        if not isinstance(value, kind):
            raise PlanSettingError(
                name, value, f"must be a {kind.__name__} (graphswap.planning.trace)"
            )
    first = build_meta_model(config, shape)
    empty = dataclasses.replace(
        _state(first, memory, resolved, shape, schedule), max_step_ratio=max_step_ratio
    )
    if not empty.state_fits:
        return empty
    refused = {mode: _refusal(first, mode) for mode in modes}
    scans = {mode: _Scan(mode, max_step_ratio) for mode in modes if refused[mode] is None}
    step = shape.seq_len
    lengths = [k * step for k in range(1, empty.max_seq // step + 1)] if scans else []
    grid = _Grid(config, first, shape, resolved, lengths)
    planned = 0
    with _collector_paused():
        for seq in lengths:
            if not _plan_length(config, grid, seq, scans, memory, schedule):
                break
            planned += 1
    return dataclasses.replace(
        empty,
        modes=tuple(
            scans[mode].result(empty.max_seq)
            if reason is None
            else ModeFit(mode, None, None, capped=False, refused=reason)
            for mode, reason in refused.items()
        ),
        traced=grid.traced,
        planned=planned,
    )


def fit_settings(
    caller: str, settings: Mapping[str, Any], seq_step: int
) -> tuple[StepShape, SwapSchedule, dict[str, Any]]:
    """Flat settings under the config's keys, as the CLI holds them, made into the fit's
    first step (``seq_len``: ``seq_step``, the fit's step), its schedule and the
    profile's overrides; ``seq_len`` itself is refused: the fit searches it."""
    shape_settings, schedule, figures = split_settings(caller, settings)
    check_int("seq_step", seq_step, 1, "the fit answers in its multiples")
    if "seq_len" in shape_settings:
        raise PlanSettingError(
            "seq_len", shape_settings["seq_len"], "is what the fit searches; leave it out"
        )
    return StepShape(seq_len=seq_step, **shape_settings), schedule, figures


def check_max_step_ratio(max_step_ratio: object) -> None:
    """``None``, or a finite number >= 1: no step runs faster than the step without swap."""
    if max_step_ratio is None:
        return
    if (
        isinstance(max_step_ratio, bool)
        or not isinstance(max_step_ratio, (int, float))
        or not math.isfinite(max_step_ratio)
        or max_step_ratio < 1
    ):
        raise PlanSettingError(
            "max_step_ratio",
            max_step_ratio,
            "must be a finite number >= 1: a step's time over the time of the step without "
            "swap at the same length (1.05: at most 5% slower)",
        )


def _state(
    first: MetaModel, memory: int, profile: DeviceProfile, shape: StepShape, schedule: SwapSchedule
) -> FitResult:
    """What one rank holds whatever the length, and the lengths searched (multiples of
    ``shape``'s, the step's): nothing planned yet."""
    window = context_window(first.rank_config)
    if window is None:
        raise PlanSettingError(
            "model",
            type(first.model).__name__,
            "its config names no max_position_embeddings, the longest length to search; "
            "plan one seq_len at a time",
        )
    shards = schedule.state_shards
    params = list(first.model.parameters())
    trained = -(-storage_bytes([p for p in params if p.requires_grad]) // shards)
    return FitResult(
        memory_bytes=memory,
        profile=profile,
        batch_size=shape.batch_size,
        seq_step=shape.seq_len,
        max_seq=max(shape.seq_len, window),
        state_shards=schedule.state_shards,
        parameter_bytes=-(-storage_bytes(params) // shards),
        gradient_bytes=trained,
        optimizer_state_bytes=2 * trained,
        buffer_bytes=storage_bytes(list(first.model.buffers())),
        max_host_bytes=schedule.max_host_bytes_on(profile),
        modes=(),
        traced=(),
        lora_rank=first.lora_rank,
    )


class _Grid:
    """The fit's steps at every length, per recompute level, traced when first asked."""

    def __init__(
        self,
        config: PretrainedConfig,
        first: MetaModel,
        shape: StepShape,
        profile: DeviceProfile,
        lengths: Sequence[int],
    ) -> None:
        self._config = config
        self._first = first
        self._shape = shape
        self._profile = profile
        self._lengths = lengths
        self._levels: dict[tuple[RecomputeKind, ...], TraceLengths] = {}

    @property
    def traced(self) -> tuple[int, ...]:
        """The lengths traced, level by level, in the order they were."""
        return tuple(seq for level in self._levels.values() for seq in level.traced)

    def __call__(self, recompute: tuple[RecomputeKind, ...]) -> TraceLengths:
        """The grid's steps with ``recompute`` in every layer."""
        found = self._levels.get(recompute)
        if found is None:
            found = self._levels[recompute] = TraceLengths(
                lambda seq, policy: self._trace(recompute, seq, policy),
                self._lengths,
                min_bytes=MIN_SWAP_TENSOR_BYTES,
                name=policy_name(default_policy),
                like=self._levels.get(()) if recompute else None,
            )
        return found

    def _trace(
        self, recompute: tuple[RecomputeKind, ...], seq: int, policy: SwapPolicy
    ) -> StepTrace:
        at = dataclasses.replace(self._shape, seq_len=seq)
        meta = (
            self._first
            if seq == self._shape.seq_len and not recompute
            else build_meta_model(self._config, at, recompute=recompute)
        )
        return trace_once(meta, at, recompute, self._profile, policy)


def _plan_length(
    config: PretrainedConfig,
    grid: _Grid,
    seq: int,
    scans: dict[SwapMode, _Scan],
    memory: int,
    schedule: SwapSchedule,
) -> bool:
    """Every mode's plan at ``seq``, each added to its scan; ``False``, planning nothing,
    when what every mode holds there (:func:`_floor_bytes`) exceeds ``memory``."""
    trace = grid(())(seq)
    if _floor_bytes(trace, schedule.state_shards) > memory:
        return False
    baseline = replay_without_swap(trace, schedule)
    made: dict[tuple[tuple[RecomputeKind, ...], str], MemoryPlan] = {}
    # Those that weigh others' plans last, to reuse them (stable: the modes' order else).
    for mode in sorted(scans, key=lambda m: STRATEGIES[m].weighs_others):
        try:
            plan = STRATEGIES[mode].fit_plan(
                config, trace, lambda kinds: grid(kinds)(seq), schedule, baseline, memory, made
            )
        except BudgetError as error:
            scans[mode].miss(seq, error.smallest)
            continue
        made[(), mode] = plan
        scans[mode].add(plan, memory)
    return True


def _floor_bytes(trace: StepTrace, state_shards: int) -> int:
    """What every mode's step holds when its forward ends: the state, and what the
    embedding and the head save (logits, loss), which no mode swaps or recomputes, all
    held until their backward. It grows with the length, so past a length where it
    exceeds the memory no mode fits, and a fit of a long window stops planning there."""
    outside = {
        t.block
        for t in trace.saves
        if t.layer is None
        and t.block is not None
        and trace.blocks[t.block].kind is BlockKind.ACTIVATION
    }
    return state_bytes(trace, state_shards) + sum(trace.blocks[b].nbytes for b in outside)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while the fit plans, and back as it was after.

    The fit holds a dozen traced steps (about a million objects the collector tracks) and
    makes a few hundred more steps and plans from them, each short-lived and freed by
    reference counting; with the collector on, those allocations set off some forty full
    collections, each walking the whole heap: a third of the planning's time, for no
    garbage (the fit makes no cycles it needs collected to stay within its memory).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _refusal(meta: MetaModel, mode: SwapMode) -> str | None:
    """Why ``mode``'s swap rule refuses the model, as ``graphswap train`` would say it."""
    rule = SWAP_MODE_RULES.get(mode)
    if rule is None:
        return None
    try:
        check_rule(meta.model, rule)
    except RewriteError as error:
        return str(error)
    return None


class _Scan:
    """One mode's plans over the grid, in order: what fits, and the answer's plan."""

    def __init__(self, mode: SwapMode, max_step_ratio: float | None = None) -> None:
        self.mode = mode
        self.max_step_ratio = max_step_ratio
        self.within: int | None = None
        """The last length of the run from the step up that fits to run at
        ``max_step_ratio`` or less."""
        self._within_open = max_step_ratio is not None
        """Every length so far fit."""
        self.points: list[LengthPoint] = []
        self.fits: list[list[int]] = []
        """Runs of fitting lengths, ``[first, last]``."""
        self.answer: MemoryPlan | None = None
        """The plan at the last length of the run that starts at the step."""
        self._last_fits = False
        """The length before this one fit."""

    def add(self, plan: MemoryPlan, memory: int) -> None:
        timeline = plan.timeline
        self.points.append(
            LengthPoint(plan.seq_len, timeline.peak_bytes, plan.step_ratio, plan.host_peak_bytes)
        )
        fits = timeline.peak_bytes <= memory
        if fits and self._last_fits:
            self.fits[-1][1] = plan.seq_len
        elif fits:
            self.fits.append([plan.seq_len, plan.seq_len])
        self._last_fits = fits
        if fits and len(self.fits) == 1 and self.fits[0][0] == self.points[0].seq_len:
            self.answer = plan
        self._within(plan.seq_len, fits, plan.step_ratio)

    def _within(self, seq: int, fits: bool, step_ratio: float) -> None:
        """Past the run that fits, nothing counts; within it, a length at ``max_step_ratio``
        or less is the answer so far. A ratio within a part in 10^9 of it counts as at it
        (the printed ratio reads as equal)."""
        limit = self.max_step_ratio
        if not self._within_open or limit is None:
            return
        if not fits:
            self._within_open = False
        elif step_ratio <= limit * (1 + 1e-9):
            self.within = seq

    def miss(self, seq: int, closest: BudgetOption) -> None:
        """``budget`` found no plan within the memory at ``seq``; ``closest`` came nearest."""
        self.points.append(LengthPoint(seq, closest.peak_bytes, closest.step_ratio, 0))
        self._last_fits = False
        self._within_open = False

    def result(self, max_seq: int) -> ModeFit:
        """The mode's answer, capped when it reaches ``max_seq``, the grid's last length."""
        answer = self.answer
        return ModeFit(
            self.mode,
            None if answer is None else answer.seq_len,
            answer,
            answer is not None and answer.seq_len == max_seq,
            tuple((first, last) for first, last in self.fits),
            tuple(self.points),
            seq_len_at_max_step_ratio=self.within,
        )
