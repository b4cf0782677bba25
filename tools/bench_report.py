"""What a benchmark run is judged by: the issue's targets, and the Markdown report.

A target is met, missed, or not applicable to this run (a CPU dry run, another
sequence length); each prints as one ``TARGET name: verdict (numbers)`` line that
``tools/device_check.sh`` collects into its summary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from swap_modes import ATTENTION, BUDGET, NONE, SAVE_ON_CPU

PEAK_REDUCTION_OF_PLAN = 0.99
STEP_RATIO_TARGET = 1.02
STEP_RATIO_SEQ = 8192
OVERHEAD_OF_SAVE_ON_CPU = 0.10


@dataclass(frozen=True)
class Target:
    name: str
    met: bool | None
    """``None``: the target does not apply to this run; the number is still shown."""
    text: str

    def line(self) -> str:
        verdict = {True: "met", False: "missed", None: "n/a"}[self.met]
        return f"TARGET {self.name}: {verdict} ({self.text})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


def size(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if abs(n) >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _median(mode: dict[str, Any]) -> float | None:
    summary = mode.get("summary")
    return None if summary is None else summary["median_step_s"]


def targets(run: dict[str, Any], *, device: str, attn: str) -> list[Target]:
    """The issue's targets for one sequence length, from what the run measured."""
    modes = run["modes"]
    found = [_numbers_unchanged(run)]
    if NONE in modes and ATTENTION in modes:
        found.append(_peak_reduction(run, device))
        found.append(_step_ratio(run, device, attn))
        if SAVE_ON_CPU in modes:
            found.append(_overhead_vs_save_on_cpu(run))
    if any(m.get("prediction") for m in modes.values()):
        found.append(_prediction(run, device))
    if "budget_plan" in run:
        found.append(_budget_plan(run))
    return found


def measured(run: dict[str, Any], name: str) -> dict[str, Any]:
    """What the bench measured for one mode, in the prediction's terms: step ratio against
    ``none``, peak allocated and reserved (max over the timed steps), the label of the peak
    (CUDA only); ``None`` where not measured."""
    mode = run["modes"][name]
    none_median, median = _median(run["modes"].get(NONE, {})), _median(mode)
    peak = mode.get("measured_peak") or {}
    return {
        "step_ratio": median / none_median if median and none_median else None,
        "peak_allocated_bytes": max(mode["peak_allocated_bytes"], default=None),
        "peak_reserved_bytes": max(mode.get("peak_reserved_bytes", []), default=None),
        "peak_label": peak.get("peak_label"),
    }


def _prediction(run: dict[str, Any], device: str) -> Target:
    """The planner beside the measurement, per mode; not judged: the first GPU run
    calibrates the model."""
    parts = []
    for name, mode in run["modes"].items():
        prediction = mode.get("prediction")
        if not prediction:
            continue
        got = measured(run, name)
        ratio = "-" if got["step_ratio"] is None else f"{got['step_ratio']:.3f}"
        peak = "-" if got["peak_allocated_bytes"] is None else size(got["peak_allocated_bytes"])
        parts.append(
            f"{name}: step x{ratio} (pred {prediction['step_ratio']:.3f}), peak {peak} "
            f"(pred {size(prediction['peak_bytes'])}) at {got['peak_label'] or '-'} "
            f"(pred {prediction['peak_label']})"
        )
    why = "calibration, not judged" if device == "cuda" else "CPU: no allocator peak"
    return Target("prediction", None, f"{'; '.join(parts)}; {why}")


