"""The training loop behind ``graphswap train``: synthetic or local-text tokens, AdamW,
and a summary of what the swap bought (memory) and cost (time)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
from tqdm import tqdm

from graphswap.hf.checkpoints import decoder_layers
from graphswap.passes import PassPlan
from graphswap.passes.pass_plan import pass_plan_of
from graphswap.planning.measure import ResidentActivationTracker, output_tensors
from graphswap.runtime.profile import simulated_profile
from graphswap.runtime.sim import SimulatedAccelerator
from graphswap.runtime.timeline import OPTIMIZER_LABEL, StepTimeline
from graphswap.train.build import BuiltModel, build
from graphswap.train.config import ConfigError, TrainerConfig
from graphswap.train.preflight import check_data, check_inputs, resolve_device

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class TrainResult:
    """What one run measured; ``to_dict`` is what lands in ``summary.json``."""

    activation_swap: str
    attn_implementation: str
    device: str
    world_size: int
    losses: list[float]
    step_seconds: list[float]
    tokens_per_second: float
    peak_memory_bytes: int
    peak_memory_kind: str
    resident_activation_bytes: int
    """Saved activations on the device at the end of the first forward (measured by
    ``graphswap.planning.measure``, independent of the swap's own statistics)."""
    swap: dict[str, Any] = field(default_factory=dict)
    applied_passes: list[str] = field(default_factory=list)
    auto_swap: dict[str, Any] | None = None
    """``activation_swap: auto``: the plan (per layer what is swapped, copy against
    overlap time) and how many planned tensors the model saved otherwise."""
    clock: dict[str, Any] | None = None
    """``device: sim:<profile>``: the last step on the clocked simulated accelerator
    (``StepTimeline.to_dict()``: step time, stalls per layer and phase, copy streams
    busy, peak device memory and where it falls) and ``profile``."""
    clock_step_seconds: list[float] = field(default_factory=list)
    """``device: sim:<profile>``: every step's time on the simulated accelerator."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def token_batches(
    config: TrainerConfig, vocab_size: int, device: torch.device | str, dp_rank: int = 0
) -> Iterator[torch.Tensor]:
    """Seeded batches: random tokens, or byte-level windows of a local text file.

    ``dp_rank`` is the data-parallel rank: the ranks of one model replica (its
    tensor-parallel shards) pass the same one and so see the same tokens.
    """
    gen = torch.Generator().manual_seed(config.seed + 1 + dp_rank)
    shape = (config.batch_size, config.seq_len)
    if config.data is None:
        while True:
            yield torch.randint(0, vocab_size, shape, generator=gen).to(device)
    check_data(config)
    raw = torch.frombuffer(bytearray(Path(config.data).read_bytes()), dtype=torch.uint8)
    tokens = raw.long() % vocab_size
    while True:
        starts = torch.randint(
            0, tokens.numel() - config.seq_len, (config.batch_size,), generator=gen
        )
        yield torch.stack([tokens[s : s + config.seq_len] for s in starts]).to(device)


def data_parallel_rank(mesh: DeviceMesh | None) -> tuple[int, int]:
    """``(rank, size)`` of this process in the mesh's ``dp_shard`` dimension; ``(0, 1)``
    when there is none (one process, or tensor parallel only: one replica)."""
    if mesh is None or "dp_shard" not in (mesh.mesh_dim_names or ()):
        return 0, 1
    dp_mesh = mesh["dp_shard"]
    return dp_mesh.get_local_rank(), dp_mesh.size()


def _world_size() -> int:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size()


def _measured_forward(
    built: BuiltModel, ids: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, int]:
    """Forward once under the resident-activation tracker."""
    tracker = ResidentActivationTracker(device)
    with tracker.track():
        output = built.model(input_ids=ids, labels=ids, use_cache=False)
    if built.swap_manager is not None:
        built.swap_manager.synchronize()
    return output.loss, tracker.resident_bytes(exclude=output_tensors(output))


class _Run:
    """One config's model, optimizer and batches, advanced one step at a time."""

    def __init__(
        self,
        config: TrainerConfig,
        pass_plan: PassPlan,
        device: torch.device,
        mesh: Any,
        world_size: int,
    ) -> None:
        self.config = config
        self.device = device
        self.world_size = world_size
        torch.manual_seed(config.seed)
        self.built = build(config, device=device, mesh=mesh, pass_plan=pass_plan)
        self.built.model.train()
        self.optimizer = torch.optim.AdamW(self.built.model.parameters(), lr=config.lr)
        dp_rank, self.dp_size = data_parallel_rank(self.built.infrastructure.mesh)
        vocab_size = self.built.model.config.vocab_size
        self.batches = token_batches(config, vocab_size, device, dp_rank=dp_rank)
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self.resident = 0
        self.peak_rise = 0
        self.sim = _simulated_accelerator(config, self.built)
        self.timelines: list[StepTimeline] = []

    def step(self) -> None:
        model = self.built.model
        ids = next(self.batches)
        self._synchronize()
        if self.device.type == "cuda":
            # Side-by-side runs share the device: measure this step's own rise.
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        start = time.perf_counter()
        with self._clocked() as clock:
            if not self.losses:
                loss, self.resident = _measured_forward(self.built, ids, self.device)
            else:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            if clock is not None:
                clock.label(OPTIMIZER_LABEL)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._synchronize()
        self.seconds.append(time.perf_counter() - start)
        if clock is not None:
            self.timelines.append(clock.timeline)
        if self.built.plan_executor is not None:
            self.built.plan_executor.check()
        if self.device.type == "cuda":
            rise = torch.cuda.max_memory_allocated(self.device) - before
            self.peak_rise = max(self.peak_rise, rise)
        value = loss.detach()
        if self.world_size > 1:
            # The ranks of one replica hold the same loss, so the world mean is the
            # mean over replicas.
            torch.distributed.all_reduce(value)
            value = value / self.world_size
        self.losses.append(value.item())

    def _clocked(self) -> contextlib.AbstractContextManager[Any]:
        """On a simulated accelerator, the step on its clock; elsewhere nothing."""
        if self.sim is None:
            return contextlib.nullcontext()
        _, layers = decoder_layers(self.built.model)
        return self.sim.clock(layers, base_bytes=state_bytes(self.built.model, self.optimizer))

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def result(self) -> TrainResult:
        config = self.config
        timed = self.seconds[1:] or self.seconds
        tokens = config.batch_size * config.seq_len * self.dp_size
        if self.timelines:
            peak = self.timelines[-1].peak_bytes
            kind = f"device memory at the step's peak on {config.device} (predicted)"
        elif self.device.type == "cuda":
            peak = self.peak_rise
            kind = "cuda max_memory_allocated during a step, above its start"
        else:
            peak, kind = self.resident, "saved activations resident at end of forward (measured)"
        manager = self.built.swap_manager
        auto = self.built.plan_executor
        return TrainResult(
            activation_swap=config.activation_swap,
            attn_implementation=config.attn_implementation,
            device=str(self.device),
            world_size=self.world_size,
            losses=self.losses,
            step_seconds=self.seconds,
            tokens_per_second=tokens / statistics.median(timed),
            peak_memory_bytes=peak,
            peak_memory_kind=kind,
            resident_activation_bytes=self.resident,
            swap=manager.stats.to_dict() if manager is not None else {},
            applied_passes=list(self.built.infrastructure.applied),
            auto_swap=auto.to_dict() if auto is not None else None,
            clock=self._clock_summary(),
            clock_step_seconds=[timeline.step_seconds for timeline in self.timelines],
        )

    def _clock_summary(self) -> dict[str, Any] | None:
        if not self.timelines:
            return None
        assert self.sim is not None
        return {"profile": self.sim.profile.name, **self.timelines[-1].to_dict()}


def _simulated_accelerator(config: TrainerConfig, built: BuiltModel) -> SimulatedAccelerator | None:
    """``device: sim:<profile>``: the swap's own engine (its copies are on the clock), or
    one of the same profile for a run without swap."""
    profile = simulated_profile(config.device)
    if profile is None:
        return None
    manager = built.swap_manager
    engine = manager.engine if manager is not None else None
    if isinstance(engine, SimulatedAccelerator):
        return engine
    return SimulatedAccelerator(profile=profile)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Device bytes a step starts with: parameters, buffers, gradients, optimizer state.

    Not the optimizer's step counters, which torch keeps on the host unless the group is
    ``capturable`` or ``fused``: on the simulated device every tensor is on the CPU, and
    counting them put a clocked peak above the plan's (4 bytes a parameter), so above a
    budget set to it."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [
        t
        for group in optimizer.param_groups
        for p in group["params"]
        for key, t in optimizer.state.get(p, {}).items()
        if key != "step" or group.get("capturable") or group.get("fused")
    ]
    storages = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
        for t in tensors
        if isinstance(t, torch.Tensor)
    }
    return sum(storages.values())


