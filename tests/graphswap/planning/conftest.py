"""Traced steps the planner tests share: a trace is immutable data and takes about a second
to make, so each is made once and planned in every mode and setting a test asks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from graphswap.hf.presets import qwen3_moe_config
from graphswap.planning.saved_tensors import build_meta_model
from graphswap.planning.trace import StepShape, StepTrace, trace_step
from graphswap.runtime.profile import DeviceProfile, device_profile


def _tiny_step(profile: DeviceProfile) -> StepTrace:
    """The tiny Qwen3-MoE (4 layers, sdpa) at batch 2 x seq 512 in float32 on CPU, where
    sdpa's query and output are exactly 1 MiB per layer: the swap threshold."""
    meta = build_meta_model(
        qwen3_moe_config("tiny"),
        StepShape(seq_len=512, batch_size=2, dtype=torch.float32, device="cpu"),
    )
    return trace_step(meta, profile)


@pytest.fixture(scope="package")
def tiny_trace() -> StepTrace:
    """The tiny step timed on the H200 profile."""
    return _tiny_step(device_profile("h200"))


@pytest.fixture(scope="package")
def slow_compute_at() -> Callable[[float], StepTrace]:
    """``slow_compute_at(gbps)``: the tiny step at 0.5 TFLOP/s, where each layer's forward
    lasts long enough that at a 2 GB/s link some of its copies hide and some do not, on a
    host link of ``gbps`` each way. Traced once: no operator's time depends on the link."""
    trace = _tiny_step(device_profile("h200").with_figures(tflops=0.5))

    def at(gbps: float) -> StepTrace:
        return dataclasses.replace(trace, profile=trace.profile.with_figures(link_gbps=float(gbps)))

    return at
