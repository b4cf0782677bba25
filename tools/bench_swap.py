"""Benchmark activation swap: none / attention / layer / auto / budget / save_on_cpu, side by side.

One model, one seed, one input batch. The modes are installed on the same model in
turn and interleaved step by step (A B C D A B C D ...), so machine noise hits all of
them alike. A step is zero-grad + forward + backward with no optimizer update, so
every step of every mode must produce the same loss and gradients, which the run
checks. Timed steps are plain steps: on CUDA the allocator's peak
(``max_memory_allocated`` / ``max_memory_reserved``) is read around each of them;
the independent resident-bytes tracker runs only in separate, untimed steps.
Deterministic algorithms stay on (identical gradients are checked) with
``fill_uninitialized_memory`` off, which would otherwise memset every ``empty``.
The JSON and Markdown results are rewritten after every step, so a run cut short
keeps what it measured. Their names carry the benchmark and the device, not the date
(``bench-swap-cpu.json``, ``swap-overhead-cuda-h200.json``): ``bench/results/`` holds one
current result per benchmark, and the date, machine and load are inside each file.

    python tools/bench_swap.py                  # CPU: tiny fp32 model, seq 512
    python tools/bench_swap.py --device cuda    # CUDA: Qwen3-30B-A3B widths, bf16, sdpa, seq 8192
    python tools/bench_swap.py --overhead       # host microseconds per swapped tensor
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from bench_report import targets, to_markdown, when_and_load
from swap_modes import ATTENTION, AUTO, BUDGET, LAYER, MODES, NONE, Mode
from swap_overhead import (
    OverheadConfig,
    bookkeeping_line,
    calls_line,
    measure_overhead,
    overhead_table,
    target_line,
)

from graphswap.planning.measure import ResidentActivationTracker, output_tensors
from graphswap.planning.trace import StepShape, SwapSchedule

SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}
KERNELS = {
    "cuda": ("eager", "flash", "efficient", "cudnn", "math"),
    "cpu": ("eager", "flash", "math"),
}


class ResultFiles:
    """``<stem>.json`` and ``<stem>.md``, replaced whole (never half-written) on every flush."""

    def __init__(self, stem: Path, result: dict[str, Any]) -> None:
        self.stem = stem
        self.result = result

    def flush(self) -> None:
        self.stem.parent.mkdir(parents=True, exist_ok=True)
        for suffix, text in (
            (".json", json.dumps(self.result, indent=2) + "\n"),
            (".md", to_markdown(self.result)),
        ):
            write_whole(self.stem.with_suffix(suffix), text)


def write_whole(path: Path, text: str) -> None:
    """Replace ``path`` at once: a reader, or a run killed mid-write, never sees half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_step(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """One zero-grad + forward + backward; time, loss and the allocator's peaks around it."""
    model.zero_grad(set_to_none=True)
    cuda = device.type == "cuda"
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    _sync(device)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "loss": loss.item(),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
    }


def grad_digest(model: torch.nn.Module) -> str:
    """A fingerprint of every gradient: bitwise-different gradients give different digests."""
    sums = [
        torch.stack(
            (p.grad.sum(dtype=torch.float64), torch.linalg.vector_norm(p.grad, dtype=torch.float64))
        )
        for p in model.parameters()
        if p.grad is not None
    ]
    return hashlib.sha256(torch.stack(sums).cpu().numpy().tobytes()).hexdigest()[:16]


def verify_step(mode: Mode, ids: torch.Tensor) -> dict[str, Any]:
    """Untimed: loss, gradient digest and copy counters; on CUDA, the peak reserved from an
    empty cache (the timed steps share one cache across modes)."""
    if mode.device.type == "cuda":
        torch.cuda.empty_cache()
    with mode.installed():
        mode.reset_counters()
        sample = plain_step(mode.model, ids, mode.device)
        sample["counters"] = mode.counters()  # unwrapping drops the per-module counters
    sample["grad_digest"] = grad_digest(mode.model)
    mode.model.zero_grad(set_to_none=True)
    return sample


