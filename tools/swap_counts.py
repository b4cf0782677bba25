"""Python work per swapped tensor, counted rather than timed: independent of the load.

The overhead benchmark's blocks (``swap_overhead``), one warm step traced with
``sys.settrace``: Python calls and bytecodes, graphswap's minus ``bare_copy``'s, per
swapped tensor, split by the hook or call that ran them (pack, unpack, a handle's
death, the wrapped forward's own work, the module boundaries); and the objects the
collector tracks that a step keeps alive from the end of forward to backward.

    python tools/swap_counts.py
"""

from __future__ import annotations

import collections
import gc
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import FrameType
from typing import Any

import torch
from swap_overhead import OverheadConfig, bare_copy, build_blocks, swapped

from graphswap.runtime import NoOpAccelerator, SwapManager

PHASES = {
    "_pack": "pack hook",
    "_Forward.__call__": "pack hook",
    "_unpack": "unpack hook (reloads included)",
    "unpack_hook": "unpack hook (reloads included)",
    "__del__": "a handle's death (source and buffer release)",
    "_boundary": "module boundaries (lag fence, source release)",
    "_Context.boundary": "module boundaries (lag fence, source release)",
    "_backward_begins": "backward begins (prefetch)",
    "_Forward.backward_begins": "backward begins (prefetch)",
    "run_forward": "wrapped forward's own work",
    "_bare_pack": "bare_copy's hooks (subtracted)",
    "_bare_unpack": "bare_copy's hooks (subtracted)",
}
"""Entry points by qualified or plain code name (the hooks of runtimes before and after
they moved to the forward's record and a plain function; the boundary and the backward
begin as manager methods and as the context's and the forward's): each bytecode counts
for the innermost one running it."""


def _trace(
    model: torch.nn.Module, x: torch.Tensor, installed: Callable[[], AbstractContextManager[Any]]
) -> tuple[collections.Counter[str], collections.Counter[str], int]:
    """Bytecodes and calls of one warm step by phase; objects alive at the end of forward."""
    ops: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    phase_of: dict[FrameType, str] = {}

    def trace(frame: FrameType, event: str, arg: object) -> Callable[..., Any] | None:
        if event == "call":
            code = frame.f_code
            phase = PHASES.get(code.co_qualname) or PHASES.get(code.co_name)
            if phase is None and "/torch/nn/" in frame.f_code.co_filename:
                phase = "other"  # the model's own code, the wrapped forward's included
            if phase is None:
                outer = frame.f_back
                phase = phase_of.get(outer, "other") if outer is not None else "other"
            phase_of[frame] = phase
            calls[phase] += 1
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            return trace
        if event == "opcode":
            ops[phase_of.get(frame, "other")] += 1
        elif event == "return":
            del phase_of[frame]  # a frame kept here would keep its locals alive
        return trace

    with installed():
        for _ in range(3):  # warm: host buffers, events and views exist
            model(x).sum().backward()
        gc.collect()
        previous = sys.gettrace()  # a debugger's or coverage's, put back after each half
        sys.settrace(trace)
        out = model(x)
        sys.settrace(previous)
        gc.collect()
        alive = len(gc.get_objects())
        sys.settrace(trace)
        out.sum().backward()
        sys.settrace(previous)
        del out
        gc.collect()
        alive -= len(gc.get_objects())
    return ops, calls, alive


def count(config: OverheadConfig) -> dict[str, Any]:
    """Per swapped tensor, graphswap over the no-op device above ``bare_copy``."""
    model = build_blocks(config, torch.device("cpu"))
    x = torch.randn(config.rows, config.width)
    manager = SwapManager(keep_last=False, engine=NoOpAccelerator())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # block 0's input is the caller's: copied, not freed
        bare_ops, bare_calls, bare_alive = _trace(model, x, bare_copy)
        ops, calls, alive = _trace(model, x, lambda: swapped(model, manager))
    tensors = manager.stats.offloaded_tensors // 4  # the traced step and three warm ones
    ops.subtract(bare_ops)
    calls.subtract(bare_calls)
    return {
        "swapped_tensors": tensors,
        "bytecodes": sum(ops.values()) / tensors,
        "calls": sum(calls.values()) / tensors,
        "objects_alive_after_forward": (alive - bare_alive) / tensors,
        "bytecodes_by_phase": {p: n / tensors for p, n in ops.most_common()},
        "calls_by_phase": {p: n / tensors for p, n in calls.most_common()},
    }


def main() -> None:
    result = count(OverheadConfig())
    print(
        f"per swapped tensor above bare_copy ({result['swapped_tensors']} a step):"
        f" {result['calls']:.1f} Python calls, {result['bytecodes']:.0f} bytecodes,"
        f" {result['objects_alive_after_forward']:.1f} tracked objects alive from forward"
        " to backward"
    )
    for phase, n in result["bytecodes_by_phase"].items():
        print(f"  {n:7.1f} bytecodes {result['calls_by_phase'].get(phase, 0):5.1f} calls  {phase}")


if __name__ == "__main__":
    main()
