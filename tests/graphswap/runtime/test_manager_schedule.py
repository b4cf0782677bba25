"""The schedule a GPU runs, on CPU: a simulated device that lags behind the host; on the
toy transformer of this folder's ``conftest.py`` and blocks of a few operators."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphswap import CheckpointPolicy, SwapManager, swap_wrapper
from graphswap.runtime import HazardError
from graphswap.runtime._engines import _Offload
from graphswap.runtime.policy import size_threshold_policy
from graphswap.runtime.sim import SimulatedAccelerator

LAYERS = 6
swap_from_64k = size_threshold_policy(1 << 16)
"""Swaps every activation the toy attention saves, its 64 KiB ones with its probabilities:
several tensors per layer, so that a fence must free all of a layer's, not only its last."""


def recording(record: list[tuple[StorageWeakRef, int]]) -> Callable:
    """A size policy, noting what it chose to swap: weak references to the storages, an
    account of residency that does not ask the runtime."""

    def policy(t: torch.Tensor) -> CheckpointPolicy:
        decision = swap_from_64k(t)
        if decision is CheckpointPolicy.MUST_SWAP:
            storage = t.untyped_storage()
            record.append((StorageWeakRef(storage), storage.nbytes()))
        return decision

    return policy


def resident_at_each_layer(
    toy_model: Callable[..., torch.nn.Module], engine_lag: int, offload_lag: int
) -> tuple[list[int], int, int]:
    """Swapped bytes of earlier layers still alive when each attention's forward is
    called, and the largest and smallest layer's swappable bytes."""
    manager = SwapManager(engine=SimulatedAccelerator(lag=engine_lag), swap_offload_lag=offload_lag)
    records: list[list[tuple[StorageWeakRef, int]]] = [[] for _ in range(LAYERS)]
    model = toy_model(layers=LAYERS, manager=manager, policy=[recording(r) for r in records])
    attns = [layer.attn for layer in model.layers]
    resident: list[int] = []

    def measure(index: int) -> Callable:
        def hook(_module: torch.nn.Module, _args: tuple) -> None:
            resident.append(
                sum(n for layer in records[:index] for ref, n in layer if not ref.expired())
            )

        return hook

    for i, attn in enumerate(attns):
        attn.register_forward_pre_hook(measure(i))
    ids = torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    sizes = [sum(n for _, n in layer) for layer in records[:-1]]
    loss.backward()
    stats = manager.stats
    assert stats.reloaded_bytes == stats.offloaded_bytes > 0
    assert stats.prefetch_misses == 0
    return resident, max(sizes), min(sizes)


@pytest.mark.parametrize("engine_lag", [0, 3, 100])
@pytest.mark.parametrize("offload_lag", [0, 1, 2])
def test_swapped_bytes_leave_within_the_offload_lag(
    toy_model, engine_lag: int, offload_lag: int
) -> None:
    resident, largest, smallest = resident_at_each_layer(toy_model, engine_lag, offload_lag)
    assert max(resident) <= (offload_lag + 1) * largest
    if engine_lag == 100:
        # The device never finishes on its own: only the lag bound frees memory, and
        # exactly offload_lag layers are still in flight when a layer begins.
        assert resident[LAYERS - 1] >= offload_lag * smallest
        assert resident[LAYERS - 1] <= offload_lag * largest


def test_without_fences_a_lagging_device_frees_nothing_during_forward(toy_model) -> None:
    """What the bound prevents: with an unbounded lag every layer stays resident."""
    resident, _, smallest = resident_at_each_layer(
        toy_model, engine_lag=100, offload_lag=LAYERS + 10
    )
    assert resident[LAYERS - 1] >= (LAYERS - 1) * smallest


class SideStreamBlock(torch.nn.Module):
    """Computes its activation on a side stream, as overlapped kernels do: the tensor it
    saves is allocated by that stream and saved while it is current."""

    def __init__(self, engine: SimulatedAccelerator, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, n) / n**0.5)
        self.engine = engine
        self.side = engine.stream()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        main = self.engine.current_stream()
        self.side.wait_stream(main)
        with self.side:
            h = x * 2
            y = h @ self.weight
        main.wait_stream(self.side)
        return y


def side_stream_step(engine: SimulatedAccelerator, swap: bool) -> tuple[list, SwapManager]:
    torch.manual_seed(0)
    blocks = [SideStreamBlock(engine, 64) for _ in range(3)]
    manager = SwapManager(engine=engine, swap_offload_lag=1)
    if swap:
        wrapped = [
            swap_wrapper(b, manager=manager, name=f"b{i}", policy=size_threshold_policy(0))
            for i, b in enumerate(blocks)
        ]
        for prev, nxt in itertools.pairwise(wrapped):
            manager.link(prev, nxt)
    x = torch.randn(32, 64, requires_grad=True)
    h = x
    for block in blocks:
        h = block(h)
    h.pow(2).sum().backward()
    return [x.grad, *(b.weight.grad for b in blocks)], manager


def test_a_tensor_saved_on_a_side_stream_is_fenced_on_that_stream() -> None:
    """However far the device lags, the side stream waits for the copy before the source
    is dropped, and no number changes."""
    expected, _ = side_stream_step(SimulatedAccelerator(lag=3), swap=False)
    grads, manager = side_stream_step(SimulatedAccelerator(lag=3), swap=True)
    stats = manager.stats
    assert stats.offloaded_tensors == stats.reloaded_tensors == 2
    assert stats.prefetch_misses == 0
    for got, want in zip(grads, expected, strict=True):
        assert torch.equal(got, want)


def test_fencing_the_current_stream_instead_of_the_producer_is_caught(monkeypatch) -> None:
    """The fence before this one: compute (the default stream) waits, the side stream that
    allocated the source does not, so the allocator may reuse it under the copy."""

    def fence_current_stream(self: _Offload) -> None:
        lane = self._batch.lane
        lane.device.current_stream().wait_event(self._batch.sealed().event)

    monkeypatch.setattr(_Offload, "fence", fence_current_stream)
    with pytest.raises(HazardError, match=r"stream \d+ \(the stream that allocated it\)"):
        side_stream_step(SimulatedAccelerator(lag=3), swap=True)


class WideThenNarrow(torch.nn.Module):
    """Saves a wide tensor (for the matmul) and then a narrow one (tanh's output):
    backward consumes the narrow one first."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x * 2) @ self.weight).tanh()


def test_reloads_are_issued_first_needed_first() -> None:
    engine = SimulatedAccelerator()
    manager = SwapManager(engine=engine)
    first, last = WideThenNarrow(), WideThenNarrow()
    for name, block in (("first", first), ("last", last)):
        swap_wrapper(block, manager=manager, name=name, policy=size_threshold_policy(0))
    manager.link(first, last)
    reloads: list[int] = []
    issue = engine.reloads

    def recording_reloads(device: torch.device, items: list) -> object:
        reloads.extend(host.nbytes for host, _ in items)
        return issue(device, items)

    engine.reloads = recording_reloads  # type: ignore[method-assign]
    x = torch.randn(64, 32, requires_grad=True)
    last(first(x) @ torch.ones(8, 32)).sum().backward()
    narrow, wide = 64 * 8 * 4, 64 * 32 * 4
    assert reloads == [narrow, wide]
    assert manager.stats.prefetch_misses == 0
