"""The op tape's memory account: only what an operator allocates is born."""

from __future__ import annotations

from typing import Any

import torch

from graphswap.runtime.profile import device_profile
from graphswap.runtime.timeline import OpTape


class Births:
    """A tape listener that keeps the sizes of the storages born and freed."""

    def __init__(self) -> None:
        self.born: list[int] = []
        self.freed: list[int] = []

    def on_op(self, func: Any, seconds: float) -> None:
        pass

    def on_alloc(self, key: int, nbytes: int) -> None:
        self.born.append(nbytes)

    def on_free(self, key: int, nbytes: int) -> None:
        self.freed.append(nbytes)


def test_views_in_place_ops_and_storage_swaps_of_older_tensors_are_no_births() -> None:
    """A parameter made before the step and only viewed (``weight.t()`` inside a Linear),
    changed in place, detached or aliased through ``set_`` is not device memory the step
    allocated; the Linear's output is."""
    linear = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64)
    births = Births()
    with OpTape("cpu", device_profile("h200"), births):
        y = linear(x)
        x.mul_(2)
        x.detach()
        torch.empty(0).set_(linear.weight.untyped_storage())
    assert births.born == [8 * 32 * 4, 0]  # the output, the empty tensor set_ re-points
    assert births.freed == [0]
    del y
    assert births.freed == [0, 8 * 32 * 4]


def test_views_and_in_place_results_of_older_storages_are_not_born() -> None:
    """A parameter (alive before the tape) viewed, changed in place or handed to
    ``set_`` is no new memory; a new result is, and its death is reported."""
    weight = torch.nn.Parameter(torch.zeros(64, 64, device="meta"))
    log = Births()
    with OpTape("meta", device_profile("h200"), log), torch.no_grad():
        view = weight.t()
        weight.mul_(2.0)
        alias = torch.empty(0, device="meta").set_(weight.untyped_storage())
        out = view @ view
        del out
    assert log.born == [0, 64 * 64 * 4]  # the empty tensor set_ retargets, and the product
    assert log.freed == [0, 64 * 64 * 4]  # the storage set_ dropped, and the product
    assert alias.untyped_storage().nbytes() == 64 * 64 * 4


def test_fused_attention_counts_every_query_head_with_fewer_key_value_heads() -> None:
    """Grouped-query attention (8 query heads over 2 key/value heads) is costed as the
    kernel runs it, on every torch the project supports."""
    from graphswap.runtime.profile import op_flops

    ops = torch.ops.aten
    q = torch.empty(2, 8, 128, 64, device="meta")
    k = v = torch.empty(2, 2, 128, 64, device="meta")
    forward = 4.0 * 2 * 8 * 128 * 128 * 64
    kernel = ops._scaled_dot_product_efficient_attention.default
    assert op_flops(kernel, (q, k, v, None, True), {}, None) == forward
    backward = ops._scaled_dot_product_flash_attention_backward.default
    assert op_flops(backward, (q, q, k, v), {}, None) == 2.5 * forward