def resident_step(mode: Mode, ids: torch.Tensor) -> int:
    """Untimed: bytes of activations still on the device at the end of forward, counted by
    the independent tracker. The offload lag bounds what is still in flight then: every
    swapped layer's tensors are released by the time the kept last layer has run."""
    model = mode.model
    model.zero_grad(set_to_none=True)
    tracker = ResidentActivationTracker(mode.device)
    with mode.installed():
        with tracker.track():
            out = model(input_ids=ids, labels=ids, use_cache=False)
        _sync(mode.device)
        resident = tracker.resident_bytes(output_tensors(out))
        out.loss.backward()
    del out
    model.zero_grad(set_to_none=True)
    return resident


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
    return {
        "median_step_s": statistics.median(ordered),
        "p25_step_s": quartiles[0],
        "p75_step_s": quartiles[2],
        "min_step_s": ordered[0],
        "max_step_s": ordered[-1],
    }


def _plan_memory(
    args: argparse.Namespace, config: Any, seq: int, device: torch.device, **swap: Any
) -> Any:
    """The planner's prediction for this run's shape and the kernel this device runs (CPU
    flash on CPU); ``swap``: the swap mode, its link model and other settings, when not
    attention."""
    from graphswap.planning import plan_memory
    from graphswap.planning.trace import StepShape, SwapSchedule

    shape = StepShape(
        seq_len=seq,
        batch_size=args.batch,
        dtype=getattr(torch, args.dtype),
        attn_implementation=args.attn,
        device="cuda" if device.type == "cuda" else "cpu",
    )
    margin = swap.pop("swap_hide_margin", None)
    schedule = SwapSchedule() if margin is None else SwapSchedule(swap_hide_margin=margin)
    return plan_memory(config, shape, schedule=schedule, **swap)


def _plan(args: argparse.Namespace, config: Any, seq: int, device: torch.device) -> dict[str, int]:
    plan = _plan_memory(args, config, seq, device)
    return {
        "total_saved_bytes": plan.total_saved_bytes,
        "swapped_bytes": plan.swapped_bytes,
        "end_of_forward_with_swap_bytes": plan.end_of_forward_with_swap_bytes,
        "predicted_peak_bytes": plan.timeline.peak_bytes,
        "predicted_peak_without_swap_bytes": plan.baseline.peak_bytes,
        "predicted_step_ratio": plan.step_ratio,
    }


PLANNED_MODES = (NONE, ATTENTION, LAYER, AUTO, BUDGET)
"""The modes the planner predicts (``save_on_cpu`` is not graphswap's)."""


def _bench_step(
    args: argparse.Namespace, config: Any, seq: int, device: torch.device
) -> tuple[Any, Any]:
    """The bench's own step at this shape, traced on meta: zero-grad, forward and backward,
    no optimizer (``optimizer=False``), on the profile the auto mode plans on (h200 with
    --swap-bandwidth and --swap-tflops); and that step replayed without swap. One trace
    serves every planned mode's prediction and sizes the budget mode's budget."""
    from graphswap.planning import DEFAULT_PROFILE
    from graphswap.planning.saved_tensors import build_meta_model
    from graphswap.planning.trace import SwapChoice, replay, trace_step
    from graphswap.runtime.profile import device_profile

    meta = build_meta_model(
        config,
        StepShape(
            seq_len=seq,
            batch_size=args.batch,
            dtype=getattr(torch, args.dtype),
            attn_implementation=args.attn,
            device="cuda" if device.type == "cuda" else "cpu",
        ),
    )
    profile = device_profile(DEFAULT_PROFILE)
    replaced = {"link_gbps": args.swap_bandwidth, "tflops": args.swap_tflops}
    replaced = {figure: value for figure, value in replaced.items() if value is not None}
    if replaced:
        profile = profile.with_figures(**replaced)
    trace = trace_step(meta, profile, optimizer=False)
    return trace, replay(trace, SwapChoice(None, frozenset()))


