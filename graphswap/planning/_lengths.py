"""Traced steps at every length of a grid from a few traces: what makes ``--fit`` exact.

A fit must know the peak at every multiple of its step, since with swap the peak does
not grow monotonically with the sequence (the windows grow as seq², the bytes as seq,
so ``auto`` moves more of a longer step). A 48-layer step takes seconds to trace, so
tracing every length is too slow; but a decoder runs the same operators in the same
order at every length, and every number of the trace (a storage's bytes, a save's
shape, an operator's FLOPs and bytes) is a polynomial of degree at most two in the
sequence (attention scores are seq x seq). So the steps of a range of lengths follow
from three traces of it, by interpolation, checked exactly against a fourth; a range
where the structure changes (a sliding window's mask appears) or the check fails is
split, down to tracing each length.

The size threshold of the swap policy is the one thing that does change along a range
(a tensor crosses 1 MiB): the traces ask a policy without a threshold, and the
threshold is applied to each length's bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.planning._trace import Block, Event, StepTrace, TracedSave
from graphswap.planning.saved_tensors import LayerTrace, SavedTensor
from graphswap.runtime.policy import SwapPolicy, size_threshold_policy

ELIGIBLE = size_threshold_policy(0, name="eligible")
"""What the traces ask: the size policy without its threshold."""

_PROBES = 4
"""Traces that decide a range: three to interpolate through, one to check."""


def _structure(trace: StepTrace) -> tuple[Any, ...]:
    """Everything of ``trace`` that must not depend on the length."""
    return (
        tuple(p if e is not Event.COMPUTE else None for e, p in trace.events),
        tuple(e for e, _ in trace.events),
        tuple(len(ops) for ops in trace.costs),
        tuple(op.attention for ops in trace.costs for op in ops),
        tuple(b.kind for b in trace.blocks),
        tuple((s.layer, s.block, *_save_structure(s.save)) for s in trace.saves),
        tuple((layer.name, layer.moe, len(layer.saves)) for layer in trace.saved.layers),
        (len(trace.saved.embed), len(trace.saved.head)),
        (trace.parameter_bytes, trace.buffer_bytes, trace.optimizer_state_bytes),
        (trace.batch_size, trace.dtype, trace.attn_implementation, trace.device, trace.optimizer),
        trace.attention_timing,
        trace.recomputed,
    )


def _save_structure(save: SavedTensor) -> tuple[Any, ...]:
    return (
        save.index,
        save.storage,
        save.parameter,
        save.in_attention,
        save.policy_swaps,
        save.dtype,
        len(save.shape),
    )


def _numbers(trace: StepTrace) -> np.ndarray:
    """Every number of ``trace`` that may depend on the length, in a fixed order."""
    values: list[float] = [b.nbytes for b in trace.blocks]
    for ops in trace.costs:
        for op in ops:
            values.append(op.flops)
            values.append(op.nbytes)
    for traced in trace.saves:
        save = traced.save
        values.extend(save.shape)
        values.append(save.nbytes)
        values.append(save.storage_nbytes)
    values.extend(trace.recomputed_bytes)
    return np.array(values, dtype=np.float64)


def _weights(points: Sequence[int], at: int) -> tuple[Fraction, ...]:
    """Lagrange weights of the quadratic through ``points`` evaluated at ``at``."""
    return tuple(
        math.prod(
            (Fraction(at - other, point - other) for other in points if other != point),
            start=Fraction(1),
        )
        for point in points
    )


def _interpolate(points: Sequence[int], values: Sequence[np.ndarray], at: int) -> np.ndarray:
    w0, w1, w2 = (float(w) for w in _weights(points, at))
    a, b, c = values
    return w0 * a + w1 * b + w2 * c


def _matches(predicted: np.ndarray, traced: np.ndarray) -> bool:
    return bool(np.all(np.abs(predicted - traced) <= 1e-9 * np.maximum(1.0, np.abs(traced))))


def _compute_positions(trace: StepTrace) -> list[int]:
    return [i for i, (event, _) in enumerate(trace.events) if event is Event.COMPUTE]


def _with_saves(
    trace: StepTrace, fresh: Callable[[SavedTensor], SavedTensor], **changes: Any
) -> StepTrace:
    """``trace`` with each save replaced by ``fresh(save)``, in its traced saves and its
    per-scope lists alike, and ``changes`` made."""
    saves = {id(t.save): fresh(t.save) for t in trace.saves}
    saved = trace.saved
    return dataclasses.replace(
        trace,
        saves=tuple(TracedSave(saves[id(t.save)], t.layer, t.block) for t in trace.saves),
        saved=dataclasses.replace(
            saved,
            embed=tuple(saves[id(s)] for s in saved.embed),
            layers=tuple(
                LayerTrace(layer.name, layer.moe, tuple(saves[id(s)] for s in layer.saves))
                for layer in saved.layers
            ),
            head=tuple(saves[id(s)] for s in saved.head),
        ),
        **changes,
    )


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each kind of number sits in :func:`_numbers`' order, for one structure."""

    blocks: int
    """Numbers before the operators': one per block."""
    ops: int
    """Operators, two numbers each (FLOPs, bytes)."""
    attention: np.ndarray
    """Per operator: it is attention (timed at the profile's attention efficiency)."""
    groups: np.ndarray
    """Where each ``COMPUTE`` event's operators begin, in operator order."""
    positions: tuple[int, ...]
    """The ``COMPUTE`` events' positions in the event list."""

    @classmethod
    def of(cls, trace: StepTrace) -> _Layout:
        sizes = [len(ops) for ops in trace.costs]
        return cls(
            blocks=len(trace.blocks),
            ops=sum(sizes),
            attention=np.array(
                [op.attention is not None for ops in trace.costs for op in ops], dtype=bool
            ),
            groups=np.array(list(itertools.accumulate(sizes, initial=0))[:-1], dtype=np.int64),
            positions=tuple(_compute_positions(trace)),
        )


