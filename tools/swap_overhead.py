"""Host time graphswap adds per swapped tensor: pack + unpack + release, nothing else.

On a GPU the saved-tensor hooks run on the host while kernels queue; every
microsecond they take is time the host cannot run ahead of the device. The model is
a stack of small ``Linear + ReLU`` blocks, each wrapped and every saved tensor
swapped (2 KiB each by default), so the copies cost next to nothing and the step-time
difference against the same model without swap is the bookkeeping. Beside graphswap
run, in the same rounds: ``bare_copy``, two bare saved-tensor hooks that copy each
tensor the runtime swaps to a fresh host tensor and back, in the fewest torch calls
and with no bookkeeping at all (no pool, no overlap, no checks): what graphswap adds
above it is its bookkeeping, and it is a floor for any swap that copies tensor by
tensor; PyTorch's ``save_on_cpu`` (on CPU, where it copies nothing, what saved-tensor
hooks cost by themselves); ``keep``, every block wrapped as for the swap but every
tensor kept on device: what a wrapped module's forward and backward cost whether or
not anything moves.

graphswap runs over each engine of the device (:data:`ENGINES`): on CPU the no-op
device (copies are plain ``copy_``, streams, events and waits cost a call: the
runtime's own host time, the figure judged) and the simulated device (its hazard
tracking on top); on an accelerator torch's own (``TorchDevice``). The modes take
turns in one process, since a machine's speed drifts: each runs a few steps in a row
per turn and only the last of them are timed, so every mode is measured in the state a
training run is in, one step after another of its own. The first step of a turn runs
after the other modes' steps, with the caches they left; it is reported apart, since
what it adds grows with how many other modes run (and how much code they run), not
with the mode itself.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from graphswap.runtime import (
    AcceleratorCopyEngine,
    CopyEngine,
    NoOpAccelerator,
    SwapManager,
    swap_wrapper,
    unwrap_swap,
)
from graphswap.runtime.policy import CheckpointPolicy, SwapPolicy, is_parameter_like
from graphswap.runtime.sim import SimulatedAccelerator

TARGET_US_PER_TENSOR = 20.0
"""graphswap's whole host time per swapped tensor, copies included."""
TARGET_BOOKKEEPING_US = 15.0
"""graphswap's host time per swapped tensor above ``bare_copy`` (invariant I15)."""
TARGET_CALLS_PER_TENSOR = 3.0
"""Accelerator calls per swapped tensor and direction, amortized over a block."""


def swap_every_tensor(t: torch.Tensor) -> CheckpointPolicy:
    """Policy: swap every saved tensor (the runtime still never swaps parameters)."""
    return CheckpointPolicy.MUST_SWAP


def keep_every_tensor(t: torch.Tensor) -> CheckpointPolicy:
    """Policy: keep every saved tensor on device (the wrapping alone)."""
    return CheckpointPolicy.MUST_SAVE


ENGINES: dict[str, dict[str, Callable[[], CopyEngine]]] = {
    "cpu": {"noop": NoOpAccelerator, "sim": SimulatedAccelerator},
    "cuda": {"torch": AcceleratorCopyEngine},
}
"""Per device type, the engines graphswap runs over, by mode name; the first is judged."""


@dataclass(frozen=True)
class OverheadConfig:
    blocks: int = 64
    """Wrapped ``Linear + ReLU`` blocks: two swapped tensors each."""
    width: int = 128
    """Features of each block's ``Linear``."""
    rows: int = 4
    """Rows of the input: with ``width``, the size of every swapped tensor."""
    steps: int = 150
    """Timed steps per mode, rounded up to whole turns."""
    warmup: int = 4
    """Untimed turns of every mode first: host buffers, events, allocator caches."""
    seed: int = 0
    """Seed of the blocks' weights and the input."""
    in_a_row: int = 5
    """Steps each mode runs per turn."""
    settle: int = 2
    """Of those, untimed first: a step after the other modes' runs cold, and the one
    after it not yet warm (measured: the third and later are within noise)."""

    def __post_init__(self) -> None:
        if not 0 <= self.settle < self.in_a_row:
            raise ValueError(
                f"settle must be in [0, in_a_row), got settle={self.settle},"
                f" in_a_row={self.in_a_row}"
            )

    @property
    def turns(self) -> int:
        """Turns of every mode, timed and untimed, that give ``steps`` timed steps each."""
        return self.warmup + math.ceil(self.steps / (self.in_a_row - self.settle))


