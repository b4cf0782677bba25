"""What each way of saving activation memory buys, by the planner: issue 28's table.

Per model (Qwen3-30B-A3B, Llama-3.1-8B), in 141 GiB per rank with the state sharded over
8 ranks (h200 profile, causal attention timing, the node's default host pool): for each
``activation_swap`` mode of ``--fit``, the longest sequence, its step ratio there, the
longest sequence that fits at a step ratio of at most ``--max-step-ratio`` (the fit's
own answer, as ``plan-memory --fit --max-step-ratio`` gives it), and the ratio and peak
at 32768 tokens; beside them the trainers' whole-layer activation checkpointing with
nothing swapped, traced by the planner with the recompute running in backward (its peak
grows with the length, so a bisection finds its longest).
Writes ``bench/results/budget-fit.md`` (dated in its title) and ``.json``, replacing the
last answers: git keeps the earlier ones.

``--heads``: instead, per loss head (the model's own, graphswap's chunked head, TRL's
fused head), the step at 32768 tokens without swap and the budget plan within the
profile's memory: the peak, the step ratio and what the budget recomputes; written to
``bench/results/budget-heads.md`` and ``.json``.

    python tools/budget_fit.py [--models qwen3-30b-a3b llama-3.1-8b] [--max-step-ratio 1.03]
    python tools/budget_fit.py --heads
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path
from typing import Any

from graphswap.hf.presets import preset_config
from graphswap.planning import PlanSettingError, fit_sequence, plan_memory
from graphswap.planning.saved_tensors import build_meta_model
from graphswap.planning.trace import StepShape, SwapChoice, SwapSchedule, replay, trace_step
from graphswap.runtime.profile import device_profile

MODELS = ("qwen3-30b-a3b", "llama-3.1-8b")
MEMORY = 141 << 30
SHARDS = 8
AT = 32768
GIB = 1 << 30


def _mode_rows(name: str, max_step_ratio: float) -> tuple[list[dict[str, Any]], float, int]:
    """The fit's modes: one row each; the fit's seconds and its longest length searched."""
    started = time.perf_counter()
    fit = fit_sequence(
        preset_config(name),
        memory_bytes=MEMORY,
        schedule=SwapSchedule(state_shards=SHARDS),
        max_step_ratio=max_step_ratio,
    )
    seconds = time.perf_counter() - started
    rows = []
    for mode in fit.modes:
        at = next((p for p in mode.points if p.seq_len == AT), None)
        rows.append(
            {
                "strategy": mode.activation_swap,
                "longest": mode.seq_len,
                "capped": mode.capped,
                "ratio_there": None if mode.plan is None else mode.plan.step_ratio,
                "recompute": None if mode.plan is None else list(mode.plan.recompute),
                "longest_within_ratio": mode.seq_len_at_max_step_ratio,
                "ratio_at": None if at is None else at.step_ratio,
                "peak_at_gib": None if at is None else at.peak_bytes / GIB,
            }
        )
    return rows, seconds, fit.max_seq


def _without_swap(name: str, seq: int, recompute: tuple[str, ...]) -> tuple[int, float]:
    """The step at ``seq`` with ``recompute`` and nothing swapped: its device peak and
    its seconds."""
    trace = trace_step(
        build_meta_model(preset_config(name), StepShape(seq_len=seq), recompute=recompute),
        device_profile("h200"),
    )
    run = replay(trace, SwapChoice(None, frozenset()), SwapSchedule(state_shards=SHARDS))
    return run.timeline.peak_bytes, run.timeline.step_seconds


def _full_recompute(name: str, seq: int) -> tuple[int, float]:
    """Whole-layer checkpointing, nothing swapped: the step's peak and its time against
    the step without recompute."""
    peak, seconds = _without_swap(name, seq, ("layer",))
    return peak, seconds / _without_swap(name, seq, ())[1]


def _full_recompute_row(name: str, max_seq: int, step: int = 512) -> dict[str, Any]:
    def fits(seq: int) -> bool:
        return _without_swap(name, seq, ("layer",))[0] <= MEMORY

    lo, hi = 0, max_seq // step  # lo fits (0: none yet), hi is the last to try
    if fits(hi * step):
        lo = hi
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid * step):
                lo = mid
            else:
                hi = mid
    longest = lo * step or None
    peak_at, ratio_at = _full_recompute(name, AT)
    return {
        "strategy": "full recompute (whole layer, nothing swapped)",
        "longest": longest,
        "capped": longest == max_seq,
        "ratio_there": None if longest is None else _full_recompute(name, longest)[1],
        "recompute": ["layer"],
        "longest_within_ratio": None,
        "ratio_at": ratio_at,
        "peak_at_gib": peak_at / GIB,
    }


HEADS = ("full", "chunked", "trl")


def _head_rows(name: str) -> list[dict[str, Any]]:
    """Per loss head: the step at ``AT`` tokens without swap, and the budget plan within
    the h200 profile's memory (or the smallest peak any plan reaches)."""
    budget = device_profile("h200").memory_bytes
    rows = []
    for head in HEADS:

        def plan(mode: str, head: str = head) -> Any:
            return plan_memory(
                preset_config(name),
                StepShape(seq_len=AT, loss_head=head),
                schedule=SwapSchedule(state_shards=SHARDS),
                activation_swap=mode,
                activation_memory_budget=budget if mode == "budget" else None,
            )

        row: dict[str, Any] = {
            "loss_head": head,
            "none_peak_gib": plan("none").timeline.peak_bytes / GIB,
        }
        try:
            chosen = plan("budget")
        except PlanSettingError as error:
            smallest = getattr(error, "smallest", None)
            row.update(fits=False, peak_gib=None if smallest is None else smallest.peak_bytes / GIB)
        else:
            row.update(
                fits=True,
                peak_gib=chosen.timeline.peak_bytes / GIB,
                ratio=chosen.step_ratio,
                recompute=list(chosen.recompute),
                swap=chosen.budget_swap,
                chunk_size=chosen.loss_head_chunk_size,
            )
        rows.append(row)
    return rows