def _rebuild(
    template: StepTrace, layout: _Layout, seq: int, values: np.ndarray, min_bytes: int, name: str
) -> StepTrace:
    """``template`` with its length-dependent numbers replaced by ``values``
    (:func:`_numbers`' order), compute events re-timed on its profile as
    :meth:`~graphswap.runtime.profile.OpCost.seconds` times them, and each save asked
    the size policy of ``min_bytes`` (called ``name``)."""
    profile = template.profile
    rate = profile.tflops * 1e12
    hbm = profile.hbm_gbps * 1e9
    ints = np.rint(values).astype(np.int64)
    blocks = tuple(
        Block(nbytes, block.kind)
        for nbytes, block in zip(ints[: layout.blocks].tolist(), template.blocks, strict=True)
    )
    ops = values[layout.blocks : layout.blocks + 2 * layout.ops]
    rates = np.where(layout.attention, rate * profile.attention_efficiency, rate)
    per_op = np.maximum(ops[0::2] / rates, np.rint(ops[1::2]) / hbm)
    seconds = np.add.reduceat(per_op, layout.groups).tolist() if layout.ops else []
    events = list(template.events)
    for position, time in zip(layout.positions, seconds, strict=True):
        events[position] = (Event.COMPUTE, time)
    rest = ints[layout.blocks + 2 * layout.ops :].tolist()
    at = 0

    def fresh(save: SavedTensor) -> SavedTensor:
        nonlocal at
        dims = len(save.shape)
        shape = tuple(rest[at : at + dims])
        nbytes, storage_nbytes = rest[at + dims], rest[at + dims + 1]
        at += dims + 2
        return SavedTensor(
            save.index,
            shape,
            save.dtype,
            nbytes,
            save.storage,
            storage_nbytes,
            save.parameter,
            save.in_attention,
            save.policy_swaps and nbytes >= min_bytes,
        )

    rebuilt = _with_saves(
        template, fresh, seq_len=seq, events=tuple(events), costs=(), blocks=blocks, policy=name
    )
    return dataclasses.replace(rebuilt, recomputed_bytes=tuple(rest[at:]))


