"""The longest sequence each swap mode fits in a device's memory, and its step ratio.

A length fits when the replayed step's device peak (parameters, gradients and
optimizer state included) is at most the memory. With swap the peak does not grow
monotonically with the sequence (the copy windows grow as seq², the bytes as seq, so
``auto`` moves a larger share of a longer step, and a host budget refuses more of it),
so every multiple of ``seq_step`` up to the model's ``max_position_embeddings`` is
planned: a mode's answer is the longest length below which every length fits, and the
lengths that fit are reported as intervals when they are not one. A few traces give
every length's step (:mod:`graphswap.planning._lengths`).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphswap._deprecated import Renamed
from graphswap.errors import RewriteError
from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.planning._budget import BudgetError, BudgetOption, plan_budget
from graphswap.planning._lengths import TraceLengths
from graphswap.planning._plan import (
    DEFAULT_PROFILE,
    SWAP_MODES,
    MemoryPlan,
    SwapMode,
    check_mode,
    plan_step,
    resolve_profile,
)
from graphswap.planning._replay import replay_without_swap
from graphswap.planning._settings import StepShape, check_int, split_settings
from graphswap.planning._trace import StepTrace, storage_bytes
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
"""``fit_sequence`` answers in multiples of this many tokens."""


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
    """It fits even at the longest length searched (the model's ``max_position_embeddings``)."""
    fits: tuple[tuple[int, int], ...] = ()
    """The lengths that fit, as ``(first, last)`` runs of consecutive multiples; more than
    one run: the peak came back under the memory at a longer length."""
    points: tuple[LengthPoint, ...] = ()
    """The mode's step at every length planned, in order."""
    refused: str | None = None
    """Why the mode's swap rule refuses this model (a hybrid stack's attention): nothing
    is planned for it."""

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
    max_host_bytes: int
    """The host pool's budget per rank the swaps were planned against."""
    modes: tuple[ModeFit, ...]
    """Empty when the state alone does not fit."""
    traced: tuple[int, ...]
    """The sequence lengths traced, in order; every other length planned was
    interpolated from them."""
    planned: int = 0
    """The lengths planned: every multiple of the step up to ``max_seq``."""

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
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "buffer_bytes": self.buffer_bytes,
            "max_host_bytes": self.max_host_bytes,
            "state_bytes": self.state_bytes,
            "state_fits": self.state_fits,
            "shards_needed": self.shards_needed,
            "modes": [
                {
                    "activation_swap": mode.activation_swap,
                    "seq_len": mode.seq_len,
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


def fit_sequence(
    config: PretrainedConfig,
    *,
    memory_bytes: int | None = None,
    profile: str | DeviceProfile = DEFAULT_PROFILE,
    seq_step: int = DEFAULT_SEQ_STEP,
    modes: Sequence[SwapMode] = SWAP_MODES,
    **settings: Any,
) -> FitResult:
    """The longest sequence (a multiple of ``seq_step``) each of ``modes`` fits in
    ``memory_bytes`` (default: the profile's memory) at every multiple up to it, with the
    plan at that length and every length that fits.

    ``profile`` and ``settings`` are :func:`~graphswap.planning.plan_memory`'s, the
    config's keys, but ``seq_len``, which the fit searches. When parameters, gradients
    and AdamW state alone leave no memory, nothing is traced and
    :attr:`FitResult.modes` is empty (see :attr:`FitResult.shards_needed`).
    """
    for mode in modes:
        check_mode(mode)
    shape_settings, schedule, figures = split_settings("fit_sequence", settings)
    resolved = resolve_profile(profile, **figures)
    memory = resolved.memory_bytes if memory_bytes is None else memory_bytes
    if isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0:
        raise PlanSettingError("memory_bytes", memory, "must be a positive number of bytes")
    check_int("seq_step", seq_step, 1, "the fit answers in its multiples")
    if "seq_len" in shape_settings:
        raise PlanSettingError(
            "seq_len", shape_settings["seq_len"], "is what the fit searches; leave it out"
        )
    shape = StepShape(seq_len=seq_step, **shape_settings)
    state_shards = schedule.state_shards

    first = build_meta_model(config, shape)
    params = [p for p in first.model.parameters() if p.requires_grad]
    share = -(-storage_bytes(params) // state_shards)
    max_seq = max(seq_step, first.rank_config.max_position_embeddings)
    empty = FitResult(
        memory_bytes=memory,
        profile=resolved,
        batch_size=shape.batch_size,
        seq_step=seq_step,
        max_seq=max_seq,
        state_shards=state_shards,
        parameter_bytes=share,
        gradient_bytes=share,
        optimizer_state_bytes=2 * share,
        buffer_bytes=storage_bytes(list(first.model.buffers())),
        max_host_bytes=resolved.host_budget_bytes
        if schedule.max_host_bytes is None
        else schedule.max_host_bytes,
        modes=(),
        traced=(),
    )
    if not empty.state_fits:
        return empty

    refused = {mode: _refusal(first, mode) for mode in modes}
    planned = [mode for mode in modes if refused[mode] is None]
    lengths = [steps * seq_step for steps in range(1, max_seq // seq_step + 1)] if planned else []
    levels: dict[tuple[RecomputeKind, ...], TraceLengths] = {}

    def series(recompute: tuple[RecomputeKind, ...]) -> TraceLengths:
        """The grid's steps with ``recompute`` in every layer, traced when first asked."""
        found = levels.get(recompute)
        if found is None:

            def trace(seq: int, policy: SwapPolicy) -> StepTrace:
                at = dataclasses.replace(shape, seq_len=seq)
                meta = (
                    first
                    if seq == seq_step and not recompute
                    else build_meta_model(config, at, recompute=recompute)
                )
                return trace_once(meta, at, recompute, resolved, policy)

            found = levels[recompute] = TraceLengths(
                trace,
                lengths,
                min_bytes=MIN_SWAP_TENSOR_BYTES,
                name=policy_name(default_policy),
                like=levels.get(()) if recompute else None,
            )
        return found

    scans = {mode: _Scan(mode) for mode in planned}
    fixed = [mode for mode in planned if mode != "budget"]
    with _collector_paused():
        for seq in lengths:
            trace = series(())(seq)
            baseline = replay_without_swap(trace, schedule)
            made = {}
            for mode in fixed:
                plan = made[(), mode] = plan_step(
                    config,
                    trace,
                    activation_swap=mode,
                    schedule=schedule,
                    baseline=baseline,
                )
                scans[mode].add(plan, memory)
            if "budget" in scans:
                try:
                    budgeted = plan_budget(
                        config,
                        lambda kinds, seq=seq: series(kinds)(seq),  # type: ignore[misc]
                        budget=memory,
                        schedule=schedule,
                        baseline=baseline,
                        known=made,  # type: ignore[arg-type]
                    )
                except BudgetError as error:
                    scans["budget"].miss(seq, error.smallest)
                else:
                    scans["budget"].add(budgeted, memory)
    return dataclasses.replace(
        empty,
        modes=tuple(
            scans[mode].result()
            if reason is None
            else ModeFit(mode, None, None, capped=False, refused=reason)
            for mode, reason in refused.items()
        ),
        traced=tuple(seq for s in levels.values() for seq in s.traced),
        planned=len(lengths),
    )


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

    def __init__(self, mode: SwapMode) -> None:
        self.mode = mode
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

    def miss(self, seq: int, closest: BudgetOption) -> None:
        """``budget`` found no plan within the memory at ``seq``; ``closest`` came nearest."""
        self.points.append(LengthPoint(seq, closest.peak_bytes, closest.step_ratio, 0))
        self._last_fits = False

    def result(self) -> ModeFit:
        answer = self.answer
        return ModeFit(
            self.mode,
            None if answer is None else answer.seq_len,
            answer,
            answer is not None and answer.seq_len == self.points[-1].seq_len,
            tuple((first, last) for first, last in self.fits),
            tuple(self.points),
        )
