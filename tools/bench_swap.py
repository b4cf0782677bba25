"""Benchmark activation swap against no swap and PyTorch's ``save_on_cpu``, side by side.

One model, one seed, one input batch. Every mode is installed on the same model in
turn and the modes are interleaved across repetitions (A B C A B C ...), so machine
noise hits all of them alike. A step is zero-grad + forward + backward with no
optimizer update: every step of every mode must then produce the same loss and the
same gradients, which the run checks. Memory is measured in a dedicated, untimed
step per mode: on CUDA the allocator's peak; everywhere, the bytes of activations
still held on the compute device at the end of forward, counted by an independent
tracker (``graphswap.measure``), never by graphswap's own stats.

    python tools/bench_swap.py                       # tiny fp32 model on CPU
    python tools/bench_swap.py --device cuda --seq 4096 8192 --whole-layer
    python tools/bench_swap.py --modes none graphswap_layer graphswap_auto --swap-bandwidth 2

``graphswap_layer`` swaps every decoder layer's saved tensors (rule
``qwen3_moe_layer_swap``); ``graphswap_auto`` swaps, per layer, what the planner says
the link hides at ``--swap-bandwidth`` GB/s and ``--swap-tflops`` (``activation_swap:
auto``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphswap.measure import ResidentActivationTracker, output_tensors

NONE, GRAPHSWAP, SAVE_ON_CPU, GRAPHSWAP_LAYER, GRAPHSWAP_AUTO = (
    "none",
    "graphswap",
    "save_on_cpu",
    "graphswap_layer",
    "graphswap_auto",
)
CPU_STEP_RATIO_TARGET = 1.10
CPU_REDUCTION_TARGET = 0.99
PLAN_TOLERANCE = 0.05


@dataclass
class ModeResult:
    step_times_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_sq_sum: float = 0.0
    resident_saved_bytes: int = 0
    device_peak_bytes: int | None = None
    bytes_offloaded: int = 0
    bytes_reloaded: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    peak_host_bytes: int = 0

    def summary(self) -> dict[str, Any]:
        times = sorted(self.step_times_s)
        quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        return {
            "median_step_s": statistics.median(times),
            "p25_step_s": quartiles[0],
            "p75_step_s": quartiles[2],
            "min_step_s": times[0],
            "max_step_s": times[-1],
            "step_times_s": self.step_times_s,
            "losses": self.losses,
            "grad_sq_sum": self.grad_sq_sum,
            "resident_saved_bytes": self.resident_saved_bytes,
            "device_peak_bytes": self.device_peak_bytes,
            "bytes_offloaded": self.bytes_offloaded,
            "bytes_reloaded": self.bytes_reloaded,
            "prefetch_hits": self.prefetch_hits,
            "prefetch_misses": self.prefetch_misses,
            "peak_host_bytes": self.peak_host_bytes,
        }


class _CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """``save_on_cpu`` that counts the bytes its pack hook really copied."""

    def __init__(self, counter: list[int], *, pin_memory: bool) -> None:
        super().__init__(pin_memory=pin_memory)
        pack = self.pack_hook

        def counting_pack(t: torch.Tensor) -> Any:
            device, packed = pack(t)
            if packed.untyped_storage()._cdata != t.untyped_storage()._cdata:
                counter[0] += t.numel() * t.element_size()
            return device, packed

        self.pack_hook = counting_pack


class Mode:
    """Installs one way of saving activations on the model, and takes it off again."""

    def __init__(
        self, name: str, model: torch.nn.Module, device: torch.device, auto: Any = None
    ) -> None:
        self.name = name
        self.model = model
        self.device = device
        self.manager: Any = None
        self.copied = [0]
        self.auto = auto if name == GRAPHSWAP_AUTO else None
        if name in (GRAPHSWAP, GRAPHSWAP_LAYER, GRAPHSWAP_AUTO):
            from graphswap.runtime import SwapManager

            self.manager = SwapManager()

    def _targets(self) -> list[tuple[str, torch.nn.Module]]:
        layers = self.model.model.layers
        if self.name == GRAPHSWAP_LAYER:
            return [(f"model.layers.{i}", layer) for i, layer in enumerate(layers)]
        return [(f"model.layers.{i}.self_attn", layer.self_attn) for i, layer in enumerate(layers)]

    @contextmanager
    def installed(self) -> Iterator[None]:
        if self.name == NONE:
            yield
            return
        if self.auto is not None:
            from graphswap.rewrite import rewrite, unrewrite

            rewrite(self.model, [self.auto.rule()], manager=self.manager)
            try:
                yield
            finally:
                unrewrite(self.model)
            return
        targets = [module for _, module in self._targets()]
        if self.manager is not None:
            from graphswap.runtime import swap_wrapper, unwrap_swap

            for name, module in self._targets():
                swap_wrapper(module, manager=self.manager, name=name)
            for prev, nxt in itertools.pairwise(targets):
                self.manager.set_forward_prefetch_layer(prev, nxt)
            try:
                yield
            finally:
                for module in targets:
                    unwrap_swap(module)
            return
        for module in targets:
            module.forward = self._under_save_on_cpu(module.forward)
        try:
            yield
        finally:
            for module in targets:
                del module.forward

    def _under_save_on_cpu(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        pin = self.device.type == "cuda"

        def run(*args: Any, **kwargs: Any) -> Any:
            with _CountingSaveOnCpu(self.copied, pin_memory=pin):
                return forward(*args, **kwargs)

        return run

    def reset_counters(self) -> None:
        self.copied[0] = 0
        if self.manager is not None:
            self.manager.reset_stats()

    def record_counters(self, result: ModeResult) -> None:
        if self.manager is None:
            result.bytes_offloaded = self.copied[0]
            return
        stats = self.manager.stats
        result.bytes_offloaded = stats.offloaded_bytes
        result.bytes_reloaded = stats.reloaded_bytes
        result.prefetch_hits = stats.prefetch_hits
        result.prefetch_misses = stats.prefetch_misses
        result.peak_host_bytes = stats.peak_host_bytes

    def finish_offloads(self) -> None:
        if self.manager is not None:
            self.manager.synchronize()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(
    model: torch.nn.Module, ids: torch.Tensor, device: torch.device
) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    _sync(device)
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    _sync(device)
    return time.perf_counter() - start, loss.item()


def memory_step(mode: Mode, ids: torch.Tensor, result: ModeResult) -> None:
    """Untimed: resident saved bytes at the end of forward, CUDA peak, copy counters."""
    model, device = mode.model, mode.device
    model.zero_grad(set_to_none=True)
    mode.reset_counters()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    tracker = ResidentActivationTracker(device)
    with tracker.track():
        out = model(input_ids=ids, labels=ids, use_cache=False)
    mode.finish_offloads()
    _sync(device)
    result.resident_saved_bytes = tracker.resident_bytes(output_tensors(out))
    out.loss.backward()
    _sync(device)
    if device.type == "cuda":
        result.device_peak_bytes = torch.cuda.max_memory_allocated(device)
    result.losses.append(out.loss.item())
    result.grad_sq_sum = sum(
        float(p.grad.float().pow(2).sum()) for p in model.parameters() if p.grad is not None
    )
    mode.record_counters(result)
    del out


def run_one(args: argparse.Namespace, seq: int, device: torch.device) -> dict[str, Any]:
    from graphswap.models import build_model
    from graphswap.planner import plan_memory
    from graphswap.presets import qwen3_moe_config

    dtype = getattr(torch, args.dtype)
    config = qwen3_moe_config(
        args.preset, attn_implementation=args.attn, num_hidden_layers=args.layers
    )
    torch.manual_seed(args.seed)
    model = build_model(config, device=device, dtype=dtype).train()
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (args.batch, seq), generator=generator).to(device)

    auto = _auto_swap(args, config, seq, dtype, device) if GRAPHSWAP_AUTO in args.modes else None
    modes = [Mode(name, model, device, auto) for name in args.modes]
    results = {mode.name: ModeResult() for mode in modes}
    for mode in modes:
        with mode.installed():
            memory_step(mode, ids, results[mode.name])
    for rep in range(args.warmup + args.steps):
        for mode in modes:
            with mode.installed():
                seconds, loss = timed_step(model, ids, device)
            if rep >= args.warmup:
                results[mode.name].step_times_s.append(seconds)
                results[mode.name].losses.append(loss)

    plan = plan_memory(
        config, seq=seq, batch=args.batch, dtype=dtype, attn_implementation=args.attn
    )
    summaries = {name: result.summary() for name, result in results.items()}
    all_losses = {loss for s in summaries.values() for loss in s["losses"]}
    grads = {s["grad_sq_sum"] for s in summaries.values()}
    report: dict[str, Any] = {
        "seq": seq,
        "batch": args.batch,
        "modes": summaries,
        "losses_identical": len(all_losses) == 1,
        "gradients_identical": len(grads) == 1,
        "ratios_vs_none": _ratios(summaries) if NONE in summaries else {},
        "plan": {
            "total_saved_bytes": plan.total_saved_bytes,
            "swapped_bytes": plan.swapped_bytes,
            "end_of_forward_with_swap_bytes": plan.end_of_forward_with_swap_bytes,
            "peak_with_swap_bytes": plan.peak_with_swap_bytes,
        },
    }
    if auto is not None:
        report["auto_plan"] = {
            "swapped_bytes": auto.plan.swapped_bytes,
            "layer_swappable_bytes": auto.plan.layer_swappable_bytes,
            "verdict": auto.plan.auto_verdict(),
            "mismatched_tensors": auto.mismatched_tensors,
        }
    report["checks"] = _checks(report, device)
    return report


def _auto_swap(
    args: argparse.Namespace, config: Any, seq: int, dtype: torch.dtype, device: torch.device
) -> Any:
    """The ``auto`` plan for this run's shape and kernel, at the given link and compute."""
    from graphswap.auto_swap import AutoSwap
    from graphswap.planner import plan_memory

    plan = plan_memory(
        config,
        seq=seq,
        batch=args.batch,
        dtype=dtype,
        attn_implementation=args.attn,
        device="cuda" if device.type == "cuda" else "cpu",
        bandwidth_gbps=args.swap_bandwidth,
        tflops=args.swap_tflops,
        swap="auto",
        hide_margin=args.swap_hide_margin,
    )
    made_for = f"--seq {seq}, --batch {args.batch}, --dtype {args.dtype}, --attn {args.attn}"
    return AutoSwap(plan, made_for=made_for)