def _thresholded(trace: StepTrace, min_bytes: int, name: str) -> StepTrace:
    """``trace`` (traced with :data:`ELIGIBLE`) as the size policy of ``min_bytes``
    would have answered it."""

    def fresh(save: SavedTensor) -> SavedTensor:
        swaps = save.policy_swaps and save.nbytes >= min_bytes
        return save if swaps == save.policy_swaps else dataclasses.replace(save, policy_swaps=swaps)

    return _with_saves(trace, fresh, policy=name)


@dataclasses.dataclass(frozen=True)
class _Range:
    """Lengths whose steps follow from three traces."""

    points: tuple[int, int, int]
    values: tuple[np.ndarray, np.ndarray, np.ndarray]
    template: StepTrace
    layout: _Layout


class TraceLengths:
    """The step at every length of ``lengths`` (ascending), most of them interpolated.

    ``trace(seq)`` traces one length, asking ``policy`` (:data:`ELIGIBLE`); ``min_bytes``
    and ``name`` are the size policy the answers stand for. Ranges are decided when
    made (a handful of traces when the model's structure holds along the grid).

    ``like``: the same step with less recomputed, its ranges decided. A recompute runs
    again operators the step already runs, so its numbers are the same polynomials of
    the length: each of ``like``'s ranges is taken from three traces here, without a
    fourth to check, when their structure agrees (and decided as usual when not).
    """

    def __init__(
        self,
        trace: Callable[[int, SwapPolicy], StepTrace],
        lengths: Sequence[int],
        *,
        min_bytes: int,
        name: str,
        like: TraceLengths | None = None,
    ) -> None:
        self._trace = trace
        self._min_bytes = min_bytes
        self._name = name
        self._traces: dict[int, StepTrace] = {}
        self._ranges: list[tuple[int, int, _Range]] = []
        self._decided: list[list[int]] = []
        """The lengths of each range, in the order decided."""
        if like is None:
            self._cover(list(lengths))
            return
        covered: set[int] = set()
        for decided in like._decided:
            self._cover(decided, checked=True)
            covered.update(decided)
        for seq in lengths:
            if seq not in covered:
                self._traced(seq)

    @property
    def traced(self) -> tuple[int, ...]:
        """The lengths traced, in the order they were."""
        return tuple(self._traces)

    def _traced(self, seq: int) -> StepTrace:
        found = self._traces.get(seq)
        if found is None:
            found = self._traces[seq] = self._trace(seq, ELIGIBLE)
        return found

    def _cover(self, lengths: list[int], checked: bool = False) -> None:
        """Decide ``lengths``: one range, or split; ``checked``: a range of them was
        checked with the same operators, so three traces decide it."""
        if len(lengths) <= _PROBES:
            for seq in lengths:
                self._traced(seq)
            return
        lo, hi = lengths[0], lengths[-1]
        mid = lengths[len(lengths) // 2]
        check = lengths[len(lengths) // 4]
        traces = [self._traced(seq) for seq in ((lo, mid, hi) if checked else (lo, mid, hi, check))]
        structure = _structure(traces[0])
        if all(_structure(t) == structure for t in traces[1:]):
            points = (lo, mid, hi)
            values = (_numbers(traces[0]), _numbers(traces[1]), _numbers(traces[2]))
            if checked or _matches(_interpolate(points, values, check), _numbers(traces[3])):
                layout = _Layout.of(traces[0])
                self._ranges.append((lo, hi, _Range(points, values, traces[0], layout)))
                self._decided.append(lengths)
                return
        half = len(lengths) // 2
        self._cover(lengths[: half + 1])
        self._cover(lengths[half:])

    def __call__(self, seq: int) -> StepTrace:
        """The step at ``seq``: traced, or interpolated within a decided range."""
        trace = self._traces.get(seq)
        if trace is None:
            found = next((r for lo, hi, r in self._ranges if lo <= seq <= hi), None)
            if found is None:
                raise PlanSettingError(
                    "seq_len", seq, "not a length of this grid; ask for one it was made with"
                )
            values = _interpolate(found.points, found.values, seq)
            return _rebuild(found.template, found.layout, seq, values, self._min_bytes, self._name)
        return _thresholded(trace, self._min_bytes, self._name)