def build_blocks(config: OverheadConfig, device: torch.device) -> torch.nn.Sequential:
    torch.manual_seed(config.seed)
    return torch.nn.Sequential(
        *(
            torch.nn.Sequential(torch.nn.Linear(config.width, config.width), torch.nn.ReLU())
            for _ in range(config.blocks)
        )
    ).to(device)


@contextmanager
def swapped(
    model: torch.nn.Sequential, manager: SwapManager, policy: SwapPolicy = swap_every_tensor
) -> Iterator[None]:
    """Every block wrapped and linked; no block kept on device (``keep_last=False``)."""
    blocks = list(model)
    for i, block in enumerate(blocks):
        swap_wrapper(block, manager=manager, policy=policy, name=f"block.{i}")
    for prev, nxt in itertools.pairwise(blocks):
        manager.link(prev, nxt)
    try:
        yield
    finally:
        for block in blocks:
            unwrap_swap(block)


class _Host:
    """A tensor copied to host by ``bare_copy``: the device to copy it back to."""

    __slots__ = ("device", "host")

    def __init__(self, device: torch.device, host: torch.Tensor) -> None:
        self.device = device
        self.host = host


def _bare_pack(t: torch.Tensor) -> torch.Tensor | _Host:
    if is_parameter_like(t):
        return t
    host = torch.empty(t.size(), dtype=t.dtype, pin_memory=t.is_cuda)
    host.copy_(t, non_blocking=True)
    return _Host(t.device, host)


def _bare_unpack(packed: torch.Tensor | _Host) -> torch.Tensor:
    if type(packed) is _Host:
        return packed.host.to(packed.device, non_blocking=True, copy=True)
    return packed


def bare_copy() -> torch.autograd.graph.saved_tensors_hooks:
    """Every tensor the runtime would swap copied out and back on the compute stream."""
    return torch.autograd.graph.saved_tensors_hooks(_bare_pack, _bare_unpack)


def _step(model: torch.nn.Module, x: torch.Tensor, device: torch.device) -> float:
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    model(x).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def count_calls(config: OverheadConfig) -> dict[str, Any]:
    """Accelerator calls of one warm step of the swapped model, counted by kind on the
    simulated device (the engine a GPU runs; torch's API counts nothing): per swapped
    tensor, what serves its offload, its reload, and the module boundaries."""
    model = build_blocks(config, torch.device("cpu"))
    engine = SimulatedAccelerator()
    manager = SwapManager(keep_last=False, engine=engine)
    x = torch.randn(config.rows, config.width)
    with swapped(model, manager):
        for _ in range(2):  # warm: host buffers and events exist
            model(x).sum().backward()
        before = engine.calls.copy()
        manager.reset_stats()
        model(x).sum().backward()
        stats = manager.stats
    calls = engine.calls - before
    tensors = stats.offloaded_tensors
    by_role: dict[str, int] = {}
    for (_, role), n in calls.items():
        by_role[role] = by_role.get(role, 0) + n
    return {
        "swapped_tensors": tensors,
        "by_kind": {f"{kind}/{role}": n for (kind, role), n in sorted(calls.items())},
        "per_swapped_tensor": {
            role: n / tensors if tensors else None for role, n in sorted(by_role.items())
        },
    }