def _ratios(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    base = summaries[NONE]
    ratios: dict[str, dict[str, float | None]] = {}
    for name, s in summaries.items():
        peak = s["device_peak_bytes"]
        ratios[name] = {
            "median_step": s["median_step_s"] / base["median_step_s"],
            "resident_saved": s["resident_saved_bytes"] / max(base["resident_saved_bytes"], 1),
            "device_peak": None if peak is None else peak / base["device_peak_bytes"],
        }
    return ratios


def _checks(report: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The issue's targets, as measured: does each hold in this run?"""
    modes, plan = report["modes"], report["plan"]
    checks: dict[str, Any] = {
        "losses_identical": report["losses_identical"],
        "gradients_identical": report["gradients_identical"],
    }
    if GRAPHSWAP_AUTO in modes:
        planned = report["auto_plan"]
        offloaded = modes[GRAPHSWAP_AUTO]["bytes_offloaded"]
        checks["auto_offloaded_vs_plan"] = {
            "ratio": offloaded / max(planned["swapped_bytes"], 1),
            "holds": offloaded == planned["swapped_bytes"] and not planned["mismatched_tensors"],
        }
    if NONE not in modes:
        return checks
    measured = modes[NONE]["resident_saved_bytes"]
    deviation = abs(measured - plan["total_saved_bytes"]) / max(plan["total_saved_bytes"], 1)
    checks["plan_vs_measured_no_swap"] = {
        "deviation": deviation,
        "holds": deviation <= PLAN_TOLERANCE,
    }
    if GRAPHSWAP in modes:
        reduction = measured - modes[GRAPHSWAP]["resident_saved_bytes"]
        fraction = reduction / max(plan["swapped_bytes"], 1)
        checks["resident_reduction_of_swappable"] = {
            "fraction": fraction,
            "target": CPU_REDUCTION_TARGET,
            "holds": fraction >= CPU_REDUCTION_TARGET,
        }
        if device.type == "cpu":
            ratio = report["ratios_vs_none"][GRAPHSWAP]["median_step"]
            checks["cpu_step_time_ratio"] = {
                "ratio": ratio,
                "target": CPU_STEP_RATIO_TARGET,
                "holds": ratio <= CPU_STEP_RATIO_TARGET,
            }
    return checks


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
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


def to_markdown(result: dict[str, Any]) -> str:
    env, cfg = result["environment"], result["config"]
    lines = [
        f"# Activation swap benchmark: {env['device_name']}, {result['date']}",
        "",
        f"Model: preset `{cfg['preset']}`, {cfg['layers']} layers, {cfg['dtype']}, "
        f"attention `{cfg['attn']}`; {cfg['steps']} timed steps per mode after "
        f"{cfg['warmup']} warm-up, interleaved; a step is forward + backward, no update. "
        f"torch {env['torch']}, transformers {env['transformers']}, {env['cpu_count']} CPUs.",
        "Resident = bytes of activations still on the compute device at the end of forward "
        "(independent tracker, after pending offloads finished). Ratios are against `none` "
        "from the same run.",
    ]
    for run in result["runs"]:
        lines += [
            "",
            f"## seq {run['seq']}, batch {run['batch']}",
            "",
            "| mode | median step ms | p25-p75 ms | step ratio | resident MiB | resident ratio "
            "| device peak MiB | offloaded MiB | reloaded MiB | prefetch hit/miss | loss |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, s in run["modes"].items():
            r = run["ratios_vs_none"].get(name, {})
            lines.append(
                f"| {name} | {s['median_step_s'] * 1e3:.1f} | "
                f"{s['p25_step_s'] * 1e3:.1f}-{s['p75_step_s'] * 1e3:.1f} | "
                f"{r.get('median_step', float('nan')):.3f} | {_mib(s['resident_saved_bytes'])} | "
                f"{r.get('resident_saved', float('nan')):.3f} | {_mib(s['device_peak_bytes'])} | "
                f"{_mib(s['bytes_offloaded'])} | {_mib(s['bytes_reloaded'])} | "
                f"{s['prefetch_hits']}/{s['prefetch_misses']} | {s['losses'][0]:.6f} |"
            )
        plan = run["plan"]
        lines += [
            "",
            f"Planner (`graphswap plan-memory`): total saved "
            f"{_mib(plan['total_saved_bytes'])} MiB, "
            f"swappable outside the kept last layer {_mib(plan['swapped_bytes'])} MiB, "
            f"end of forward with swap {_mib(plan['end_of_forward_with_swap_bytes'])} MiB.",
            "",
            "save_on_cpu runs with pin_memory only on CUDA; without it, on a CPU device, "
            "`.cpu()` returns the tensor itself, so it moves and frees nothing there.",
            "",
            "Checks: "
            + "; ".join(f"{key}: {_check_text(value)}" for key, value in run["checks"].items()),
        ]
    return "\n".join(lines) + "\n"


def _check_text(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    number = next(v for k, v in value.items() if k not in ("holds", "target"))
    target = f" (target {value['target']})" if "target" in value else ""
    return f"{number:.4f}{target} {'holds' if value['holds'] else 'FAILS'}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--seq", type=int, nargs="+", help="default: 512 on CPU, 4096 on CUDA")
    parser.add_argument("--batch", type=int, help="default: 2 on CPU, 1 on CUDA")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode")
    parser.add_argument("--preset", help="default: tiny on CPU, qwen3-30b-a3b on CUDA")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), help="default: fp32 CPU, bf16 CUDA"
    )
    parser.add_argument("--attn", default="eager", help="attention implementation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--modes",
        nargs="+",
        default=[NONE, GRAPHSWAP, SAVE_ON_CPU],
        choices=(NONE, GRAPHSWAP, SAVE_ON_CPU, GRAPHSWAP_LAYER, GRAPHSWAP_AUTO),
    )
    parser.add_argument(
        "--swap-bandwidth", type=float, default=50.0, help="graphswap_auto: host link GB/s"
    )
    parser.add_argument(
        "--swap-tflops", type=float, default=400.0, help="graphswap_auto: compute TFLOP/s"
    )
    parser.add_argument(
        "--swap-hide-margin", type=float, default=0.1, help="graphswap_auto: margin in [0, 1)"
    )
    parser.add_argument("--whole-layer", action="store_true", help="also swap whole layers")
    parser.add_argument("--tag", help="appended to the file names: <device>-<date>-<tag>.json")
    args = parser.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    args.seq = args.seq or [4096 if cuda else 512]
    args.batch = args.batch or (1 if cuda else 2)
    args.preset = args.preset or ("qwen3-30b-a3b" if cuda else "tiny")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.whole_layer and GRAPHSWAP_LAYER not in args.modes:
        args.modes.append(GRAPHSWAP_LAYER)
    for name in ("steps", "layers", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or min(args.seq) < 1:
        parser.error("--warmup must be >= 0 and every --seq >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(
                "error: --device cuda but torch sees no CUDA device; use --device cpu",
                file=sys.stderr,
            )
            return 2
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    date = datetime.date.today().isoformat()
    result = {
        "date": date,
        "environment": environment(device),
        "config": {
            key: getattr(args, key)
            for key in ("preset", "layers", "dtype", "attn", "steps", "warmup", "seed", "modes")
        },
        "runs": [run_one(args, seq, device) for seq in args.seq],
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / "-".join(filter(None, (device_tag(device), date, args.tag)))
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = to_markdown(result)
    stem.with_suffix(".md").write_text(markdown)
    print(markdown)
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
