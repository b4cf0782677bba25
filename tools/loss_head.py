"""The loss head's device-memory peak, measured beside predicted.

A tiny Llama with a 32k vocabulary, whose head outweighs its decoder layers at a few
thousand tokens, trains one step (forward, backward, AdamW) on CPU over the clocked
simulated H200: the real runtime's step, every storage's birth and death on its clock.
Once with the model's own head (``full``), once with graphswap's chunked head. Beside
each, the planner's prediction of the same step (``plan_memory`` on meta), and how far
apart they are. Writes ``loss-head-cpu.json`` and ``.md`` to ``--out-dir``
(``bench/results/`` by default), the date, machine and settings inside.

    python tools/loss_head.py                                 # 4096 tokens, vocab 32768
    python tools/loss_head.py --seq 512 --out-dir OUT          # a rehearsal
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from graphswap.hf.checkpoints import build_model, decoder_layers
from graphswap.hf.presets import preset_config
from graphswap.planning import plan_memory
from graphswap.planning.trace import StepShape
from graphswap.rewriting.loss_head import chunk_loss_head
from graphswap.runtime.profile import device_profile
from graphswap.runtime.sim import SimulatedAccelerator
from graphswap.runtime.timeline import OPTIMIZER_LABEL, StepTimeline
from graphswap.train.trainer import state_bytes

HEADS = ("full", "chunked")
MIB = 1 << 20


def _config(vocab: int, layers: int) -> Any:
    config = preset_config("tiny-llama", attn_implementation="sdpa")
    config.vocab_size = vocab
    config.num_hidden_layers = layers
    return config


def measure(config: Any, head: str, seq: int, batch: int, chunk: int) -> StepTimeline:
    """The second step of ``config`` with ``head`` on the clocked simulated H200 (the
    first makes the optimizer state)."""
    torch.manual_seed(0)
    model = build_model(config, device="cpu", dtype=torch.float32).train()
    if head == "chunked":
        chunk_loss_head(model, chunk_size=chunk)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(
        0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)
    )

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    sim = SimulatedAccelerator(profile=device_profile("h200"))
    _, layers = decoder_layers(model)
    with sim.clock(layers, base_bytes=state_bytes(model, optimizer)) as clock:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        clock.label(OPTIMIZER_LABEL)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return clock.timeline


def predict(config: Any, head: str, seq: int, batch: int, chunk: int) -> StepTimeline:
    shape = StepShape(
        seq_len=seq,
        batch_size=batch,
        dtype=torch.float32,
        attn_implementation="sdpa",
        device="cpu",
        loss_head=head,
        loss_head_chunk_size=chunk,
    )
    plan = plan_memory(config, shape, activation_swap="none", profile="h200")
    return plan.timeline


def run(seq: int, batch: int, vocab: int, layers: int, chunk: int) -> dict[str, Any]:
    config = _config(vocab, layers)
    rows = []
    for head in HEADS:
        measured = measure(config, head, seq, batch, chunk)
        predicted = predict(config, head, seq, batch, chunk)
        rows.append(
            {
                "loss_head": head,
                "measured_peak_bytes": measured.peak_bytes,
                "measured_peak_label": measured.peak_label,
                "predicted_peak_bytes": predicted.peak_bytes,
                "predicted_peak_label": predicted.peak_label,
                "relative_error": predicted.peak_bytes / measured.peak_bytes - 1,
                "measured_step_seconds": measured.step_seconds,
                "predicted_step_seconds": predicted.step_seconds,
            }
        )
    full, chunked = rows
    return {
        "date": datetime.date.today().isoformat(),
        "environment": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
        },
        "config": {
            "preset": "tiny-llama",
            "vocab_size": vocab,
            "layers": layers,
            "seq_len": seq,
            "batch_size": batch,
            "dtype": "float32",
            "loss_head_chunk_size": chunk,
            "profile": "h200 (simulated, clocked)",
        },
        "heads": rows,
        "measured_peak_ratio": chunked["measured_peak_bytes"] / full["measured_peak_bytes"],
        "predicted_peak_ratio": chunked["predicted_peak_bytes"] / full["predicted_peak_bytes"],
    }


def to_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"# The loss head's peak, measured beside predicted ({result['date']})",
        "",
        f"tiny-llama, vocabulary {cfg['vocab_size']}, {cfg['layers']} layers, "
        f"{cfg['batch_size']} x {cfg['seq_len']} tokens, {cfg['dtype']}; chunked head at "
        f"{cfg['loss_head_chunk_size']} tokens a chunk. Measured: the real step (forward, "
        f"backward, AdamW) on CPU over the clocked simulated H200. Predicted: `plan_memory` "
        f"on meta. {result['environment']['cpu_count']} CPUs, torch "
        f"{result['environment']['torch']}.",
        "",
        "| loss head | measured peak | predicted peak | predicted / measured | peak at |",
        "|---|---|---|---|---|",
    ]
    for row in result["heads"]:
        lines.append(
            f"| {row['loss_head']} | {row['measured_peak_bytes'] / MIB:.1f} MiB "
            f"| {row['predicted_peak_bytes'] / MIB:.1f} MiB "
            f"| {1 + row['relative_error']:.4f} | {row['measured_peak_label']} |"
        )
    lines += [
        "",
        f"chunked / full peak: {result['measured_peak_ratio']:.3f} measured, "
        f"{result['predicted_peak_ratio']:.3f} predicted.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per batch")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per head chunk")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    result = run(args.seq, args.batch, args.vocab, args.layers, args.chunk)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / "loss-head-cpu"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    report = to_markdown(result)
    stem.with_suffix(".md").write_text(report)
    print(report, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
