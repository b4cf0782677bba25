"""The op tape: a storage is reported born once, by the operator that made it."""

from __future__ import annotations

from typing import Any

import torch

from graphswap.runtime.profile import device_profile
from graphswap.runtime.tape import OpTape


class _Log:
    def __init__(self) -> None:
        self.ops: list[str] = []
        self.born: list[int] = []
        self.died: list[int] = []

    def on_op(self, func: Any, seconds: float) -> None:
        self.ops.append(str(func))

    def on_alloc(self, key: int, nbytes: int) -> None:
        self.born.append(nbytes)

    def on_free(self, key: int, nbytes: int) -> None:
        self.died.append(nbytes)


def test_views_and_in_place_results_of_older_storages_are_not_born() -> None:
    """A parameter (alive before the tape) viewed, changed in place or handed to
    ``set_`` is no new memory; a new result is, and its death is reported."""
    weight = torch.nn.Parameter(torch.zeros(64, 64, device="meta"))
    log = _Log()
    with OpTape("meta", device_profile("h200"), log), torch.no_grad():
        view = weight.t()
        weight.mul_(2.0)
        alias = torch.empty(0, device="meta").set_(weight.untyped_storage())
        out = view @ view
        del out
    assert log.born == [0, 64 * 64 * 4]  # the empty tensor set_ retargets, and the product
    assert log.died == [0, 64 * 64 * 4]  # the storage set_ dropped, and the product
    assert any("mm" in op for op in log.ops) and alias.untyped_storage().nbytes() == 64 * 64 * 4