def _budget_plan(run: dict[str, Any]) -> Target:
    """The budget mode against its plan: it recomputed and offloaded the bytes the plan
    says, and its gradients are ``none``'s bit for bit (recompute must not change a
    number). Its peaks, predicted and measured, are shown beside the budget, not judged:
    the first GPU run calibrates the model."""
    plan = run["budget_plan"]
    got = measured(run, BUDGET)
    peak = got["peak_allocated_bytes"]
    without = size(plan["peak_without_swap_bytes"])
    fraction = f"{plan['budget_fraction']:g} of the predicted {without}"
    asked = f"budget {size(plan['budget_bytes'])} ({fraction} without swap)"
    if "note" in plan:
        asked = (
            f"budget {size(plan['budget_bytes'])}, the smallest peak any plan reaches (none "
            f"meets {size(plan['asked_budget_bytes'])}, {fraction} without swap)"
        )
    bitwise = {
        True: "bitwise equal to none's",
        False: "NOT equal to none's",
        None: "not compared (no none mode)",
    }[plan["gradients_as_none"]]
    text = (
        f"{asked}: recomputes {' and '.join(plan['recompute']) or 'nothing'}, swaps "
        f"{plan['swap']}; recomputed {size(plan['measured_recomputed_bytes'])} (plan "
        f"{size(plan['recomputed_bytes'])}), offloaded {size(plan['offloaded_bytes'])} (plan "
        f"{size(plan['swapped_bytes'])}); gradients {bitwise}; peak "
        f"{'-' if peak is None else size(peak)} (pred {size(plan['predicted_peak_bytes'])})"
    )
    if plan["gradients_as_none"] is False and not run["none_reproducible"]:
        return Target("budget_plan", None, text + "; without swap two runs already differ")
    return Target(
        "budget_plan", plan["matches_plan"] and plan["gradients_as_none"] is not False, text
    )


def _numbers_unchanged(run: dict[str, Any]) -> Target:
    modes = run["modes"]
    losses = {loss for m in modes.values() for loss in [m["verify"]["loss"], *m["losses"]]}
    digests = {m["verify"]["grad_digest"] for m in modes.values()}
    text = f"{len(modes)} modes: {len(losses)} distinct loss, {len(digests)} distinct gradients"
    if not run["none_reproducible"]:
        return Target(
            "numbers_unchanged",
            None,
            text + "; without swap two runs already differ (a non-deterministic kernel)",
        )
    return Target("numbers_unchanged", len(losses) == 1 and len(digests) == 1, text)


def _peak_reduction(run: dict[str, Any], device: str) -> Target:
    if device == "cuda":
        return _peak_drop_on_cuda(run)
    none, attention = run["modes"][NONE], run["modes"][ATTENTION]
    leaves = run["plan"]["swapped_bytes"]
    reduction = none["resident_saved_bytes"] - attention["resident_saved_bytes"]
    what = "resident saved bytes at end of forward (CPU has no allocator peak)"
    if leaves == 0:
        return Target(
            "peak_reduction",
            None,
            f"{what} drops {size(reduction)}; the planner says nothing leaves the device here",
        )
    fraction = reduction / leaves
    return Target(
        "peak_reduction",
        fraction >= PEAK_REDUCTION_OF_PLAN,
        f"{what} drops {size(reduction)} = {100 * fraction:.1f}% of the {size(leaves)} the "
        f"planner says leaves the device; target >= {100 * PEAK_REDUCTION_OF_PLAN:g}%",
    )


def _drop(run: dict[str, Any], key: str) -> int | None:
    """``none``'s peak minus ``attention``'s, max over the timed steps; ``None`` without."""
    none, attention = run["modes"][NONE].get(key), run["modes"][ATTENTION].get(key)
    return max(none) - max(attention) if none and attention else None


def _peak_drop_on_cuda(run: dict[str, Any]) -> Target:
    """The measured drop of ``max_memory_allocated`` against the planner's drop at the peak
    (its peak without swap minus with the attention swap, for the bench's step); the
    reserved drop is shown beside it."""
    prediction = run["modes"][ATTENTION].get("prediction")
    allocated = _drop(run, "peak_allocated_bytes")
    if allocated is None:
        return Target("peak_reduction", False, "no timed step finished")
    reserved = _drop(run, "peak_reserved_bytes")
    measured = f"peak allocated drops {size(allocated)}, reserved " + (
        "-" if reserved is None else size(reserved)
    )
    if prediction is None:
        return Target("peak_reduction", False, measured + "; no planner prediction")
    predicted = prediction["drop_bytes"]
    if predicted <= 0:
        return Target(
            "peak_reduction",
            None,
            f"{measured}; the planner says the peak does not drop here ({size(predicted)})",
        )
    fraction = allocated / predicted
    before, after = size(prediction["peak_without_swap_bytes"]), size(prediction["peak_bytes"])
    reserved_part = "" if reserved is None else f", reserved {100 * reserved / predicted:.1f}%"
    return Target(
        "peak_reduction",
        fraction >= PEAK_REDUCTION_OF_PLAN,
        f"{measured}; predicted drop {size(predicted)} (peak {before} -> {after}); "
        f"allocated {100 * fraction:.1f}% of it"
        f"{reserved_part}; target allocated >= {100 * PEAK_REDUCTION_OF_PLAN:g}%",
    )


