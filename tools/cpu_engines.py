"""Which copy engine CPU tensors get by default: a training step over each, measured.

The tiny Qwen3-MoE preset (sdpa), every decoder layer swap-wrapped and linked (the
``layer`` layout, ``swap_large_activations``), zero-grad + forward + backward on CPU,
one thread. Three modes are interleaved step by step in one process: no swap, graphswap
over the no-op device (``NoOpAccelerator``) and over the simulated one
(``SimulatedAccelerator(lag=0)``, which tracks every ordering hazard). It prints the
median step of each, what each engine adds to the step and per swapped tensor, and
checks that both engines give the gradients of the step without swap, bit for bit.

    python tools/cpu_engines.py [--layers 4] [--seq 512] [--steps 30]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import qwen3_moe_config
from graphswap.runtime import (
    CopyEngine,
    NoOpAccelerator,
    SwapManager,
    swap_wrapper,
    unwrap_swap,
)
from graphswap.runtime.sim import SimulatedAccelerator

ENGINES: dict[str, Callable[[], CopyEngine]] = {
    "noop": NoOpAccelerator,
    "sim": lambda: SimulatedAccelerator(lag=0),
}


@contextmanager
def layers_swapped(model: torch.nn.Module, manager: SwapManager) -> Iterator[None]:
    layers = list(model.model.layers)
    for i, layer in enumerate(layers):
        swap_wrapper(layer, manager=manager, name=f"model.layers.{i}")
    for prev, nxt in itertools.pairwise(layers):
        manager.link(prev, nxt)
    try:
        yield
    finally:
        for layer in layers:
            unwrap_swap(layer)


def measure(layers: int, seq: int, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    torch.manual_seed(0)
    config = qwen3_moe_config("tiny", attn_implementation="sdpa", num_hidden_layers=layers)
    model = build_model(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    managers = {name: SwapManager(engine=make()) for name, make in ENGINES.items()}
    modes: dict[str, Callable[[], Any]] = {
        "none": nullcontext,
        **{name: lambda m=manager: layers_swapped(model, m) for name, manager in managers.items()},
    }
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    grads: dict[str, list[torch.Tensor]] = {}
    for rep in range(warmup + steps):
        for mode, installed in modes.items():
            with installed():
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                seconds = time.perf_counter() - start
                if mode in managers:
                    # Wrapping starts each layer's counters at zero: this step's swaps.
                    tensors = managers[mode].stats.offloaded_tensors
            if rep >= warmup:
                times[mode].append(seconds)
            grads[mode] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    return {
        "median_step_s": medians,
        "swapped_tensors_per_step": tensors,
        "ms_added": {name: (medians[name] - medians["none"]) * 1e3 for name in managers},
        "us_per_swapped_tensor": {
            name: (medians[name] - medians["none"]) / tensors * 1e6 for name in managers
        },
        "sim_over_noop": medians["sim"] / medians["noop"],
        "same_gradients": all(
            all(torch.equal(a, b) for a, b in zip(grads[name], grads["none"], strict=True))
            for name in managers
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.layers, args.seq, args.batch, args.steps, args.warmup)
    steps = result["median_step_s"]
    print(
        f"tiny Qwen3-MoE, {args.layers} layers, seq {args.seq}, batch {args.batch}:"
        f" {result['swapped_tensors_per_step']} swapped tensors per step; median step"
        f" none {steps['none'] * 1e3:.1f} ms, noop {steps['noop'] * 1e3:.1f} ms, sim"
        f" {steps['sim'] * 1e3:.1f} ms; added: noop {result['ms_added']['noop']:.2f} ms"
        f" ({result['us_per_swapped_tensor']['noop']:.0f} us per tensor), sim"
        f" {result['ms_added']['sim']:.2f} ms ({result['us_per_swapped_tensor']['sim']:.0f}"
        f" us per tensor); sim / noop step {result['sim_over_noop']:.3f}; same gradients:"
        f" {result['same_gradients']}"
    )
    return 0 if result["same_gradients"] else 1


if __name__ == "__main__":
    sys.exit(main())