def _predictions(
    args: argparse.Namespace, config: Any, trace: Any, baseline: Any, budget: Any
) -> dict[str, dict[str, Any]]:
    """Per planned mode in ``args.modes``, the planner's prediction of the bench's step
    (:func:`_bench_step`'s ``trace`` and ``baseline``); ``budget``: the budget mode's
    PlanExecutor, whose plan is of this step already, or ``None``."""
    from graphswap.planning.trace import plan_step

    found = {}
    for name in args.modes:
        if name not in PLANNED_MODES:
            continue
        plan = (
            budget.plan
            if name == BUDGET
            else plan_step(
                config,
                trace,
                schedule=SwapSchedule(swap_hide_margin=args.swap_hide_margin),
                activation_swap=name,
                baseline=baseline,
            )
        )
        found[name] = {
            "step_ratio": plan.step_ratio,
            "step_seconds": plan.timeline.step_seconds,
            "peak_bytes": plan.timeline.peak_bytes,
            "peak_without_swap_bytes": plan.baseline.peak_bytes,
            "drop_bytes": plan.baseline.peak_bytes - plan.timeline.peak_bytes,
            "peak_label": plan.timeline.peak_label,
            "base_bytes": plan.timeline.base_bytes,
            "swapped_bytes": plan.swapped_bytes,
            "recomputed_bytes": plan.recomputed_bytes,
        }
    return found


class PeakByLabel:
    """Where a CUDA step's allocator peak falls, by :func:`step_labels` label.

    ``step_labels`` sets :attr:`label` at each layer's forward and backward; on every
    change the recorder reads ``torch.cuda.max_memory_allocated`` and gives any rise to
    the label that just ended. The caching allocator counts an allocation when the host
    asks for it (not when a kernel runs), and the host asks in program order, so this is
    exact at label granularity: the peak belongs to the last label that raised it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._label: str | None = None
        self._max = torch.cuda.max_memory_allocated(device)
        self.rises: dict[str, int] = {}
        """Per label, how much it raised the step's peak."""
        self.peak_label: str | None = None

    @property
    def label(self) -> str | None:
        return self._label

    @label.setter
    def label(self, value: str) -> None:
        self.close()
        self._label = value

    def close(self) -> None:
        """Attribute what the peak rose since the last change to the current label."""
        now = torch.cuda.max_memory_allocated(self.device)
        if self._label is not None and now > self._max:
            self.rises[self._label] = self.rises.get(self._label, 0) + now - self._max
            self.peak_label = self._label
        self._max = max(self._max, now)


def peak_step(mode: Mode, ids: torch.Tensor) -> dict[str, Any]:
    """Untimed, CUDA only: one plain step under :class:`PeakByLabel`; its peak allocated and
    the label it falls in."""
    from graphswap.hf.checkpoints import decoder_layers
    from graphswap.runtime import step_labels

    model, device = mode.model, mode.device
    with mode.installed():
        _, layers = decoder_layers(model)  # as installed: a rewrite may replace them
        model.zero_grad(set_to_none=True)
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        recorder = PeakByLabel(device)
        with step_labels(layers, recorder):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            _sync(device)
            recorder.close()
        del loss
    model.zero_grad(set_to_none=True)
    return {
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "peak_label": recorder.peak_label,
        "rises_by_label": recorder.rises,
    }


def _auto_swap(args: argparse.Namespace, config: Any, seq: int, device: torch.device) -> Any:
    """The ``auto`` plan for this run's shape and kernel, at the given link and compute."""
    from graphswap.passes.plan_executor import PlanExecutor

    plan = _plan_memory(args, config, seq, device, activation_swap="auto", **_link_model(args))
    return PlanExecutor(plan, made_for=_made_for(args, seq))


def _link_model(args: argparse.Namespace) -> dict[str, float]:
    """The planned modes' link and compute, and how much of a window auto leaves free."""
    return {
        "swap_bandwidth_gbps": args.swap_bandwidth,
        "swap_tflops": args.swap_tflops,
        "swap_hide_margin": args.swap_hide_margin,
    }


def _made_for(args: argparse.Namespace, seq: int) -> str:
    return f"--seq {seq}, --batch {args.batch}, --dtype {args.dtype}, --attn {args.attn}"


