"""The memory planner: predictions against a real run, dedup, keep-last, hiding logic."""

from __future__ import annotations

import pytest
import torch

from graphswap.measure import ResidentActivationTracker, output_tensors
from graphswap.planner import (
    LayerPlan,
    MemoryPlan,
    SavedTensorCollector,
    layer_forward_flops,
    plan_memory,
)
from graphswap.presets import qwen3_moe_config

SEQ, BATCH = 256, 2  # the attention probabilities are 2 MiB per layer: above the swap threshold


def _measure_resident(model: torch.nn.Module, ids: torch.Tensor, manager: object = None) -> int:
    tracker = ResidentActivationTracker("cpu")
    with tracker.track():
        out = model(input_ids=ids, labels=ids, use_cache=False)
    if manager is not None:
        manager.synchronize()  # type: ignore[attr-defined]
    resident = tracker.resident_bytes(output_tensors(out))
    out.loss.backward()
    return resident


@pytest.fixture(scope="module")
def tiny_plan() -> MemoryPlan:
    return plan_memory(qwen3_moe_config("tiny"), seq=SEQ, batch=BATCH, dtype=torch.float32)


def _tiny_inputs(tiny_model) -> tuple[torch.nn.Module, torch.Tensor]:  # type: ignore[no-untyped-def]
    model = tiny_model().train()
    ids = torch.randint(
        0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)
    )
    return model, ids


def test_prediction_matches_measured_saved_bytes_without_swap(tiny_plan, tiny_model) -> None:  # type: ignore[no-untyped-def]
    model, ids = _tiny_inputs(tiny_model)
    measured = _measure_resident(model, ids)
    assert measured == pytest.approx(tiny_plan.total_saved_bytes, rel=0.05)


def test_prediction_matches_measured_resident_bytes_with_swap(tiny_plan, tiny_model) -> None:  # type: ignore[no-untyped-def]
    from graphswap import rewrite

    model, ids = _tiny_inputs(tiny_model)
    manager = rewrite(model, rules=["qwen3_attn_swap"]).manager
    assert tiny_plan.swapped_bytes > 0
    measured = _measure_resident(model, ids, manager)
    assert measured == pytest.approx(tiny_plan.end_of_forward_with_swap_bytes, rel=0.05)
    assert manager.stats.offloaded_bytes == tiny_plan.swapped_bytes


def test_every_layer_is_attributed_and_alike(tiny_plan) -> None:  # type: ignore[no-untyped-def]
    layers = tiny_plan.layers
    assert [layer.name for layer in layers] == [f"model.layers.{i}" for i in range(4)]
    assert all(layer.swappable_bytes == layers[0].swappable_bytes > 0 for layer in layers)
    assert all(0 < layer.swappable_bytes < layer.saved_bytes for layer in layers)
    assert [layer.kept for layer in layers] == [False, False, False, True]
    assert tiny_plan.head_saved_bytes > 0