def _step_ratio(run: dict[str, Any], device: str, attn: str) -> Target:
    none, attention = _median(run["modes"][NONE]), _median(run["modes"][ATTENTION])
    if none is None or attention is None:
        return Target("step_time_ratio", False, "no timed step finished")
    ratio = attention / none
    applies = device == "cuda" and run["seq"] == STEP_RATIO_SEQ and attn == "sdpa"
    text = (
        f"attention / none median step = {ratio:.3f} at seq {run['seq']}, {attn}, {device}; "
        f"target <= {STEP_RATIO_TARGET} at seq {STEP_RATIO_SEQ} with sdpa on CUDA"
    )
    return Target("step_time_ratio", ratio <= STEP_RATIO_TARGET if applies else None, text)


def _overhead_vs_save_on_cpu(run: dict[str, Any]) -> Target:
    modes = run["modes"]
    none, attention, save = (_median(modes[name]) for name in (NONE, ATTENTION, SAVE_ON_CPU))
    if none is None or attention is None or save is None:
        return Target("overhead_vs_save_on_cpu", False, "no timed step finished")
    ours, theirs = attention - none, save - none
    text = f"attention adds {ours * 1e3:.2f} ms per step, save_on_cpu {theirs * 1e3:.2f} ms"
    if modes[SAVE_ON_CPU]["verify"]["counters"]["offloaded_bytes"] == 0 or theirs <= 0:
        return Target(
            "overhead_vs_save_on_cpu",
            None,
            text + "; save_on_cpu copies nothing here (its tensors are on the CPU already)",
        )
    ratio = ours / theirs
    return Target(
        "overhead_vs_save_on_cpu",
        ratio <= OVERHEAD_OF_SAVE_ON_CPU,
        f"{text}: {ratio:.3f} of it; target <= {OVERHEAD_OF_SAVE_ON_CPU:g}",
    )


def to_markdown(result: dict[str, Any]) -> str:
    env, cfg = result["environment"], result["config"]
    lines = [
        f"# Activation swap benchmark: {env['device_name']}, {result['date']}",
        "",
        f"Model: preset `{cfg['preset']}`, {cfg['layers']} layers, {cfg['dtype']}, "
        f"attention `{cfg['attn']}`; {cfg['steps']} timed steps per mode after "
        f"{cfg['warmup']} warm-up, interleaved; a step is forward + backward, no update. "
        f"torch {env['torch']}, transformers {env['transformers']}, {env['cpu_count']} CPUs"
        f"{when_and_load(env)}; deterministic algorithms on, `fill_uninitialized_memory` off.",
        "Peak allocated / reserved: `torch.cuda.max_memory_allocated` / `max_memory_reserved` "
        "around the timed steps (max over them); reserved after `empty_cache` is from one "
        "untimed step per mode. Resident: bytes of activations still on the compute device at "
        "the end of forward, counted by an independent tracker in an untimed step. Ratios are "
        "against `none` from the same run.",
    ]
    for run in result["runs"]:
        lines += _run_markdown(run)
    if result.get("kernel_shares"):
        lines += _shares_markdown(result["kernel_shares"])
    return "\n".join(lines) + "\n"


def when_and_load(env: dict[str, Any]) -> str:
    """When the run started and the machine's load then, where the result records them."""
    text = f"; started {env['started_utc']}" if env.get("started_utc") else ""
    load = env.get("load_average")
    if load:
        text += f", load {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min)"
    return text


