"""A two-process gloo world on CPU: swap composed with tensor parallel, with FSDP2, and
with both on another family, trains like one process; so do the chunked loss head under
both, and the budget mode, keeping, swapping and recomputing, under tensor parallel and
under FSDP2.

Tolerances: the distributed runs reduce partial sums across ranks (the row-parallel
o_proj all-reduce, FSDP's gradient reduce-scatter, the loss average), which changes
the order of fp32 additions. That costs a few ulps per reduction: measured ~1e-7
relative on the losses, ~1e-9 absolute on the parameters. Losses are compared at
rtol 1e-5; since a wrong gradient on a small set of weights barely moves the loss
(an unsummed q_norm gradient under tensor parallel shifts it by ~2e-6 relative), every
parameter after the last step is compared too, at atol 1e-6, where that bug is ~1e-4.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from graphswap.train.config import TrainerConfig

WORLD = 2
STEPS = 2
"""Two: the second step runs on weights the first updated through the sharded optimizer
state, where a wrong gradient or a stale swapped tensor would show."""
BATCH = 2
SEQ = 256
"""Long enough that each layer's eager attention probabilities (>= 1 MiB per rank)
pass the swap policy's size threshold, so the swap really moves tensors."""
BUDGET_SEQ = 2048
"""The budget mode's: long enough that what it plans to swap passes the size threshold."""
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-6


def batches(vocab_size: int, seq: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab_size, (BATCH, seq), generator=gen) for _ in range(STEPS)]


def build(preset: str, attn: str) -> nn.Module:
    from graphswap.hf.checkpoints import build_model
    from graphswap.hf.presets import preset_config

    torch.manual_seed(0)
    return build_model(preset_config(preset, attn_implementation=attn, use_cache=False))