class _Attention(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x  # saves x twice: one storage


class _Layer(torch.nn.Module):
    def __init__(self, *, reuse_input: bool) -> None:
        super().__init__()
        self.self_attn = _Attention()
        self.reuse_input = reuse_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.self_attn(x).sin()  # sin saves the attention output, outside the attention
        return out * x if self.reuse_input else out  # the mul saves x outside the attention


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(
            [_Layer(reuse_input=False), _Layer(reuse_input=True)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer(x)
        return x


def test_a_tensor_saved_twice_counts_once() -> None:
    model = _Toy()
    x = torch.empty(512, 512, device="meta", requires_grad=True)  # 1 MiB: swappable size
    collector = SavedTensorCollector(model)
    with collector.collect():
        model(x)
    by_scope = collector.bytes_by_scope()
    mib = 1 << 20
    # Layer 0: x, saved twice by the attention and swappable, plus the attention output.
    assert by_scope["model.layers.0"] == (2 * mib, mib)
    # Layer 1 also saves its input outside the attention: a swap would free nothing.
    assert by_scope["model.layers.1"] == (3 * mib, 0)


def _layer(index: int, saved: int, swappable: int, *, kept: bool = False) -> LayerPlan:
    return LayerPlan(
        name=f"model.layers.{index}",
        index=index,
        saved_bytes=saved,
        swappable_bytes=swappable,
        forward_flops=1e9,
        copy_seconds=0.0,
        overlap_seconds=0.0,
        kept=kept,
    )


def _plan(layers: list[LayerPlan]) -> MemoryPlan:
    return MemoryPlan(
        config={},
        seq=1,
        batch=1,
        dtype="float32",
        attn_implementation="eager",
        policy="p",
        bandwidth_gbps=50.0,
        tflops=400.0,
        layers=tuple(layers),
        embed_saved_bytes=10,
        head_saved_bytes=100,
    )


def test_keep_last_accounting() -> None:
    plan = _plan([_layer(0, 1000, 600), _layer(1, 1000, 600), _layer(2, 1000, 600, kept=True)])
    assert plan.total_saved_bytes == 3110
    assert plan.swapped_bytes == 1200  # the kept last layer stays on device
    assert plan.end_of_forward_with_swap_bytes == 3110 - 1200
    assert plan.peak_with_swap_bytes == 3110 - 1200 + 600  # one layer's prefetch in flight
    assert plan.peak_without_swap_bytes == 3110
    timeline = plan.timeline()
    assert max(p.without_swap_bytes for p in timeline) == plan.peak_without_swap_bytes
    assert max(p.with_swap_bytes for p in timeline) <= plan.peak_with_swap_bytes
    assert timeline[-1].with_swap_bytes == 10 + 1000  # layer 0 back, nothing left in flight


def test_copy_time_scales_with_bandwidth_and_decides_hiding() -> None:
    config = qwen3_moe_config("tiny")
    slow = plan_memory(config, seq=SEQ, batch=1, bandwidth_gbps=0.001, tflops=1.0)
    fast = plan_memory(config, seq=SEQ, batch=1, bandwidth_gbps=1e6, tflops=1.0)
    first_slow, first_fast = slow.layers[0], fast.layers[0]
    assert first_slow.copy_seconds == pytest.approx(first_slow.swappable_bytes / 1e6)
    assert first_slow.copy_seconds == pytest.approx(first_fast.copy_seconds * 1e9)
    assert first_slow.overlap_seconds == pytest.approx(2 * slow.layers[1].forward_flops / 1e12)
    assert not first_slow.prefetch_hides and not slow.all_prefetches_hide
    assert first_fast.prefetch_hides and fast.all_prefetches_hide
    assert slow.layers[-1].prefetch_hides  # kept: nothing to copy


def test_flops_grow_quadratically_in_attention_only() -> None:
    config = qwen3_moe_config("qwen3-30b-a3b")
    one = layer_forward_flops(config, seq=1024, batch=1, moe=True)
    two = layer_forward_flops(config, seq=2048, batch=1, moe=True)
    scores = 4 * config.num_attention_heads * config.head_dim
    assert two - 2 * one == pytest.approx(scores * (2048**2 - 2 * 1024**2))


def test_plan_to_dict_and_table(tiny_plan) -> None:  # type: ignore[no-untyped-def]
    data = tiny_plan.to_dict()
    assert data["swapped_bytes"] == tiny_plan.swapped_bytes
    assert len(data["layers"]) == 4 and "prefetch_hides" in data["layers"][0]
    assert any("uniform routing" in text for text in data["assumptions"])
    table = tiny_plan.format_table()
    assert "model.layers.3" in table and "kept on device" in table


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"seq": 0}, "seq"),
        ({"seq": 8, "batch": -1}, "batch"),
        ({"seq": 8, "bandwidth_gbps": 0}, "bandwidth_gbps"),
    ],
)
def test_bad_inputs_name_the_input(kwargs, word) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=word):
        plan_memory(qwen3_moe_config("tiny"), **kwargs)


def test_eager_experts_are_refused_with_the_fix() -> None:
    config = qwen3_moe_config("tiny", experts_implementation="eager")
    with pytest.raises(ValueError, match="grouped_mm"):
        plan_memory(config, seq=8)