def _budget_swap(
    args: argparse.Namespace, config: Any, seq: int, device: torch.device, without_swap: int
) -> tuple[Any, dict[str, Any]]:
    """The ``budget`` plan of the bench's own step (no optimizer, the auto mode's profile)
    within ``--budget-fraction`` of its predicted peak without swap (``without_swap``), and
    how that budget was set. Where no plan meets the fraction, the plan within the smallest
    peak any plan reaches: the mode still runs its deepest recompute, which is what the
    check is for."""
    from graphswap.passes.plan_executor import PlanExecutor
    from graphswap.planning import PlanSettingError

    def plan_within(budget: int) -> Any:
        return _plan_memory(
            args,
            config,
            seq,
            device,
            activation_swap="budget",
            optimizer=False,
            activation_memory_budget=budget,
            **_link_model(args),
        )

    asked = int(args.budget_fraction * without_swap)
    how: dict[str, Any] = {
        "budget_fraction": args.budget_fraction,
        "peak_without_swap_bytes": without_swap,
        "asked_budget_bytes": asked,
    }
    try:
        plan = plan_within(asked)
    except PlanSettingError as error:
        smallest = getattr(error, "smallest", None)  # a BudgetError: no plan meets the budget
        if smallest is None:
            raise
        plan = plan_within(smallest.peak_bytes)
        how["note"] = (
            f"no plan meets {args.budget_fraction:g} of the peak without swap "
            f"({asked} bytes); planned within the smallest peak any plan reaches instead"
        )
    return PlanExecutor(plan, made_for=_made_for(args, seq)), how


def run_seq(
    args: argparse.Namespace,
    model: torch.nn.Module,
    config: Any,
    seq: int,
    device: torch.device,
    files: ResultFiles,
) -> None:
    """Every measurement at one sequence length, flushed to ``files`` as it comes."""
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (args.batch, seq), generator=generator).to(device)
    run: dict[str, Any] = {
        "seq": seq,
        "batch": args.batch,
        "plan": _plan(args, config, seq, device),
    }
    run["modes"] = {}
    predictions, budget, budget_how = {}, None, {}
    if any(name in PLANNED_MODES for name in args.modes):
        trace, baseline = _bench_step(args, config, seq, device)
        if BUDGET in args.modes:
            without_swap = baseline.timeline.peak_bytes
            budget, budget_how = _budget_swap(args, config, seq, device, without_swap)
        predictions = _predictions(args, config, trace, baseline, budget)
    files.result["runs"].append(run)
    auto = _auto_swap(args, config, seq, device) if AUTO in args.modes else None
    plans = {AUTO: auto, BUDGET: budget}
    modes = [Mode(name, model, device, plans.get(name)) for name in args.modes]
    _untimed_steps(modes, ids, run, files, predictions)
    if auto is not None:
        from graphswap.train.reports import auto_verdict

        offloaded = run["modes"][AUTO]["verify"]["counters"]["offloaded_bytes"]
        run["auto_plan"] = {
            "swapped_bytes": auto.plan.swapped_bytes,
            "verdict": auto_verdict(auto.plan.to_dict()),
            "offloaded_bytes": offloaded,
            "mismatched_tensors": auto.mismatched_tensors,
            "matches_plan": offloaded == auto.plan.swapped_bytes and not auto.mismatched_tensors,
        }
    if budget is not None:
        run["budget_plan"] = _budget_record(budget, budget_how, run)
    _timed_rounds(args, modes, ids, run, files)
    found = targets(run, device=device.type, attn=args.attn)
    run["targets"] = [target.to_dict() for target in found]
    files.flush()
    for target in found:
        print(target.line(), flush=True)


