"""The saved-tensor trace: dedup, saving order as a real run sees it, and one TP rank."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import qwen3_moe_config
from graphswap.planning.saved_tensors import (
    PlanSettingError,
    SavedTensorCollector,
    bytes_by_scope,
    per_rank_config,
    trace_saved_tensors,
)
from graphswap.planning.trace import StepShape

SEQ = 512


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
    by_scope = bytes_by_scope(collector.saves)
    mib = 1 << 20
    # Layer 0: x, saved twice by the attention and swappable, plus the attention output.
    assert by_scope["model.layers.0"] == (2 * mib, mib)
    # Layer 1 also saves its input outside the attention: a swap would free nothing.
    assert by_scope["model.layers.1"] == (3 * mib, 0)
    saves = collector.saves["model.layers.0"]
    assert [s.index for s in saves] == [0, 1, 2]
    assert saves[0].storage == saves[1].storage != saves[2].storage
    assert [s.in_attention for s in saves] == [True, True, False]


Save = tuple[tuple[int, ...], torch.dtype, bool]
"""(local shape, dtype, parameter) of one pack call."""


class _PackRecorder:
    """An independent record of a real forward: every pack call per decoder layer, with
    the local tensor of a DTensor, and each layer's distinct activation storage bytes."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.saves: dict[int, list[Save]] = {}
        self.storage_bytes: dict[int, int] = {}
        self._seen: set[int] = set()
        self._layer: int | None = None
        self._params = {_local(p).untyped_storage()._cdata for p in model.parameters()}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._layer is not None:
            local = _local(t)
            key = local.untyped_storage()._cdata
            parameter = key in self._params
            self.saves.setdefault(self._layer, []).append(
                (tuple(local.shape), local.dtype, parameter)
            )
            if not parameter and key not in self._seen:
                self._seen.add(key)
                nbytes = local.untyped_storage().nbytes()
                self.storage_bytes[self._layer] = self.storage_bytes.get(self._layer, 0) + nbytes
        return t

    def run(self, ids: torch.Tensor) -> None:
        handles = []
        for i, layer in enumerate(self.model.model.layers):
            handles.append(layer.register_forward_pre_hook(lambda *_, i=i: self._enter(i)))
            handles.append(layer.register_forward_hook(lambda *_: self._enter(None)))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                self.model(input_ids=ids, labels=ids, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()

    def _enter(self, layer: int | None) -> None:
        self._layer = layer


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _traced(**kwargs: Any) -> tuple[list[list[Save]], list[int]]:
    trace = trace_saved_tensors(
        qwen3_moe_config("tiny", num_hidden_layers=2),
        StepShape(seq_len=SEQ, device="cpu", **kwargs),
    )
    saves = [[(s.shape, s.dtype, s.parameter) for s in layer.saves] for layer in trace.layers]
    by_scope = trace.bytes_by_scope()
    return saves, [by_scope[layer.name][0] for layer in trace.layers]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_saving_order_shapes_and_dtypes_match_a_real_cpu_run(
    attn_implementation: str, dtype: torch.dtype, one_thread: None
) -> None:
    """What a runtime hook relies on to find a planned save by its index."""
    config = qwen3_moe_config("tiny", num_hidden_layers=2, attn_implementation=attn_implementation)
    recorder = _PackRecorder(build_model(config, dtype=dtype).train())
    recorder.run(torch.zeros(1, SEQ, dtype=torch.long))
    saves, saved_bytes = _traced(attn_implementation=attn_implementation, dtype=dtype)
    assert saves == [recorder.saves[0], recorder.saves[1]]
    assert saved_bytes == [recorder.storage_bytes[0], recorder.storage_bytes[1]]


@pytest.fixture
def fake_world() -> Iterator[Any]:
    """Rank 0 of a two-rank world whose collectives do nothing: the real tensor-parallel
    plan shards the model, and the local shapes are those of a real rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_one_rank_under_the_tensor_parallel_plan_matches_the_trace(
    fake_world: Any, attn_implementation: str, one_thread: None
) -> None:
    from graphswap.passes.tensor_parallel import apply_tensor_parallel

    config = qwen3_moe_config("tiny", num_hidden_layers=2, attn_implementation=attn_implementation)
    model = build_model(config).train()
    apply_tensor_parallel(model, fake_world)
    recorder = _PackRecorder(model)
    recorder.run(torch.zeros(1, SEQ, dtype=torch.long))
    traced = {"attn_implementation": attn_implementation, "dtype": torch.float32}
    saves, saved_bytes = _traced(**traced, tp_size=2)
    assert saves == [recorder.saves[0], recorder.saves[1]]
    assert saved_bytes == [recorder.storage_bytes[0], recorder.storage_bytes[1]]
    whole = _traced(**traced)[1]
    assert all(
        rank < full for rank, full in zip(saved_bytes, whole, strict=True)
    )  # a share of the heads


def test_per_rank_config_shards_heads_only() -> None:
    config = qwen3_moe_config("qwen3-30b-a3b")
    rank = per_rank_config(config, 4)
    assert (rank.num_attention_heads, rank.num_key_value_heads) == (8, 1)
    assert (rank.head_dim, rank.hidden_size, rank.num_experts) == (128, 2048, 128)
    assert config.num_attention_heads == 32  # the caller's config is left alone


def test_tp_that_does_not_divide_the_heads_names_what_would() -> None:
    with pytest.raises(PlanSettingError, match=r"use one of 1, 2, 4$") as caught:
        per_rank_config(qwen3_moe_config("qwen3-30b-a3b"), 3)
    assert (caught.value.setting, caught.value.value) == ("tp_size", 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_mm_shapes_forward_and_both_gradients_on_meta(dtype: torch.dtype) -> None:
    """Forward and the input gradient multiply tokens x K by groups x K x N; the weight
    gradient multiplies K x tokens by tokens x N per group: groups x K x N."""
    from graphswap.planning.saved_tensors import _ShapeOnlyGroupedMM

    tokens, k, n, groups = 12, 8, 16, 3
    a = torch.empty(tokens, k, device="meta", dtype=dtype, requires_grad=True)
    b = torch.empty(groups, k, n, device="meta", dtype=dtype, requires_grad=True)
    offs = torch.empty(groups, device="meta", dtype=torch.int32)
    with _ShapeOnlyGroupedMM():
        out = torch._grouped_mm(a, b, offs=offs)
        assert out.shape == (tokens, n)
        weight_grad = torch._grouped_mm(a.t(), out, offs=offs)
        assert weight_grad.shape == (groups, k, n)
        out.sum().backward()
    assert a.grad is not None and a.grad.shape == a.shape
    assert b.grad is not None and b.grad.shape == b.shape