def measure_overhead(
    config: OverheadConfig,
    device: torch.device,
    on_round: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any]:
    """Median step time of every mode, and what each adds per swapped tensor and per
    wrapped module; the median first step of a turn apart.

    ``on_round`` gets the result so far after every timed turn (to save it as it comes).
    """
    model = build_blocks(config, device)
    x = torch.randn(config.rows, config.width, device=device)
    engines = ENGINES[device.type]
    managers = {name: SwapManager(keep_last=False, engine=make()) for name, make in engines.items()}
    judged = next(iter(engines))
    keeper = SwapManager(keep_last=False, engine=engines[judged]())
    modes: dict[str, Callable[[], AbstractContextManager[Any]]] = {
        "none": nullcontext,
        "bare_copy": bare_copy,
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"),
        **{name: functools.partial(swapped, model, manager) for name, manager in managers.items()},
        "keep": lambda: swapped(model, keeper, keep_every_tensor),
    }
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    first: dict[str, list[float]] = {mode: [] for mode in modes}
    result: dict[str, Any] = {}
    calls = count_calls(config)
    stats: dict[str, Any] = {}
    for turn in range(config.turns):
        for mode, installed in modes.items():
            with installed():
                steps = [_step(model, x, device)]
                if mode in managers:
                    # One step's: wrapping starts each block's counters at zero, and
                    # unwrapping drops them.
                    stats[mode] = managers[mode].stats
                steps += [_step(model, x, device) for _ in range(config.in_a_row - 1)]
            if turn >= config.warmup:
                times[mode].extend(steps[config.settle :])
                first[mode].append(steps[0])
        if turn >= config.warmup:
            result = {**_result(config, times, first, stats, judged), "accelerator_calls": calls}
            on_round(result)
    return result


def _result(
    config: OverheadConfig,
    times: dict[str, list[float]],
    first: dict[str, list[float]],
    stats: dict[str, Any],
    judged: str,
) -> dict[str, Any]:
    medians = {mode: statistics.median(steps) for mode, steps in times.items()}
    first_medians = {mode: statistics.median(steps) for mode, steps in first.items()}
    tensors = stats[judged].offloaded_tensors

    def per_tensor(mode: str, base: str = "none") -> float | None:
        return (medians[mode] - medians[base]) / tensors * 1e6 if tensors else None

    def per_module(mode: str, base: str = "none") -> float:
        return (medians[mode] - medians[base]) / config.blocks * 1e6

    engines = list(stats)
    added = [mode for mode in medians if mode != "none"]
    return {
        "config": dataclasses.asdict(config),
        "engine": judged,
        "median_step_s": medians,
        "step_times_s": times,
        "median_first_step_s": first_medians,
        "per_step": {
            "offloaded_tensors": tensors,
            "offloaded_bytes": stats[judged].offloaded_bytes,
            "reloaded_tensors": stats[judged].reloaded_tensors,
            "reloaded_bytes": stats[judged].reloaded_bytes,
            "prefetch_misses": stats[judged].prefetch_misses,
            "wrapped_modules": config.blocks,
        },
        "us_per_swapped_tensor_by_mode": {mode: per_tensor(mode) for mode in added},
        "us_per_module_by_mode": {mode: per_module(mode) for mode in added},
        "bookkeeping_us_per_swapped_tensor_by_engine": {
            engine: per_tensor(engine, "bare_copy") for engine in engines
        },
        "bookkeeping_us_per_module_by_engine": {
            engine: per_module(engine, "bare_copy") for engine in engines
        },
        "us_per_swapped_tensor": per_tensor(judged),
        "bare_copy_us_per_swapped_tensor": per_tensor("bare_copy"),
        "save_on_cpu_us_per_swapped_tensor": per_tensor("save_on_cpu"),
        "bookkeeping_us_per_swapped_tensor": per_tensor(judged, "bare_copy"),
        "us_per_wrapped_forward": per_module("keep"),
        "us_per_swapped_tensor_beyond_wrapping": per_tensor(judged, "keep"),
        "target_us_per_swapped_tensor": TARGET_US_PER_TENSOR,
        "target_bookkeeping_us_per_swapped_tensor": TARGET_BOOKKEEPING_US,
    }


def overhead_table(result: dict[str, Any]) -> str:
    """The modes side by side: median step, and what each adds per swapped tensor and per
    wrapped module; graphswap's bookkeeping above ``bare_copy`` below them; the first
    step of a turn beside."""
    medians = result["median_step_s"]
    first = result["median_first_step_s"]
    per_tensor = result["us_per_swapped_tensor_by_mode"]
    per_module = result["us_per_module_by_mode"]
    step = result["per_step"]
    lines = [
        f"{step['offloaded_tensors']} swapped tensors and {step['wrapped_modules']} wrapped"
        " modules per step; us added to the step of `none`; the first step of a turn, after"
        " the other modes' steps, apart",
        "",
        "| mode | median step ms | us per swapped tensor | us per wrapped module"
        " | first step of a turn ms |",
        "|---|---|---|---|---|",
        f"| none | {medians['none'] * 1e3:.2f} | - | - | {first['none'] * 1e3:.2f} |",
    ]
    for mode, value in per_tensor.items():
        shown = "-" if value is None else f"{value:.1f}"
        lines.append(
            f"| {mode} | {medians[mode] * 1e3:.2f} | {shown} | {per_module[mode]:.1f}"
            f" | {first[mode] * 1e3:.2f} |"
        )
    for engine, value in result["bookkeeping_us_per_swapped_tensor_by_engine"].items():
        shown = "-" if value is None else f"{value:.1f}"
        module = result["bookkeeping_us_per_module_by_engine"][engine]
        lines.append(f"| {engine} above bare_copy | - | {shown} | {module:.1f} | - |")
    return "\n".join(lines)


