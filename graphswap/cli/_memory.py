"""``graphswap plan-memory``: what activation swap saves on a model, predicted without a GPU.

The model is built and traced on the meta device (see ``graphswap.planner``), so a
235B-parameter config costs neither memory nor a download.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from graphswap.cli._args import positive_float, positive_int

if TYPE_CHECKING:
    from graphswap.planner import MemoryPlan

DTYPES = ("bfloat16", "float16", "float32")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
DEVICES = ("cuda", "cpu")
KERNELS = ("flash", "efficient", "cudnn", "math")
POLICIES = ("attention", "layer", "auto")
"""Literal here so that ``--help`` imports no torch; the planner checks the same names."""

_FLAGS = {
    "seq": "--seq",
    "batch": "--batch",
    "bandwidth_gbps": "--bandwidth",
    "tflops": "--tflops",
    "attn_implementation": "--attn-implementation",
    "device": "--device",
    "attn_kernel": "--attn-kernel",
    "tp": "--tp",
    "swap": "--policy",
    "hide_margin": "--hide-margin",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    # Deferred so that `graphswap --help` does not load torch (see graphswap.cli).
    from graphswap.presets import preset_names

    parser = subparsers.add_parser(
        "plan-memory",
        help="predict per-layer saved activations and what swap saves (no GPU needed)",
        description=(
            "Trace one forward pass of a Qwen3-MoE model on the meta device, attribute every "
            "tensor autograd saves to its decoder layer, and predict the peak saved-activation "
            "memory with and without swap, and whether each prefetch hides behind backward "
            "compute. Attention runs the kernel the training device runs; with --tp the "
            "prediction is one rank's. --policy auto shows what activation_swap: auto would "
            "swap: per layer the saved tensors whose copy hides."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model", metavar="DIR", help="local Hugging Face checkpoint folder (config.json only)"
    )
    source.add_argument("--preset", choices=preset_names(), help="embedded model shape")
    parser.add_argument("--seq", type=positive_int, required=True, metavar="N", help="tokens")
    parser.add_argument("--batch", type=positive_int, default=1, metavar="B")
    parser.add_argument(
        "--layers", type=positive_int, metavar="N", help="override the number of decoder layers"
    )
    parser.add_argument(
        "--bandwidth",
        type=positive_float,
        default=None,
        metavar="GBPS",
        help="host link bandwidth per direction in GB/s (default 50)",
    )
    parser.add_argument(
        "--tflops",
        type=positive_float,
        default=None,
        metavar="T",
        help="sustained compute in TFLOP/s used for layer time (default 400)",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument(
        "--attn-implementation",
        choices=ATTN_IMPLEMENTATIONS,
        default="sdpa",
        help="Hugging Face attention: sdpa (default, fused kernels) or eager (saves the "
        "seq x seq probabilities)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cuda",
        help="device the training runs on, which decides the sdpa kernel (default cuda)",
    )
    parser.add_argument(
        "--attn-kernel",
        choices=KERNELS,
        default=None,
        help="sdpa kernel to trace; on cuda: flash (default for bfloat16/float16), efficient "
        "(default for float32, which flash and cudnn cannot run), cudnn, math; on cpu: flash "
        "(default) or math",
    )
    parser.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks (attention heads sharded as graphswap train tp_size=N "
        "shards them): predict one rank's bytes (default 1)",
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="attention",
        help="what is swapped: attention (default), layer (every tensor of the decoder layer "
        "the size policy swaps) or auto (per layer, largest first, the tensors whose copy "
        "fits in the backward it overlaps, less --hide-margin)",
    )
    parser.add_argument(
        "--hide-margin",
        type=float,
        default=None,
        metavar="M",
        help="--policy auto: share of each overlap left free of copies, in [0, 1) (default 0.1)",
    )
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument(
        "--plot", metavar="FILE.png", help="also draw the memory timeline (needs matplotlib)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Deferred so that `graphswap --help` does not load torch (see graphswap.cli).
    import torch

    from graphswap.hf import CheckpointError, model_config
    from graphswap.planner import (
        DEFAULT_BANDWIDTH_GBPS,
        DEFAULT_HIDE_MARGIN,
        DEFAULT_TFLOPS,
        PlanSettingError,
        plan_memory,
    )

    if args.hide_margin is not None and args.policy != "auto":
        print(
            f"error: --hide-margin {args.hide_margin} applies to --policy auto only (it would "
            f"change nothing for --policy {args.policy}); add --policy auto or drop it",
            file=sys.stderr,
        )
        return 2

    try:
        config = model_config(
            args.preset,
            args.model,
            attn_implementation=args.attn_implementation,
            num_layers=args.layers,
        )
    except CheckpointError as error:
        print(f"graphswap plan-memory: error: --model {args.model}: {error}", file=sys.stderr)
        return 2
    try:
        plan = plan_memory(
            config,
            seq=args.seq,
            batch=args.batch,
            bandwidth_gbps=args.bandwidth or DEFAULT_BANDWIDTH_GBPS,
            tflops=args.tflops or DEFAULT_TFLOPS,
            dtype=getattr(torch, args.dtype),
            attn_implementation=args.attn_implementation,
            device=args.device,
            attn_kernel=args.attn_kernel,
            tp=args.tp,
            swap=args.policy,
            hide_margin=DEFAULT_HIDE_MARGIN if args.hide_margin is None else args.hide_margin,
        )
    except PlanSettingError as error:
        flag = _FLAGS.get(error.setting, error.setting)
        print(f"error: {flag} {error.value}: {error.detail}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            plot_timeline(plan, Path(args.plot))
        except ModuleNotFoundError as error:
            if error.name != "matplotlib":
                raise
            print(
                f"error: --plot {args.plot} needs matplotlib, which is not installed; "
                "install it with: pip install graphswap[plot]",
                file=sys.stderr,
            )
            return 2
    if args.format == "json":
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan.format_table())
        if args.plot:
            print(f"timeline written to {args.plot}")
    return 0


def plot_timeline(plan: MemoryPlan, path: Path) -> None:
    """Resident saved bytes through one step, with and without swap."""
    import matplotlib  # optional (the plot extra): needed only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = plan.timeline()
    gib = float(1 << 30)
    xs = range(len(points))
    fig, ax = plt.subplots(figsize=(max(8.0, len(points) * 0.08), 4.5))
    ax.plot(xs, [p.without_swap_bytes / gib for p in points], label="without swap")
    ax.plot(xs, [p.with_swap_bytes / gib for p in points], label=f"with {plan.swap} swap")
    step = max(1, len(points) // 24)
    ax.set_xticks(list(xs)[::step], [p.label for p in points][::step], rotation=90)
    ax.set_xlabel("forward (F<i>) then backward (B<i>) of each decoder layer")
    ax.set_ylabel("saved activations on device [GiB]")
    kernel = "" if plan.attn_kernel is None else f" ({plan.device} {plan.attn_kernel})"
    ax.set_title(
        f"seq={plan.seq} batch={plan.batch} {plan.dtype} {plan.attn_implementation}{kernel} "
        f"tp={plan.tp}"
    )
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