def _run_markdown(run: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## seq {run['seq']}, batch {run['batch']}",
        "",
        "| mode | median step ms | p25-p75 ms | step ratio | peak allocated MiB "
        "| peak reserved MiB | reserved after empty_cache MiB | resident MiB "
        "| offloaded MiB | reloaded MiB | recomputed MiB | prefetch hit/miss | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    none_median = _median(run["modes"].get(NONE, {}))
    for name, mode in run["modes"].items():
        summary, verify = mode.get("summary"), mode["verify"]
        counters = verify["counters"]
        if summary is None:
            timing = "- | - | -"
        else:
            ratio = summary["median_step_s"] / none_median if none_median else float("nan")
            timing = (
                f"{summary['median_step_s'] * 1e3:.1f} | {summary['p25_step_s'] * 1e3:.1f}-"
                f"{summary['p75_step_s'] * 1e3:.1f} | {ratio:.3f}"
            )
        lines.append(
            f"| {name} | {timing} | {mib(max(mode['peak_allocated_bytes'], default=None))} | "
            f"{mib(max(mode['peak_reserved_bytes'], default=None))} | "
            f"{mib(verify['peak_reserved_bytes'])} | {mib(mode['resident_saved_bytes'])} | "
            f"{mib(counters['offloaded_bytes'])} | {mib(counters['reloaded_bytes'])} | "
            f"{mib(counters['recomputed_bytes'])} | "
            f"{counters['prefetch_hits']}/{counters['prefetch_misses']} | {verify['loss']:.6f} |"
        )
    lines += _prediction_markdown(run)
    plan = run["plan"]
    lines += [
        "",
        f"Planner (`graphswap plan-memory`): total saved {mib(plan['total_saved_bytes'])} MiB, "
        f"leaving the device (every layer's swappable bytes but the kept last layer's) "
        f"{mib(plan['swapped_bytes'])} MiB, end of forward with swap "
        f"{mib(plan['end_of_forward_with_swap_bytes'])} MiB.",
    ]
    if run.get("attention_share") is not None:
        lines.append(
            f"The attention swap moves {100 * run['attention_share']:.1f}% of all saved "
            "activation bytes at this shape (offloaded / resident without swap)."
        )
    lines += ["", *(f"- {target['name']}: {_verdict(target)}" for target in run.get("targets", []))]
    return lines


def _prediction_markdown(run: dict[str, Any]) -> list[str]:
    names = [name for name, mode in run["modes"].items() if mode.get("prediction")]
    if not names:
        return []
    lines = [
        "",
        "Planner prediction of this step (no optimizer; the auto mode's profile) against the "
        "measurement: peak drop = `none`'s peak minus the mode's; measured peak label from an "
        "untimed step labelled as the planner labels it (CUDA only).",
        "",
        "| mode | step ratio pred / meas | peak MiB pred / allocated / reserved "
        "| peak drop MiB pred / allocated / reserved | peak label pred / meas |",
        "|---|---|---|---|---|",
    ]
    none = measured(run, NONE) if NONE in run["modes"] else None
    for name in names:
        pred, got = run["modes"][name]["prediction"], measured(run, name)
        ratio = "-" if got["step_ratio"] is None else f"{got['step_ratio']:.3f}"
        drops = []
        for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
            ok = none is not None and none[key] is not None and got[key] is not None
            drops.append(mib(none[key] - got[key]) if ok else "-")  # type: ignore[index]
        lines.append(
            f"| {name} | {pred['step_ratio']:.3f} / {ratio} | {mib(pred['peak_bytes'])} / "
            f"{mib(got['peak_allocated_bytes'])} / {mib(got['peak_reserved_bytes'])} | "
            f"{mib(pred['drop_bytes'])} / {drops[0]} / {drops[1]} | "
            f"{pred['peak_label']} / {got['peak_label'] or '-'} |"
        )
    return lines


def _verdict(target: dict[str, Any]) -> str:
    verdict = {True: "met", False: "**missed**", None: "n/a"}[target["met"]]
    return f"{verdict} ({target['text']})"


def _shares_markdown(shares: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "## What attention swap moves, per attention kernel",
        "",
        "One forward + backward per kernel; share = bytes the attention swap offloads / all "
        "activation bytes saved for backward (independent tracker, no swap). The last layer's "
        "attention stays on device.",
        "",
        "| kernel | seq | saved MiB | attention offloaded MiB | share |",
        "|---|---|---|---|---|",
    ]
    for row in shares:
        if row.get("error"):
            lines.append(f"| {row['kernel']} | {row['seq']} | - | - | {row['error']} |")
            continue
        lines.append(
            f"| {row['kernel']} | {row['seq']} | {mib(row['total_saved_bytes'])} | "
            f"{mib(row['offloaded_bytes'])} | {100 * row['share']:.1f}% |"
        )
    return lines