def _budget_record(budget: Any, how: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """The budget plan beside what its verify step did: the bytes it recomputed and
    offloaded against the plan's, and whether its gradients are ``none``'s bit for bit."""
    plan, modes = budget.plan, run["modes"]
    counters = modes[BUDGET]["verify"]["counters"]
    recomputed, offloaded = counters["recomputed_bytes"], counters["offloaded_bytes"]
    digest = modes[BUDGET]["verify"]["grad_digest"]
    return how | {
        "budget_bytes": plan.activation_memory_budget,
        "recompute": list(plan.recompute),
        "swap": plan.budget_swap,
        "swap_offload_lag": plan.swap_offload_lag,
        "predicted_peak_bytes": plan.timeline.peak_bytes,
        "predicted_step_ratio": plan.step_ratio,
        "recomputed_bytes": plan.recomputed_bytes,
        "swapped_bytes": plan.swapped_bytes,
        "measured_recomputed_bytes": recomputed,
        "offloaded_bytes": offloaded,
        "mismatched_tensors": budget.mismatched_tensors,
        "matches_plan": recomputed == plan.recomputed_bytes
        and offloaded == plan.swapped_bytes
        and not budget.mismatched_tensors,
        "gradients_as_none": digest == modes[NONE]["verify"]["grad_digest"]
        if NONE in modes
        else None,
    }


def _untimed_steps(
    modes: list[Mode],
    ids: torch.Tensor,
    run: dict[str, Any],
    files: ResultFiles,
    predictions: dict[str, dict[str, Any]],
) -> None:
    """Verify steps (``none`` twice, to see whether its own kernels are reproducible), then
    resident steps under the tracker; on CUDA, a step that finds the label of the peak."""
    run["none_reproducible"] = True
    for mode in modes:
        verify = verify_step(mode, ids)
        run["modes"][mode.name] = {
            "verify": verify,
            "prediction": predictions.get(mode.name),
            "measured_peak": None,
            "resident_saved_bytes": None,
            "step_times_s": [],
            "losses": [],
            "peak_allocated_bytes": [],
            "peak_reserved_bytes": [],
        }
        if mode.name == NONE:
            again = verify_step(mode, ids)
            same = (verify["loss"], verify["grad_digest"]) == (again["loss"], again["grad_digest"])
            run["none_reproducible"] = same
        files.flush()
    for mode in modes:
        run["modes"][mode.name]["resident_saved_bytes"] = resident_step(mode, ids)
        files.flush()
    for mode in modes:
        if mode.device.type == "cuda":
            run["modes"][mode.name]["measured_peak"] = peak_step(mode, ids)
            files.flush()
    if NONE in run["modes"] and ATTENTION in run["modes"]:
        saved = run["modes"][NONE]["resident_saved_bytes"]
        moved = run["modes"][ATTENTION]["verify"]["counters"]["offloaded_bytes"]
        run["attention_share"] = moved / saved if saved else None


def _timed_rounds(
    args: argparse.Namespace,
    modes: list[Mode],
    ids: torch.Tensor,
    run: dict[str, Any],
    files: ResultFiles,
) -> None:
    """Warm-up rounds, then ``args.steps`` rounds of one plain step per mode."""
    for rep in range(args.warmup + args.steps):
        for mode in modes:
            with mode.installed():
                sample = plain_step(mode.model, ids, mode.device)
            if rep < args.warmup:
                continue
            record = run["modes"][mode.name]
            record["step_times_s"].append(sample["seconds"])
            record["losses"].append(sample["loss"])
            if sample["peak_allocated_bytes"] is not None:
                record["peak_allocated_bytes"].append(sample["peak_allocated_bytes"])
                record["peak_reserved_bytes"].append(sample["peak_reserved_bytes"])
            record["summary"] = _summary(record["step_times_s"])
            files.flush()
        if rep >= args.warmup:
            print(f"seq {run['seq']}: round {rep - args.warmup + 1}/{args.steps} timed", flush=True)


@contextmanager
def attention_kernel(model: torch.nn.Module, kernel: str) -> Iterator[None]:
    """Run ``model`` with ``kernel``: ``eager``, or sdpa restricted to one backend."""
    original = model.config._attn_implementation
    if kernel == "eager":
        model.set_attn_implementation("eager")
        context: Any = nullcontext()
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        model.set_attn_implementation("sdpa")
        context = sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[kernel])])
    try:
        with context:
            yield
    finally:
        model.set_attn_implementation(original)


