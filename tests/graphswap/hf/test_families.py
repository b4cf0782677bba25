"""The same swap, with the same guarantees, on every supported Hugging Face decoder family.

Per family (a tiny preset, built offline) and per attention it runs (eager, and sdpa
where the family supports it), one model runs a forward and backward without swap and
then under ``attn_swap``, ``layer_swap`` and an ``auto`` plan, undoing each rewrite
before the next. Every run must give the same loss and gradients bit for bit, offload
exactly the bytes the planner predicts from a meta-device trace of the same shape
(and the independent tracker must see what the plan says those copies free leave the
device by the end of forward),
reload what it offloaded and never miss a prefetch; and the planner's FLOPs per layer,
taken from the traced operators, must match torch's FLOP count of the operators the real
forward runs. One model build and one trace per case keep the module to a few seconds
per family.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from graphswap import rewrite
from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import PRESETS
from graphswap.passes.plan_executor import PlanExecutor
from graphswap.planning import MemoryPlan
from graphswap.planning.measure import ResidentActivationTracker, output_tensors
from graphswap.planning.saved_tensors import build_meta_model
from graphswap.planning.trace import StepShape, plan_step, trace_step
from graphswap.rewriting.rules import Rule, with_policy
from graphswap.runtime.policy import size_threshold_policy
from graphswap.runtime.profile import device_profile

SEQ, BATCH = 128, 2

POLICY = size_threshold_policy(64 << 10, name="families_test_policy")
"""The tiny presets' queries (4 heads of 16, float32) are exactly 64 KiB at this shape: a
lower threshold than the 1 MiB default swaps them without a model 16 times larger."""

FAMILY_PRESETS = ["tiny", *sorted(name for name in PRESETS if name.startswith("tiny-"))]
"""Qwen3-MoE (``tiny``) and one tiny preset per other supported family."""


@dataclass(frozen=True)
class _Run:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    resident: int
    """Activation bytes on the device at the end of forward (the independent tracker)."""


def _step(model: torch.nn.Module, ids: torch.Tensor, manager: object = None) -> _Run:
    model.zero_grad(set_to_none=True)
    tracker = ResidentActivationTracker("cpu")
    with tracker.track():
        out = model(input_ids=ids, labels=ids, use_cache=False)
    if manager is not None:
        manager.synchronize()  # type: ignore[attr-defined]
    resident = tracker.resident_bytes(output_tensors(out))
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return _Run(out.loss.detach(), grads, resident)


PROFILE = device_profile("h200,link_gbps=1e9,tflops=1,hbm_gbps=1e15")
"""A link fast enough that ``auto`` keeps every copy it can, and a device on which an
operator's time is its FLOPs (1 TFLOP/s, memory traffic free): a planned second is
10^12 FLOPs."""


def _plans(config: object, attn: str) -> dict[str, MemoryPlan]:
    """One meta-device trace of the step, planned per mode."""
    meta = build_meta_model(
        config,
        StepShape(
            seq_len=SEQ,
            batch_size=BATCH,
            dtype=torch.float32,
            attn_implementation=attn,
            device="cpu",
        ),
    )
    trace = trace_step(meta, PROFILE, POLICY, optimizer=False)
    return {
        mode: plan_step(config, trace, activation_swap=mode)  # type: ignore[arg-type]
        for mode in ("attention", "layer", "auto")
    }


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:  # type: ignore[no-untyped-def]
    """A MoE experts' grouped matmul of (tokens x K) by (experts x K x N): every routed
    row is multiplied once, whatever the routing."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def _cpu_flash_flop(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:  # type: ignore[no-untyped-def]
    """torch's sdpa formula (two batched matmuls per query head), written out: before
    torch 2.13 its ``sdpa_flop_count`` refuses fewer key/value heads than query heads.
    A causal call without a mask computes, per query ``i``, the ``i + 1`` keys it sees."""
    batch, heads, q_len, head_dim = q_shape
    k_len, v_dim = k_shape[-2], v_shape[-1]
    causal = len(args) > 1 and args[1] and kwargs.get("attn_mask") is None
    scores = sum(min(i + 1, k_len) for i in range(q_len)) if causal else q_len * k_len
    return 2 * batch * heads * scores * (head_dim + v_dim)


def _forward_flops(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, int]:
    """Per decoder layer, the FLOPs of the ops a real forward executes, as torch's FLOP
    counter counts them (its formulas, plus the two ops it has none for on CPU)."""
    aten = torch.ops.aten
    counter = FlopCounterMode(
        display=False,
        custom_mapping={
            aten._grouped_mm: _grouped_mm_flop,
            aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flop,
        },
    )
    with torch.no_grad(), counter:
        model(input_ids=ids, use_cache=False)
    root = type(model).__name__
    return {
        name.removeprefix(f"{root}."): sum(ops.values())
        for name, ops in counter.get_flop_counts().items()
    }


def _rule(mode: str, plan: MemoryPlan) -> Rule:
    if mode == "auto":
        return PlanExecutor(plan, made_for=f"seq_len: {SEQ}, batch_size: {BATCH}").rule()
    return with_policy({"attention": "attn_swap", "layer": "layer_swap"}[mode], POLICY)


@pytest.fixture(autouse=True)
def _deterministic(one_thread: None) -> Iterator[None]:
    """I4 holds for deterministic kernels: gpt-oss's expert biases accumulate their
    gradients in a thread-dependent order otherwise, with or without swap."""
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_swap_changes_no_number_and_moves_what_the_planner_predicts(
    preset: str, attn: str, family_config: Callable[[str, str], Any]
) -> None:
    config = family_config(preset, attn)
    plans = _plans(config, attn)
    torch.manual_seed(0)
    model = build_model(config).train()
    vocab = config.vocab_size  # type: ignore[attr-defined]
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    plain = _step(model, ids)
    flops = _forward_flops(model, ids)
    for layer in plans["layer"].layers:
        planned = layer.forward_seconds * PROFILE.tflops * 1e12
        assert planned == pytest.approx(flops[layer.name], rel=0.05), layer.name
    for mode, plan in plans.items():
        report = rewrite(model, rules=[_rule(mode, plan)])
        run = _step(model, ids, report.manager)
        report.check()
        stats = report.manager.stats
        report.undo()
        assert torch.equal(run.loss, plain.loss), mode
        assert run.grads.keys() == plain.grads.keys(), mode
        changed = [n for n, grad in run.grads.items() if not torch.equal(grad, plain.grads[n])]
        assert not changed, f"{mode}: gradients differ in {changed[:3]}"
        offloaded = sum(layer.offloaded_bytes for layer in plan.layers)
        assert stats.offloaded_bytes == offloaded > 0, mode
        assert stats.reloaded_bytes == stats.offloaded_bytes, mode
        assert (stats.prefetch_misses, stats.plan_mismatches) == (0, 0), mode
        # What the copies free (a storage another save keeps stays): the tracker's view.
        assert plain.resident - run.resident == pytest.approx(plan.swapped_bytes, rel=0.01), mode
        assert plan.swapped_bytes > 0, mode
