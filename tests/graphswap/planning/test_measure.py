"""The independent tracker: live storages, less outputs and pack-hook copies."""

from __future__ import annotations

import torch

from graphswap.planning.measure import ResidentActivationTracker


def test_counts_saved_storages_once_and_skips_outputs() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    tracker = ResidentActivationTracker("cpu")
    with tracker.track():
        y = x.exp()  # saves its output y
        z = (y * y).sum()  # mul saves y twice: counted once
    assert tracker.resident_bytes(exclude=[z]) == 64 * 64 * 4


def test_copies_made_by_pack_hooks_are_not_activations() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    tracker = ResidentActivationTracker("cpu")
    with (
        tracker.track(),
        torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t),
    ):
        out = x.exp().sum()  # exp saves its output: a clone takes its place
    assert tracker.resident_bytes(exclude=[out]) == 0
    assert tracker.packed_bytes == 64 * 64 * 4


def test_freed_tensors_are_not_counted() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    tracker = ResidentActivationTracker("cpu")
    with tracker.track():
        out = x.exp().sum()
    del out
    assert tracker.resident_bytes() == 0