def kernel_shares(
    args: argparse.Namespace,
    model: torch.nn.Module,
    config: Any,
    device: torch.device,
    files: ResultFiles,
) -> None:
    """Per attention kernel: what share of all saved activation bytes the attention swap moves."""
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.share_seq), generator=generator).to(
        device
    )
    none, attention = Mode(NONE, model, device), Mode(ATTENTION, model, device)
    shares = files.result["kernel_shares"] = []
    for kernel in args.share_kernels:
        row: dict[str, Any] = {"kernel": kernel, "seq": args.share_seq}
        shares.append(row)
        try:
            with attention_kernel(model, kernel):
                total = resident_step(none, ids)
                moved = verify_step(attention, ids)["counters"]
        except RuntimeError as error:
            # A backend this device, dtype or shape cannot run ("No available kernel").
            row["error"] = "unavailable: " + str(error).strip().splitlines()[0][:120]
            model.zero_grad(set_to_none=True)
        else:
            row.update(
                total_saved_bytes=total,
                offloaded_bytes=moved["offloaded_bytes"],
                kept_bytes=moved["kept_bytes"],
                share=moved["offloaded_bytes"] / total if total else 0.0,
            )
        files.flush()
        outcome = row.get("error") or f"{100 * row['share']:.1f}% moved"
        print(f"kernel {kernel} at seq {args.share_seq}: {outcome}", flush=True)