def _heads_table(name: str, rows: list[dict[str, Any]], budget_gib: float) -> str:
    lines = [
        f"### {name}, {AT} tokens, budget {budget_gib:.2f} GiB",
        "",
        "| loss head | peak without swap (GiB) | budget plan: peak (GiB) | step ratio "
        "| recomputed | swap |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        if not row["fits"]:
            lines.append(
                f"| {row['loss_head']} | {row['none_peak_gib']:.1f} | no plan fits (smallest "
                f"{_cell(row['peak_gib'], 1)}) | - | - | - |"
            )
            continue
        head = row["loss_head"]
        if row.get("chunk_size") is not None:
            head += f" ({row['chunk_size']}-token chunks)"
        lines.append(
            f"| {head} | {row['none_peak_gib']:.1f} | {row['peak_gib']:.1f} "
            f"| {row['ratio']:.3f} | {' and '.join(row['recompute']) or '-'} | {row['swap']} |"
        )
    return "\n".join(lines)


def _cell(value: Any, digits: int = 3) -> str:
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(name: str, rows: list[dict[str, Any]], max_step_ratio: float) -> str:
    lines = [
        f"### {name}",
        "",
        f"| strategy | longest sequence | step ratio there | longest at ratio <= {max_step_ratio} "
        f"| step ratio at {AT} | peak at {AT} (GiB) | recomputed |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        longest = _cell(row["longest"]) + (" (model max)" if row["capped"] else "")
        lines.append(
            f"| {row['strategy']} | {longest} | {_cell(row['ratio_there'])} "
            f"| {_cell(row['longest_within_ratio'])} | {_cell(row['ratio_at'])} "
            f"| {_cell(row['peak_at_gib'], 1)} | {' and '.join(row['recompute'] or []) or '-'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--max-step-ratio", type=float, default=1.03)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--heads", action="store_true", help="the loss heads' table instead")
    args = parser.parse_args(argv)
    if args.heads:
        return _main_heads(args.models, args.out_dir)
    sections, results = [], {}
    for name in args.models:
        rows, seconds, max_seq = _mode_rows(name, args.max_step_ratio)
        rows.append(_full_recompute_row(name, max_seq))
        results[name] = {"rows": rows, "fit_seconds": seconds}
        sections.append(_table(name, rows, args.max_step_ratio))
        sections.append(f"\n`--fit` (all modes) took {seconds:.0f} s here.\n")
        print(sections[-2], sections[-1], sep="\n", flush=True)
    header = (
        f"# The planner's answers, {date.today()}: {MEMORY // GIB} GiB per rank, state "
        f"sharded over {SHARDS}, h200, causal attention timing (tools/budget_fit.py)\n"
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / "budget-fit"
    stem.with_suffix(".md").write_text("\n".join([header, *sections]))
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    return 0


def _main_heads(models: list[str], out_dir: Path) -> int:
    budget_gib = device_profile("h200").memory_bytes / GIB
    sections, results = [], {}
    for name in models:
        rows = _head_rows(name)
        results[name] = rows
        sections.append(_heads_table(name, rows, budget_gib) + "\n")
        print(sections[-1], flush=True)
    header = (
        f"# The loss head in the budget, {date.today()}: state sharded over {SHARDS}, h200,"
        " causal attention timing (tools/budget_fit.py --heads)\n"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / "budget-heads"
    stem.with_suffix(".md").write_text("\n".join([header, *sections]))
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
