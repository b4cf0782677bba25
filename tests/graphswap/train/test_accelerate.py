"""``transformers.Trainer`` on a rewritten model under ``accelerate launch``, two CPU
processes (gloo data parallel): the losses of one process, and bit for bit those of the
same world without swap.

accelerate honours its FSDP plugin on an accelerator only: on a machine without one,
``accelerate launch --use_fsdp --fsdp_version 2`` starts the ranks but the Trainer's
Accelerator runs them undistributed (``DistributedType.NO``; with ``use_cpu=True``,
``MULTI_CPU`` data parallel), each rank training its own copy. So FSDP2 under
accelerate waits for a GPU; FSDP2 itself on gloo, after the swap rewrite, is
``tests/passes/test_distributed.py``'s.

This module is also the script the ranks run (``__main__`` below), so that both sides
train with the same code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

STEPS, SEQ, GLOBAL_BATCH = 2, 256, 4
"""Eager attention probabilities of 4 heads at 256 tokens pass the swap threshold."""
MODES = ("none", "attention")
LOSS_RTOL = 1e-5
"""Two ranks' gradients are averaged in another order than one process sums them."""


def fit(mode: str, out: Path) -> tuple[list[float], int]:
    """Losses of ``STEPS`` Trainer steps of a tiny Qwen3-MoE, rewritten for ``mode``, on
    however many ranks were launched; and the bytes this rank's swap moved."""
    from transformers import Trainer, TrainingArguments

    import graphswap
    from graphswap.hf.checkpoints import build_model
    from graphswap.hf.presets import qwen3_moe_config

    torch.manual_seed(0)
    model = build_model(qwen3_moe_config("tiny", num_hidden_layers=2))
    report = None if mode == "none" else graphswap.rewrite(model, "qwen3_attn_swap")
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 512, (SEQ,), generator=gen) for _ in range(GLOBAL_BATCH * STEPS)]
    args = TrainingArguments(
        output_dir=str(out / mode),
        max_steps=STEPS,
        per_device_train_batch_size=GLOBAL_BATCH // int(os.environ.get("WORLD_SIZE", "1")),
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    data = [{"input_ids": ids, "labels": ids} for ids in rows]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, 0 if report is None else report.manager.stats.offloaded_bytes


def test_accelerate_launch_of_two_cpu_ranks_trains_like_one_process(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    done = subprocess.run(
        [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1",
            "--main_process_port", "0", __file__, str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    world = json.loads((tmp_path / "world.json").read_text())
    assert world["world_size"] == 2 and world["distributed_type"] == "MULTI_CPU"
    plain, swapped = (world["modes"][mode] for mode in MODES)
    assert swapped["losses"] == plain["losses"], "the swap changed a number"
    assert swapped["offloaded_bytes"] > 0
    one, _ = fit("none", tmp_path / "one")
    assert plain["losses"] == pytest.approx(one, rel=LOSS_RTOL)


if __name__ == "__main__":
    from accelerate import PartialState

    out = Path(sys.argv[1])
    results = {}
    for mode in MODES:
        losses, moved = fit(mode, out)
        results[mode] = {"losses": losses, "offloaded_bytes": moved}
    state = PartialState()
    if state.is_main_process:
        world = {
            "world_size": state.num_processes,
            "distributed_type": state.distributed_type.name,
            "modes": results,
        }
        (out / "world.json").write_text(json.dumps(world))
    # A rank that exits with its process group alive tears gloo's threads down in
    # static destructors, which can abort it ("terminate called without an active
    # exception") after it trained: the group is closed first, as torch asks.
    state.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
