"""Time causal sdpa (forward and backward) against the device profile's TFLOP/s.

The planner times a fused attention kernel on the scores a causal mask leaves, at the
profile's ``tflops`` times ``attention_efficiency``. This measures that share on the
device at hand: the achieved rate of ``F.scaled_dot_product_attention(is_causal=True)``
over the causal FLOPs the planner counts (``graphswap.runtime.profile.causal_share``),
and the rate of a plain matmul beside it, then prints the profile spec that carries the
measured figure (``h200,attention_efficiency=...``) for ``plan-memory --profile``.
With ``--out-dir`` it writes ``attention-speed.json`` there, the date and device inside.

    python tools/attention_speed.py --device cuda --out-dir OUT
    python tools/attention_speed.py --device cpu --seq 256 --repeats 1   (a rehearsal)
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from graphswap.runtime.profile import causal_share, device_profile


def _seconds(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    """The best of ``repeats`` timed runs after a warm-up (CUDA events on a GPU)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - began)
    return best


def measure(
    device: torch.device,
    *,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    repeats: int,
) -> dict[str, float]:
    """Achieved TFLOP/s of causal sdpa forward + backward and of a square matmul."""
    shape = (1, heads, seq, head_dim)
    q = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn(shape, device=device, dtype=dtype)

    def attention() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(grad)

    forward = 4.0 * heads * seq * seq * head_dim * causal_share(seq, seq)
    attention_s = _seconds(attention, device, repeats)
    side = 8192 if device.type == "cuda" else 512
    a = torch.randn(side, side, device=device, dtype=dtype)
    b = torch.randn(side, side, device=device, dtype=dtype)
    matmul_s = _seconds(lambda: torch.mm(a, b), device, repeats)
    return {
        "attention_tflops": 3.5 * forward / attention_s / 1e12,  # backward is 2.5x forward
        "matmul_tflops": 2.0 * side**3 / matmul_s / 1e12,
        "attention_seconds": attention_s,
        "matmul_seconds": matmul_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--profile", default="h200", help="the profile to calibrate")
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device; use --device cpu to rehearse")
    profile = device_profile(args.profile)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for seq in args.seq:
        figures = measure(
            device,
            seq=seq,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype=dtype,
            repeats=args.repeats,
        )
        efficiency = figures["attention_tflops"] / profile.tflops
        rows.append({"seq": seq, **figures, "attention_efficiency": efficiency})
        print(
            f"seq {seq}: causal sdpa forward+backward {figures['attention_tflops']:.1f} TFLOP/s, "
            f"matmul {figures['matmul_tflops']:.1f} TFLOP/s; the profile's {profile.tflops:g} "
            f"TFLOP/s x {efficiency:.3f}"
        )
    efficiency = min(row["attention_efficiency"] for row in rows)
    spec = f"{profile.name},attention_efficiency={efficiency:.3g}"
    rehearsal = "" if device.type == "cuda" else "; a CPU rehearsal, not a figure for a GPU"
    print(
        f"TARGET attention_efficiency: {efficiency:.3g} (causal sdpa on {device.type}, the "
        f"slowest of seq {', '.join(map(str, args.seq))}; plan with --profile {spec}{rehearsal})"
    )
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "dtype": str(dtype).removeprefix("torch."),
            "profile": profile.name,
            "profile_tflops": profile.tflops,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "rows": rows,
            "attention_efficiency": efficiency,
            "profile_spec": spec,
        }
        (args.out_dir / "attention-speed.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