def train(
    config: TrainerConfig, *, mesh: Any = None, progress: bool = True, out: TextIO = sys.stderr
) -> TrainResult:
    """Build the model through the pass plan and train ``config.steps`` steps."""
    return train_side_by_side([config], mesh=mesh, progress=progress, out=out)[0]


def train_side_by_side(
    configs: Sequence[TrainerConfig],
    *,
    mesh: Any = None,
    progress: bool = True,
    out: TextIO = sys.stderr,
    pass_plans: Sequence[PassPlan] | None = None,
) -> list[TrainResult]:
    """Train every config from the same seed, interleaved step by step (in alternating
    order): each sees the same warm-up, machine noise and allocator state, so their
    step times compare.

    Every input is checked (``graphswap.train.preflight``) before the first model is built.
    ``pass_plans``: per config, its pass plan when the caller built it already; each
    config's pass plan is built once and serves its checks and its build.
    """
    if not configs:
        raise ConfigError("configs", "train_side_by_side needs at least one config; pass one")
    steps = {config.steps for config in configs}
    if len(steps) > 1:
        raise ConfigError(
            "steps", f"configs trained side by side need equal steps, got {sorted(steps)}"
        )
    world_size = _world_size()
    given: Sequence[PassPlan | None] = [None] * len(configs) if pass_plans is None else pass_plans
    planned = [pass_plan_of(config, p) for config, p in zip(configs, given, strict=True)]
    for config, checked in zip(configs, planned, strict=True):
        check_inputs(config, world_size=world_size, pass_plan=checked)
    device = resolve_device(configs[0])
    runs = [
        _Run(config, checked, device, mesh, world_size)
        for config, checked in zip(configs, planned, strict=True)
    ]
    rank = torch.distributed.get_rank() if world_size > 1 else 0
    modes = "/".join(config.activation_swap for config in configs)
    bar = tqdm(
        range(configs[0].steps),
        desc=f"train [{modes}]",
        file=out,
        disable=not progress or rank != 0,
    )
    for step in bar:
        # Each run goes first on every other step: the one that runs second finds
        # caches and threads warmed by the first, which would bias the step times.
        for run in runs if step % 2 == 0 else runs[::-1]:
            run.step()
        bar.set_postfix(loss="/".join(f"{run.losses[-1]:.4f}" for run in runs))
    return [run.result() for run in runs]


