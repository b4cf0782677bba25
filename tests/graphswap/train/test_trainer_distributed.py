"""``graphswap train`` under torchrun on a gloo CPU world: every rank of one replica
sees the same tokens, and replicas see different ones, chosen by data-parallel rank.

The world is a real ``torchrun`` of the console command, as a user starts it; the
passes' own compositions (and another family's) train in ``tests/passes``. The
reference runs in this process. The reported loss of a world is the mean over ranks;
tensor parallel's all-reduce changes the order of fp32 additions, which costs a few
ulps (~1e-7 relative), hence rtol 1e-5. The two replicas' losses differ by ~1e-3
relative, so a rank that read another replica's tokens fails by 100 times the tolerance.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from graphswap.train.build import build
from graphswap.train.config import TrainerConfig
from graphswap.train.trainer import token_batches

pytestmark = pytest.mark.distributed

SETTINGS = {
    "num_layers": 2,
    "seq_len": 256,
    "batch_size": 2,
    "activation_swap": "attention",
    "attn_implementation": "eager",
}
"""Eager attention at 256 tokens: each layer's attention probabilities pass the swap
policy's threshold even with the heads split over two ranks, so the swap moves tensors."""
LOSS_RTOL = 1e-5


def torchrun(
    nproc: int, overrides: dict[str, Any], tmp_path: Path, *options: str
) -> list[dict[str, Any]]:
    """``torchrun --nproc-per-node N -m graphswap.train.cli train``; returns summary.json."""
    done = launch(nproc, overrides, tmp_path, *options)
    assert done.returncode == 0, done.stderr + "".join(rank_stderr(tmp_path))
    return json.loads((tmp_path / "out" / "summary.json").read_text())


def launch(
    nproc: int, overrides: dict[str, Any], tmp_path: Path, *options: str
) -> subprocess.CompletedProcess[str]:
    """The ranks' own output goes to ``tmp_path/logs/**/rank/std{out,err}.log``."""
    settings = {**SETTINGS, **overrides, "output_dir": str(tmp_path / "out")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--log-dir={tmp_path / 'logs'}",
            "--redirects=3",
            "-m",
            "graphswap.train.cli",
            "train",
            "--no-progress",
            *options,
            *(f"{key}={value}" for key, value in settings.items()),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=tmp_path,
    )


def rank_stderr(tmp_path: Path) -> list[str]:
    """What each rank wrote to stderr, by rank."""
    logs = sorted((tmp_path / "logs").glob("**/stderr.log"), key=lambda p: int(p.parent.name))
    return [log.read_text() for log in logs]


def replica_first_loss(config: TrainerConfig, dp_rank: int) -> float:
    """The first-step loss of one process that reads data-parallel rank ``dp_rank``'s batch."""
    torch.manual_seed(config.seed)
    model = build(config).model
    ids = next(token_batches(config, model.config.vocab_size, "cpu", dp_rank=dp_rank))
    return model(input_ids=ids, labels=ids, use_cache=False).loss.item()


def test_tp2_by_dp_shard2_loss_is_the_mean_of_the_replicas_and_swap_moves_the_plan(
    tmp_path: Path,
) -> None:
    """Qwen3-MoE on four ranks, ``--compare``: the world without swap and with it, side
    by side. sdpa at 1024 tokens: the projections save DTensors (their local shards pass
    the threshold), swapped through their shards and rebuilt with the same placements;
    each rank moves what the plan predicts for one tensor-parallel shard."""
    from graphswap.planning import plan_memory
    from graphswap.planning.trace import StepShape
    from graphswap.train.build import trainer_hf_config

    settings = {"seq_len": 1024, "attn_implementation": "sdpa", "steps": 1}
    plain, swapped = torchrun(4, {**settings, "tp_size": 2, "fsdp": "true"}, tmp_path, "--compare")
    single = TrainerConfig(**{**SETTINGS, **settings})
    replicas = [replica_first_loss(single, dp_rank) for dp_rank in (0, 1)]
    assert replicas[0] != pytest.approx(replicas[1], rel=10 * LOSS_RTOL)
    assert plain["world_size"] == swapped["world_size"] == 4
    assert plain["applied_passes"] == ["tensor_parallel", "fsdp"]
    assert swapped["applied_passes"] == ["swap", "tensor_parallel", "fsdp"]
    assert plain["losses"][0] == pytest.approx(sum(replicas) / 2, rel=LOSS_RTOL)
    assert swapped["losses"] == plain["losses"]
    shape = StepShape(
        seq_len=1024,
        batch_size=SETTINGS["batch_size"],
        dtype=torch.float32,
        attn_implementation="sdpa",
        device="cpu",
        tp_size=2,
    )
    plan = plan_memory(trainer_hf_config(single), shape)
    assert plan.swapped_bytes > 0
    assert swapped["swap"]["offloaded_bytes"] >= 0.95 * plan.swapped_bytes
    assert swapped["swap"]["reloaded_bytes"] == swapped["swap"]["offloaded_bytes"]
