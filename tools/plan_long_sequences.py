"""The planner at long sequences, old attention timing beside causal timing.

For each model and length: what ``auto`` moves against the link's bound (the link's
bandwidth times the forward time of the layers that may swap: bytes leave only during
forward), at ``swap_offload_lag`` 1 and at the lag the plan chooses; and the step ratio of
``auto``'s choice when it was planned with every attention score timed (the old timing,
here the causal kernel at half its rate) and replayed with the scores a causal kernel
computes, beside the choice planned on causal timing. Then ``--fit`` per model. Writes
``bench/results/plan-long-sequences.md`` (a dated table) and ``.json`` (the rows),
replacing the last answers: git keeps the earlier ones.

    python tools/plan_long_sequences.py [--seqs 8192 16384 32768] [--no-fit]
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path
from typing import Any

from graphswap.hf.presets import preset_config
from graphswap.planning import MemoryPlan, fit_sequence
from graphswap.planning.saved_tensors import build_meta_model
from graphswap.planning.trace import (
    StepShape,
    StepTrace,
    SwapChoice,
    SwapSchedule,
    layer_candidates,
    plan_step,
    replay,
    swap_choice,
    trace_step,
)
from graphswap.runtime.profile import device_profile

MODELS = ("qwen3-30b-a3b", "llama-3.1-8b")
SHARDS = 8
GIB = 1 << 30


def _replayed(trace: StepTrace, plan: MemoryPlan) -> float:
    """``plan``'s choice (made on another timing of the same step) replayed on ``trace``:
    its step time over ``trace``'s step without swap."""
    candidates = layer_candidates(trace.saved)
    chosen = [
        [c for c in candidates[layer.name] if c.saves[0] in layer.swapped_saves]
        for layer in plan.layers
    ]
    schedule = SwapSchedule(
        swap_offload_lag=plan.swap_offload_lag,
        swap_prefetch_depth=plan.swap_prefetch_depth,
        state_shards=SHARDS,
        max_host_bytes=plan.max_host_bytes,
    )
    run = replay(trace, swap_choice(trace, chosen), schedule)
    none = replay(trace, SwapChoice(None, frozenset()), schedule)
    return run.timeline.step_seconds / none.timeline.step_seconds


def row(name: str, seq: int) -> dict[str, Any]:
    config = preset_config(name)
    causal = device_profile("h200")
    meta = build_meta_model(config, StepShape(seq_len=seq))
    trace = trace_step(meta, causal)
    old_trace = trace_step(meta, causal.with_figures(attention_efficiency=0.5))
    lag1 = plan_step(
        config,
        trace,
        schedule=SwapSchedule(swap_offload_lag=1, state_shards=SHARDS),
        activation_swap="auto",
    )
    chosen = plan_step(
        config, trace, schedule=SwapSchedule(state_shards=SHARDS), activation_swap="auto"
    )
    old = plan_step(
        config,
        old_trace,
        schedule=SwapSchedule(swap_offload_lag=1, state_shards=SHARDS),
        activation_swap="auto",
    )
    forward = sum(layer.forward_seconds for layer in chosen.layers[:-1])
    bound = forward * causal.d2h_gbps * 1e9
    return {
        "model": name,
        "seq": seq,
        "link_bound_gib": bound / GIB,
        "auto_lag1_gib": lag1.swapped_bytes / GIB,
        "auto_gib": chosen.swapped_bytes / GIB,
        "auto_lag": chosen.swap_offload_lag,
        "auto_share_of_bound": chosen.swapped_bytes / bound,
        "lag1_share_of_bound": lag1.swapped_bytes / bound,
        "auto_ratio": chosen.step_ratio,
        "old_plan_ratio_old_timing": old.step_ratio,
        "old_plan_ratio_causal_timing": _replayed(trace, old),
        "old_plan_gib": old.swapped_bytes / GIB,
    }


def fit_rows(name: str) -> list[dict[str, Any]]:
    started = time.perf_counter()
    fit = fit_sequence(
        preset_config(name), memory_bytes=141 * GIB, schedule=SwapSchedule(state_shards=SHARDS)
    )
    seconds = time.perf_counter() - started
    return [
        {
            "model": name,
            "mode": mode.activation_swap,
            "seq": mode.seq_len,
            "fits": [list(run) for run in mode.fits],
            "step_ratio": None if mode.plan is None else mode.plan.step_ratio,
            "host_peak_gib": None if mode.plan is None else mode.plan.host_peak_bytes / GIB,
            "swap_offload_lag": None if mode.plan is None else mode.plan.swap_offload_lag,
            "seconds": seconds,
            "traced": len(fit.traced),
            "planned": fit.planned,
        }
        for mode in fit.modes
    ]


def markdown(rows: list[dict[str, Any]], fits: list[dict[str, Any]]) -> str:
    lines = [
        f"# The planner at long sequences, {date.today()}: causal attention timing (h200, "
        "state_shards 8)",
        "",
        "`auto`'s bytes against the link's bound (50 GB/s x the forward time of the 47 layers "
        "that may swap), at swap_offload_lag 1 and at the lag the plan chose; and the step ratio "
        "of auto planned with every attention score timed (old timing: the causal kernel at "
        "half its rate, lag 1) when the step runs with causal attention.",
        "",
        "| model | seq | link bound GiB | auto lag 1 GiB (share) | auto GiB (lag, share) | "
        "auto ratio | old plan: ratio planned / ratio causal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['seq']} | {r['link_bound_gib']:.2f} | "
            f"{r['auto_lag1_gib']:.2f} ({r['lag1_share_of_bound']:.0%}) | "
            f"{r['auto_gib']:.2f} ({r['auto_lag']}, {r['auto_share_of_bound']:.0%}) | "
            f"{r['auto_ratio']:.4f} | {r['old_plan_ratio_old_timing']:.4f} / "
            f"{r['old_plan_ratio_causal_timing']:.4f} |"
        )
    if fits:
        lines += [
            "",
            "`plan-memory --fit 141GiB --state-shards 8` (host budget: the h200 node's "
            "128 GiB per rank):",
            "",
            "| model | mode | longest seq | runs that fit | step ratio | host peak GiB | lag | "
            "fit seconds (traced / planned) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for f in fits:
            ratio = "-" if f["step_ratio"] is None else f"{f['step_ratio']:.4f}"
            host = "-" if f["host_peak_gib"] is None else f"{f['host_peak_gib']:.1f}"
            lines.append(
                f"| {f['model']} | {f['mode']} | {f['seq']} | {f['fits']} | {ratio} | {host} | "
                f"{f['swap_offload_lag']} | {f['seconds']:.1f} ({f['traced']} / {f['planned']}) |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--no-fit", action="store_true", help="skip the fits (a minute each)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    rows = [row(name, seq) for name in args.models for seq in args.seqs]
    fits = [] if args.no_fit else [f for name in args.models for f in fit_rows(name)]
    text = markdown(rows, fits)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / "plan-long-sequences"
    stem.with_suffix(".md").write_text(text)
    answers = {"date": date.today().isoformat(), "rows": rows, "fits": fits}
    stem.with_suffix(".json").write_text(json.dumps(answers, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