def write_summary(results: list[TrainResult], output_dir: str) -> Path:
    path = Path(output_dir)
    path.mkdir(parents=True, exist_ok=True)
    target = path / "summary.json"
    target.write_text(json.dumps([r.to_dict() for r in results], indent=2, sort_keys=True) + "\n")
    return target


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _per_step(result: TrainResult, key: str) -> str:
    return _mib(result.swap.get(key, 0) // len(result.losses))


def _planned(result: TrainResult) -> str:
    return "-" if result.auto_swap is None else _mib(result.auto_swap["swapped_bytes"])


def _step_ratio(base: TrainResult, result: TrainResult) -> float:
    """Median over steps of this run's step time over the base run's same step: runs
    trained side by side take their steps in turn, so each pair shares the machine's
    state of that moment and load drift cancels. The first (warm-up) step is left out."""
    pairs = list(zip(result.step_seconds, base.step_seconds, strict=True))
    timed = pairs[1:] or pairs
    return statistics.median(mine / theirs for mine, theirs in timed)


def _swapped_share(base: TrainResult, result: TrainResult) -> str:
    """The share of all saved activation bytes that the swap took off the device: the
    tracker's resident bytes against those of the run without swap (``-`` without one)."""
    if base.activation_swap != "none" or not base.resident_activation_bytes:
        return "-"
    moved = base.resident_activation_bytes - result.resident_activation_bytes
    return f"{moved / base.resident_activation_bytes:.1%}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _stalls(clock: dict[str, Any], phase: str) -> float:
    return sum(s for label, s in clock["stalls"].items() if label.startswith(phase))


def _clock_rows(base: TrainResult, results: list[TrainResult]) -> list[tuple[str, list[str]]]:
    """The simulated accelerator's figures of the last step: time, stalls, peak."""
    clocks = [r.clock for r in results if r.clock is not None]
    base_seconds = base.clock["step_seconds"] if base.clock is not None else 0.0
    return [
        (f"sim step time ({clocks[0]['profile']})", [_ms(c["step_seconds"]) for c in clocks]),
        ("sim compute busy", [_ms(c["compute_seconds"]) for c in clocks]),
        (
            "sim stalls forward/backward",
            [f"{_ms(_stalls(c, 'F'))} / {_ms(_stalls(c, 'B'))}" for c in clocks],
        ),
        ("sim step ratio", [f"{c['step_seconds'] / base_seconds:.3f}" for c in clocks]),
        ("sim peak memory", [f"{_mib(c['peak_bytes'])} at {c['peak_label']}" for c in clocks]),
    ]


def format_summary(results: list[TrainResult]) -> str:
    """One column per run, side by side; ratios against the first run."""
    base = results[0]
    planned = [r.activation_swap for r in results if r.auto_swap is not None]
    rows: list[tuple[str, list[str]]] = [
        ("activation_swap", [r.activation_swap for r in results]),
        ("attn_implementation", [r.attn_implementation for r in results]),
        ("device / world", [f"{r.device} / {r.world_size}" for r in results]),
        ("loss first", [f"{r.losses[0]:.6f}" for r in results]),
        ("loss last", [f"{r.losses[-1]:.6f}" for r in results]),
        ("tokens/s", [f"{r.tokens_per_second:,.0f}" for r in results]),
        ("step time ratio", [f"{_step_ratio(base, r):.3f}" for r in results]),
        ("peak memory *", [_mib(r.peak_memory_bytes) for r in results]),
        ("saved activations swapped **", [_swapped_share(base, r) for r in results]),
        ("swap offloaded / step", [_per_step(r, "offloaded_bytes") for r in results]),
        ("swap reloaded / step", [_per_step(r, "reloaded_bytes") for r in results]),
        ("swap kept on device / step", [_per_step(r, "kept_bytes") for r in results]),
        (
            "swap copied, not freed / step",
            [_per_step(r, "offloaded_not_freed_bytes") for r in results],
        ),
        *(
            [(f"{'/'.join(planned)} plan / step", [_planned(r) for r in results])]
            if planned
            else []
        ),
        (
            "prefetch hits/misses (all steps)",
            [
                f"{r.swap.get('prefetch_hits', 0)}/{r.swap.get('prefetch_misses', 0)}"
                for r in results
            ],
        ),
        (
            "host pool peak / budget",
            [
                f"{_mib(r.swap.get('peak_host_bytes', 0))} / {_mib(r.swap['max_host_bytes'])}"
                if r.swap
                else "-"
                for r in results
            ],
        ),
        *(_clock_rows(base, results) if all(r.clock is not None for r in results) else []),
        ("passes", [" -> ".join(r.applied_passes) or "-" for r in results]),
    ]
    width = max(len(name) for name, _ in rows)
    cols = [max(len(row[1][i]) for row in rows) for i in range(len(results))]
    lines = [
        f"{name:<{width}}  " + "  ".join(f"{v:>{cols[i]}}" for i, v in enumerate(values))
        for name, values in rows
    ]
    notes = [
        f"* {base.peak_memory_kind}",
        "** share of the saved activation bytes of one step moved off the device"
        " (measured against activation_swap: none)",
    ]
    return "\n".join([*lines, *notes])