def device_tag(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "")
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # The machine's load when the run starts (1, 5, 15 minutes): other jobs on a shared
        # machine move every figure in microseconds.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--seq", type=int, nargs="+", help="default: 8192 on CUDA, 512 on CPU")
    parser.add_argument("--batch", type=int, help="default: 1 on CUDA, 2 on CPU")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--steps",
        type=int,
        help=f"timed steps per mode (default: 20; --overhead: {OverheadConfig.steps})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        help=f"untimed rounds first (default: 2; --overhead: {OverheadConfig.warmup})",
    )
    parser.add_argument("--preset", help="default: qwen3-30b-a3b on CUDA, tiny on CPU")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), help="default: bf16 on CUDA, fp32 on CPU"
    )
    parser.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--share-seq",
        type=int,
        help="sequence length of the per-kernel shares (default: "
        "2048 on CUDA, where eager and math still fit at 8 layers; the first --seq on CPU)",
    )
    parser.add_argument(
        "--share-kernels",
        nargs="*",
        help="attention kernels to measure shares for; none given: skip (default: "
        + "; ".join(f"{d}: {' '.join(k)}" for d, k in KERNELS.items())
        + ")",
    )
    parser.add_argument("--tag", help="appended to the file names: bench-swap-<device>-<tag>.json")
    auto = parser.add_argument_group("the auto and budget modes: their plans' link model")
    auto.add_argument("--swap-bandwidth", type=float, default=50.0, help="host link GB/s")
    auto.add_argument("--swap-tflops", type=float, default=400.0, help="compute TFLOP/s")
    auto.add_argument("--swap-hide-margin", type=float, default=0.1)
    auto.add_argument(
        "--budget-fraction",
        type=float,
        default=0.7,
        help="the budget mode plans within this fraction of the predicted peak without swap "
        "of the bench's step (the smallest peak any plan reaches, where none meets it)",
    )
    overhead = parser.add_argument_group("--overhead: host time per swapped tensor")
    overhead.add_argument("--overhead", action="store_true", help="run only this measurement")
    overhead.add_argument("--blocks", type=int, default=OverheadConfig.blocks)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.steps is None:
        args.steps = OverheadConfig.steps if args.overhead else 20
    if args.warmup is None:
        args.warmup = OverheadConfig.warmup if args.overhead else 2
    args.seq = args.seq or [8192 if cuda else 512]
    args.batch = args.batch or (1 if cuda else 2)
    args.preset = args.preset or ("qwen3-30b-a3b" if cuda else "tiny")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.share_seq = args.share_seq or (2048 if cuda else args.seq[0])
    if args.share_kernels is None:
        args.share_kernels = list(KERNELS["cuda" if cuda else "cpu"])
    unknown = sorted(set(args.share_kernels) - {"eager", *SDPA_BACKENDS})
    if unknown:
        parser.error(
            f"--share-kernels: unknown {', '.join(unknown)}; choose from eager, "
            + ", ".join(SDPA_BACKENDS)
        )
    for name in ("steps", "layers", "batch", "share_seq", "blocks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.budget_fraction <= 1:
        parser.error(f"--budget-fraction must be in (0, 1], got {args.budget_fraction}")
    if args.warmup < 0 or min(args.seq) < 1:
        parser.error("--warmup must be >= 0 and every --seq >= 1")
    return args


def _prepare(device: torch.device) -> None:
    """Deterministic kernels, so that identical gradients across modes can be checked."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "error: --device cuda but torch sees no CUDA device; use --device cpu", file=sys.stderr
        )
        return 2
    date = datetime.date.today().isoformat()
    benchmark = "swap-overhead" if args.overhead else "bench-swap"
    stem = args.out_dir / "-".join(filter(None, (benchmark, device_tag(device), args.tag)))
    if args.overhead:
        return _main_overhead(args, device, stem, date)
    _prepare(device)
    from graphswap.hf.checkpoints import build_model
    from graphswap.hf.presets import qwen3_moe_config

    config = qwen3_moe_config(
        args.preset, attn_implementation=args.attn, num_hidden_layers=args.layers
    )
    torch.manual_seed(args.seed)
    model = build_model(config, device=device, dtype=getattr(torch, args.dtype)).train()
    # What exists now (modules, parameters, imported code) is never garbage: keep the
    # collector's full passes, which would land on one mode's step only, short.
    gc.collect()
    gc.freeze()
    files = ResultFiles(
        stem,
        {
            "date": date,
            "environment": environment(device),
            "config": {
                key: getattr(args, key)
                for key in ("preset", "layers", "dtype", "attn", "batch", "steps", "warmup", "seed")
            }
            | {"modes": args.modes},
            "runs": [],
        },
    )
    files.flush()
    for seq in args.seq:
        run_seq(args, model, config, seq, device, files)
    if args.share_kernels:
        kernel_shares(args, model, config, device, files)
    print(to_markdown(files.result))
    print(f"wrote {stem}.json and {stem}.md")
    return 0


def _main_overhead(args: argparse.Namespace, device: torch.device, stem: Path, date: str) -> int:
    if device.type == "cpu":
        # The blocks' matmuls are far too small for a second thread; OpenMP threads spinning
        # against other processes would measure the machine's load, not the hooks.
        torch.set_num_threads(1)
    config = OverheadConfig(
        blocks=args.blocks, steps=args.steps, warmup=args.warmup, seed=args.seed
    )
    head = {"date": date, "environment": environment(device)}
    stem.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict[str, Any]) -> None:
        write_whole(stem.with_suffix(".json"), json.dumps(head | result, indent=2) + "\n")
        write_whole(stem.with_suffix(".md"), overhead_markdown(head | result))

    result = measure_overhead(config, device, on_round=save)
    print(overhead_table(result))
    print(target_line(result))
    print(bookkeeping_line(result))
    print(calls_line(result))
    print(f"wrote {stem}.json and {stem}.md")
    return 0


def overhead_markdown(result: dict[str, Any]) -> str:
    """The ``--overhead`` report: when and where it ran, its table and its targets."""
    env, cfg = result["environment"], result["config"]
    turn = (
        f", each mode {cfg['in_a_row']} steps a turn, the last {cfg['in_a_row'] - cfg['settle']}"
        " timed"
        if "in_a_row" in cfg
        else ""
    )
    targets = (target_line(result), bookkeeping_line(result), calls_line(result))
    lines = [
        f"# Host time per swapped tensor: {env['device_name']}, {result['date']}",
        "",
        f"`tools/bench_swap.py --overhead`: {cfg['blocks']} wrapped `Linear({cfg['width']}) +"
        f" ReLU` blocks; {cfg['steps']} timed steps per mode after {cfg['warmup']} warm-up"
        f" turns{turn}. torch {env['torch']}, Python {env['python']}, {env['cpu_count']} CPUs,"
        f" {env['torch_threads']} torch thread(s){when_and_load(env)}.",
        "",
        overhead_table(result),
        "",
        *(f"- {line.removeprefix('TARGET ')}" for line in targets),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