def train(model: nn.Module, rows: slice, world: int, seq: int) -> list[float]:
    """Plain SGD; the reported loss is averaged over ranks, as the trainer reports it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for ids in batches(model.config.vocab_size, seq):
        ids = ids[rows]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reported = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reported)
            reported /= world
        losses.append(reported.item())
    return losses


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copies of all parameters (a collective when they are DTensors)."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


@dataclass(frozen=True)
class Composition:
    """A model and the passes applied to it."""

    preset: str
    config: TrainerConfig
    applied: tuple[str, ...]
    seq: int = SEQ
    attn: str = "eager"
    recompute: tuple[str, ...] = ()
    """``budget``: the level whose peak (swapping what hides) is the budget, so that the
    plan keeps (the last layer's saves), swaps and recomputes."""


COMPOSITIONS = {
    "swap+tp": Composition(
        "tiny", TrainerConfig(activation_swap="attention", tp_size=2), ("swap", "tensor_parallel")
    ),
    "swap+fsdp": Composition(
        "tiny", TrainerConfig(activation_swap="attention", fsdp=True), ("swap", "fsdp")
    ),
    # Mixtral's heads shard without per-head norms (Qwen3-MoE's above have them), and its
    # experts are another module layout; FSDP over the one replica the two ranks form.
    "mixtral:swap+tp+fsdp": Composition(
        "tiny-mixtral",
        TrainerConfig(activation_swap="attention", tp_size=2, fsdp=True),
        ("swap", "tensor_parallel", "fsdp"),
    ),
    # The chunked loss head under both: tensor parallelism leaves lm_head whole, FSDP2's
    # root gathers it for the root's forward (where the head reads it) and reduce-scatters
    # the gradient the head returns; against the full head of one process, within the
    # tolerances (the head changes the order of two sums, ~4e-7 relative).
    "chunked:swap+tp+fsdp": Composition(
        "tiny",
        TrainerConfig(
            activation_swap="attention",
            tp_size=2,
            fsdp=True,
            loss_head="chunked",
            loss_head_chunk_size=96,
        ),
        ("swap", "tensor_parallel", "fsdp"),
    ),
    # The budget mode plans on each rank for its share: the heads and experts tensor
    # parallel leaves it, or the state FSDP shards over the two ranks (one row each).
    # Under FSDP the whole layer is recomputed inside its swap, so the recompute runs
    # where FSDP has gathered the layer's parameters for its backward.
    "budget+tp": Composition(
        "tiny",
        TrainerConfig(
            activation_swap="budget",
            activation_memory_budget=1,
            tp_size=2,
            seq_len=BUDGET_SEQ,
            batch_size=BATCH,
        ),
        ("swap", "tensor_parallel"),
        BUDGET_SEQ,
        "sdpa",
        ("norms", "mlp_memory_bound"),
    ),
    "budget+fsdp": Composition(
        "tiny",
        TrainerConfig(
            activation_swap="budget",
            activation_memory_budget=1,
            fsdp=True,
            seq_len=BUDGET_SEQ,
            batch_size=BATCH // WORLD,
        ),
        ("swap", "fsdp"),
        BUDGET_SEQ,
        "sdpa",
        ("layer",),
    ),
}
"""What one world trains, one composition after the other, each on a fresh model."""


def _level_budget(model: nn.Module, composition: Composition, state_shards: int) -> int:
    """The peak of the composition's recompute level swapping what hides, as the swap pass
    plans it on this rank (a budget of one byte is refused, listing every option)."""
    from graphswap.passes.errors import PassSettingError
    from graphswap.passes.swap import plan_swap

    with pytest.raises(PassSettingError) as refused:
        plan_swap(model, composition.config, state_shards=state_shards)
    options = refused.value.__cause__.options  # type: ignore[union-attr]
    level = (composition.recompute, "auto")
    return next(o.peak_bytes for o in options if (o.recompute, o.swap) == level)


def _worker(rank: int, init_method: str, queue: Any, out: Path) -> None:
    from graphswap import passes

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    try:
        for name, composition in COMPOSITIONS.items():
            config = composition.config
            model = build(composition.preset, composition.attn)
            if config.activation_swap == "budget":
                shards = WORLD // config.tp_size if config.fsdp else 1
                budget = _level_budget(model, composition, shards)
                config = dataclasses.replace(config, activation_memory_budget=budget)
            result = passes.apply_model_infrastructure(model, config)
            assert result.report is not None
            # The ranks of one replica (its tensor-parallel shards) read the same rows.
            replicas = WORLD // config.tp_size if config.fsdp else 1
            per_replica = BATCH // replicas
            replica = rank // config.tp_size
            rows = slice(replica * per_replica, (replica + 1) * per_replica)
            losses = train(model, rows, WORLD, composition.seq)
            params = full_parameters(model)
            if rank == 0:
                torch.save(params, out / f"{name}.pt")
            stats = result.report.manager.stats
            planned = result.plan_executor.plan if result.plan_executor is not None else None
            queue.put(
                (
                    name,
                    rank,
                    result.applied,
                    losses,
                    stats.offloaded_bytes,
                    stats.reloaded_bytes,
                    stats.recomputed_bytes,
                    (planned.recompute, planned.state_shards) if planned is not None else None,
                    result.loss_head_chunk_size,
                )
            )
    finally:
        dist.destroy_process_group()


World = dict[str, tuple[list[tuple[Any, ...]], dict[str, torch.Tensor]]]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    """One two-process world that trains every composition: per composition, the
    per-rank results sorted by rank and rank 0's final parameters. (One world rather
    than one per composition: starting a rank costs more than its training.)"""
    tmp_path = tmp_path_factory.mktemp("world")
    queue = mp.get_context("spawn").SimpleQueue()
    init_method = f"file://{tmp_path / 'rendezvous'}"
    workers = mp.start_processes(
        _worker, args=(init_method, queue, tmp_path), nprocs=WORLD, join=False, start_method="spawn"
    )
    while not workers.join():
        pass
    results: dict[str, list[tuple[Any, ...]]] = {name: [] for name in COMPOSITIONS}
    for _ in range(WORLD * len(COMPOSITIONS)):
        name, *result = queue.get()
        results[name].append(tuple(result))
    return {
        name: (sorted(results[name]), torch.load(tmp_path / f"{name}.pt")) for name in COMPOSITIONS
    }


@pytest.fixture(scope="module")
def reference() -> Callable[[Composition], tuple[list[float], dict[str, torch.Tensor]]]:
    """``reference(composition)``: one process, no swap, no sharding: what every
    composition of that model, length and attention must reproduce (computed once each)."""

    @functools.cache
    def train_once(preset: str, seq: int, attn: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = build(preset, attn)
        losses = train(model, slice(None), world=1, seq=seq)
        return losses, full_parameters(model)

    return lambda composition: train_once(composition.preset, composition.seq, composition.attn)


@pytest.mark.distributed
@pytest.mark.parametrize("composition", list(COMPOSITIONS))
def test_two_ranks_train_like_one(
    composition: str,
    world: World,
    reference: Callable[[Composition], tuple[list[float], dict[str, torch.Tensor]]],
) -> None:
    ran_as = COMPOSITIONS[composition]
    reference_losses, reference_params = reference(ran_as)
    results, params = world[composition]
    assert [rank for rank, *_ in results] == [0, 1]
    for _, ran, losses, offloaded, reloaded, recomputed, planned, chunk in results:
        assert ran == ran_as.applied
        chunked = ran_as.config.loss_head == "chunked"
        assert chunk == (ran_as.config.loss_head_chunk_size if chunked else None)
        assert offloaded > 0 and reloaded == offloaded, "the swap moved nothing"
        if ran_as.config.activation_swap == "budget":
            shards = WORLD // ran_as.config.tp_size if ran_as.config.fsdp else 1
            assert planned == (ran_as.recompute, shards)
            assert recomputed > 0, "the budget plan recomputed nothing"
        assert losses == pytest.approx(reference_losses, rel=LOSS_RTOL)
    assert params.keys() == reference_params.keys()
    for name, expected in reference_params.items():
        torch.testing.assert_close(
            params[name], expected, rtol=0, atol=PARAM_ATOL, msg=lambda m, name=name: f"{name}: {m}"
        )