def calls_line(result: dict[str, Any]) -> str:
    """Calls per swapped tensor and direction against ``TARGET_CALLS_PER_TENSOR``."""
    per = result["accelerator_calls"]["per_swapped_tensor"]
    offload, reload = per.get("offload"), per.get("reload")
    if offload is None or reload is None:
        return "TARGET accelerator_calls_per_swapped_tensor: missed (no tensor was swapped)"
    verdict = "met" if max(offload, reload) <= TARGET_CALLS_PER_TENSOR else "missed"
    kinds = ", ".join(f"{k} {n}" for k, n in result["accelerator_calls"]["by_kind"].items())
    return (
        f"TARGET accelerator_calls_per_swapped_tensor: {verdict} (offload {offload:.2f},"
        f" reload {reload:.2f}, capture queries {per.get('boundary', 0):.2f} per swapped"
        f" tensor; target <= {TARGET_CALLS_PER_TENSOR:g} per direction; one warm step on the"
        f" simulated device, {result['accelerator_calls']['swapped_tensors']} tensors: {kinds})"
    )


def bookkeeping_line(result: dict[str, Any]) -> str:
    """graphswap's host time above ``bare_copy`` against ``TARGET_BOOKKEEPING_US``."""
    value = result["bookkeeping_us_per_swapped_tensor"]
    engine = result["engine"]
    if value is None:
        return "TARGET host_bookkeeping_per_swapped_tensor: missed (no tensor was swapped)"
    verdict = "met" if value <= TARGET_BOOKKEEPING_US else "missed"
    others = ", ".join(
        f"{name} {other:.1f} us"
        for name, other in result["bookkeeping_us_per_swapped_tensor_by_engine"].items()
        if name != engine and other is not None
    )
    return (
        f"TARGET host_bookkeeping_per_swapped_tensor: {verdict} ({value:.1f} us per swapped"
        f" tensor above bare_copy over the {engine} engine, target <="
        f" {TARGET_BOOKKEEPING_US:g} us; bare_copy {result['bare_copy_us_per_swapped_tensor']:.1f}"
        f" us, save_on_cpu {result['save_on_cpu_us_per_swapped_tensor']:.1f} us per tensor;"
        f" wrapping {result['us_per_wrapped_forward']:.1f} us per module forward and backward"
        + (f"; above bare_copy over {others}" if others else "")
        + ")"
    )


def target_line(result: dict[str, Any]) -> str:
    """graphswap's whole host time per swapped tensor against ``TARGET_US_PER_TENSOR``."""
    value = result["us_per_swapped_tensor"]
    if value is None:
        return "TARGET host_overhead_per_swapped_tensor: missed (no tensor was swapped)"
    verdict = "met" if value <= TARGET_US_PER_TENSOR else "missed"
    steps = result["median_step_s"]
    engine = result["engine"]
    return (
        f"TARGET host_overhead_per_swapped_tensor: {verdict} ({value:.1f} us per swapped tensor"
        f" over the {engine} engine, target <= {TARGET_US_PER_TENSOR:g} us; step"
        f" {steps['none'] * 1e3:.2f} ms -> {steps[engine] * 1e3:.2f} ms,"
        f" {result['per_step']['offloaded_tensors']} tensors; wrapping alone"
        f" {result['us_per_wrapped_forward']:.1f} us per block forward and backward, then"
        f" {result['us_per_swapped_tensor_beyond_wrapping']:.1f} us per swapped tensor)"
    )
