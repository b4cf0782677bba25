"""The training loop behind ``graphswap train``: synthetic or local-text tokens, AdamW,
and a summary of what the swap bought (memory) and cost (time)."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from graphswap.config import TrainerConfig
from graphswap.measure import ResidentActivationTracker, output_tensors
from graphswap.models import BuiltModel, build


@dataclass
class TrainResult:
    """What one run measured; ``to_dict`` is what lands in ``summary.json``."""

    activation_swap: str
    device: str
    world_size: int
    losses: list[float]
    step_seconds: list[float]
    tokens_per_second: float
    peak_memory_bytes: int
    peak_memory_kind: str
    swap: dict[str, Any] = field(default_factory=dict)
    applied_passes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def resolve_device(config: TrainerConfig) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device: cuda was asked for but no CUDA device is visible")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def token_batches(
    config: TrainerConfig, vocab_size: int, device: torch.device, rank: int = 0
) -> Iterator[torch.Tensor]:
    """Seeded batches: random tokens, or byte-level windows of a local text file."""
    gen = torch.Generator().manual_seed(config.seed + 1 + rank)
    shape = (config.batch_size, config.seq_len)
    if config.data is None:
        while True:
            yield torch.randint(0, vocab_size, shape, generator=gen).to(device)
    data_path = Path(config.data)
    if not data_path.is_file():
        raise FileNotFoundError(f"data: no file at {config.data!r}; give a local text file")
    raw = torch.frombuffer(bytearray(data_path.read_bytes()), dtype=torch.uint8)
    if raw.numel() <= config.seq_len:
        raise ValueError(
            f"data: {config.data!r} has {raw.numel()} bytes;"
            f" need more than seq_len={config.seq_len}"
        )
    tokens = raw.long() % vocab_size
    while True:
        starts = torch.randint(
            0, tokens.numel() - config.seq_len, (config.batch_size,), generator=gen
        )
        yield torch.stack([tokens[s : s + config.seq_len] for s in starts]).to(device)


def _distributed() -> tuple[int, int]:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _measured_forward(
    built: BuiltModel, ids: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, int]:
    """Forward once under the resident-activation tracker (the CPU memory figure)."""
    tracker = ResidentActivationTracker(device)
    with tracker.track():
        output = built.model(input_ids=ids, labels=ids, use_cache=False)
    if built.swap_manager is not None:
        built.swap_manager.synchronize()
    return output.loss, tracker.resident_bytes(exclude=output_tensors(output))


def train(
    config: TrainerConfig, *, mesh: Any = None, progress: bool = True, out: TextIO = sys.stderr
) -> TrainResult:
    """Build the model through the pass plan and train ``config.steps`` steps."""
    from tqdm import tqdm

    device = resolve_device(config)
    rank, world_size = _distributed()
    torch.manual_seed(config.seed)
    built = build(config, device=device, mesh=mesh)
    model = built.model
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    batches = token_batches(
        config, model.config.vocab_size, device, rank=rank if config.fsdp else 0
    )

    losses: list[float] = []
    seconds: list[float] = []
    resident = 0
    bar = tqdm(
        range(config.steps),
        desc=f"train [{config.activation_swap}]",
        file=out,
        disable=not progress or rank != 0,
    )
    for step in bar:
        ids = next(batches)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if step == 0 and device.type == "cpu":
            loss, resident = _measured_forward(built, ids, device)
        else:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
        value = loss.detach()
        if world_size > 1 and config.fsdp:
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.AVG)
        losses.append(value.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")

    timed = seconds[1:] or seconds
    tokens = config.batch_size * config.seq_len * (world_size if config.fsdp else 1)
    if device.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    else:
        peak, kind = resident, "saved activations resident at end of forward (measured)"
    manager = built.swap_manager
    return TrainResult(
        activation_swap=config.activation_swap,
        device=str(device),
        world_size=world_size,
        losses=losses,
        step_seconds=seconds,
        tokens_per_second=tokens / statistics.median(timed),
        peak_memory_bytes=peak,
        peak_memory_kind=kind,
        swap=manager.stats.to_dict() if manager is not None else {},
        applied_passes=list(built.infrastructure.applied),
    )


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


def format_summary(results: list[TrainResult]) -> str:
    """One column per run, side by side; ratios against the first run."""
    base = results[0]
    rows: list[tuple[str, list[str]]] = [
        ("activation_swap", [r.activation_swap for r in results]),
        ("device / world", [f"{r.device} / {r.world_size}" for r in results]),
        ("loss first", [f"{r.losses[0]:.6f}" for r in results]),
        ("loss last", [f"{r.losses[-1]:.6f}" for r in results]),
        ("tokens/s", [f"{r.tokens_per_second:,.0f}" for r in results]),
        (
            "step time ratio",
            [f"{base.tokens_per_second / r.tokens_per_second:.3f}" for r in results],
        ),
        ("peak memory *", [_mib(r.peak_memory_bytes) for r in results]),
        ("swap offloaded / step", [_per_step(r, "offloaded_bytes") for r in results]),
        ("swap reloaded / step", [_per_step(r, "reloaded_bytes") for r in results]),
        ("swap kept on device / step", [_per_step(r, "kept_bytes") for r in results]),
        (
            "prefetch hits/misses (all steps)",
            [
                f"{r.swap.get('prefetch_hits', 0)}/{r.swap.get('prefetch_misses', 0)}"
                for r in results
            ],
        ),
        ("host pool peak", [_mib(r.swap.get("peak_host_bytes", 0)) for r in results]),
        ("passes", [" -> ".join(r.applied_passes) or "-" for r in results]),
    ]
    width = max(len(name) for name, _ in rows)
    cols = [max(len(row[1][i]) for row in rows) for i in range(len(results))]
    lines = [
        f"{name:<{width}}  " + "  ".join(f"{v:>{cols[i]}}" for i, v in enumerate(values))
        for name, values in rows
    ]
    return "\n".join([*lines, f"* {base.peak_memory_kind}"])
