"""The cost model the planner and the simulated device share: causal attention, the
attention kernels' own rate, and the node a profile stands for."""

from __future__ import annotations

import pytest
import torch

from graphswap.runtime.profile import (
    ProfileError,
    causal_share,
    device_profile,
    op_cost,
    op_flops,
)

ops = torch.ops.aten
Q = torch.empty(2, 8, 1024, 64, device="meta")
KV = torch.empty(2, 2, 1024, 64, device="meta")
FULL = 4.0 * 2 * 8 * 1024 * 1024 * 64


@pytest.mark.parametrize(
    ("kernel", "args", "kwargs"),
    [
        (ops._scaled_dot_product_flash_attention.default, (Q, KV, KV, 0.0, True), {}),
        (ops._scaled_dot_product_flash_attention_for_cpu.default, (Q, KV, KV, 0.0, True), {}),
        (
            ops._scaled_dot_product_efficient_attention.default,
            (Q, KV, KV, None, True, 0.0, True),
            {},
        ),
        (
            ops._scaled_dot_product_cudnn_attention.default,
            (Q, KV, KV, None, True),
            {"is_causal": True},
        ),
    ],
)
def test_a_causal_kernel_without_a_mask_computes_half_the_scores(
    kernel: object, args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    causal = op_flops(kernel, args, kwargs, None)
    assert causal == pytest.approx(FULL / 2, rel=0.02)
    assert causal == FULL * causal_share(1024, 1024)
    cost = op_cost(kernel, args, kwargs, None)
    assert cost is not None and cost.attention == "causal"


def test_the_backward_of_a_causal_kernel_is_half_too() -> None:
    backward = ops._scaled_dot_product_flash_attention_backward.default
    names = [a.name for a in backward._schema.arguments]
    args: list[object] = [Q, Q, KV, KV, Q, None, None, None, 1024, 1024, 0.0, True]
    assert names[len(args) - 1] == "is_causal"
    assert op_flops(backward, tuple(args), {}, None) == pytest.approx(2.5 * FULL / 2, rel=0.02)
    args[-1] = False
    assert op_flops(backward, tuple(args), {}, None) == 2.5 * FULL


def test_a_mask_makes_the_kernel_compute_every_score() -> None:
    """With an explicit mask the kernels compute every score and mask them after, causal
    flag or not: a sliding window or a padding mask is not half the work."""
    mask = torch.empty(1024, 1024, device="meta")
    kernel = ops._scaled_dot_product_efficient_attention.default
    assert op_flops(kernel, (Q, KV, KV, mask, True, 0.0, True), {}, None) == FULL
    cpu = ops._scaled_dot_product_flash_attention_for_cpu.default
    cost = op_cost(cpu, (Q, KV, KV, 0.0, True), {"attn_mask": mask}, None)
    assert cost is not None and cost.flops == FULL and cost.attention == "full"


def test_causal_share_counts_the_scores_each_query_sees() -> None:
    assert causal_share(4, 4) == 10 / 16  # 1 + 2 + 3 + 4 of 16
    assert causal_share(2, 4) == 3 / 8  # top-left aligned, as sdpa's is_causal
    assert causal_share(4, 2) == 7 / 8  # 1 + 2 + 2 + 2


def test_attention_efficiency_slows_the_attention_kernels_only() -> None:
    slow = device_profile("h200,attention_efficiency=0.5")
    fast = device_profile("h200")
    attention = op_cost(
        ops._scaled_dot_product_flash_attention.default, (Q, KV, KV, 0.0, True), {}, None
    )
    a, b = torch.empty(4096, 4096, device="meta"), torch.empty(4096, 4096, device="meta")
    matmul = op_cost(ops.mm.default, (a, b), {}, torch.empty(4096, 4096, device="meta"))
    assert attention is not None and matmul is not None
    assert attention.seconds(slow) == pytest.approx(2 * attention.seconds(fast))
    assert matmul.seconds(slow) == matmul.seconds(fast)


def test_a_profile_carries_the_node_that_sizes_the_host_budget() -> None:
    h200 = device_profile("h200")
    assert (h200.host_memory_bytes, h200.ranks_per_node) == (2 << 40, 8)
    assert h200.default_max_host_bytes == 128 << 30  # half of 2 TiB over 8 ranks
    assert "8 GPUs and 2 TiB" in h200.source
    node = device_profile("h200,host_memory_bytes=1e12,ranks_per_node=4")
    assert node.default_max_host_bytes == 125 * 10**9
    assert isinstance(node.ranks_per_node, int)


def test_a_profile_customised_twice_says_custom_once() -> None:
    """plan-memory --profile h100,link_gbps=25 --host-memory 1TiB printed
    'h100 (custom) (custom)'."""
    twice = device_profile("h100,link_gbps=25").with_figures(host_memory_bytes=1 << 40)
    assert (twice.name, twice.d2h_gbps, twice.host_memory_bytes) == ("h100 (custom)", 25, 1 << 40)


@pytest.mark.parametrize(
    "figure", ["memory_bytes=inf", "ranks_per_node=nan", "host_memory_bytes=0"]
)
def test_a_figure_that_names_no_machine_is_refused(figure: str) -> None:
    key = figure.partition("=")[0]
    with pytest.raises(ProfileError, match=key):
        device_profile(f"h200,{figure}")
