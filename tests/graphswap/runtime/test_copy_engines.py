"""The simulated accelerator's schedule and hazards, and the host pool's classes and bounds."""

import pickle

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphswap.runtime import HazardError, NoOpAccelerator
from graphswap.runtime._engines import Copy
from graphswap.runtime._pool import HostPool, Refusal, size_class
from graphswap.runtime.sim import SimulatedAccelerator

CPU = torch.device("cpu")


def reload_one(engine: SimulatedAccelerator, host: torch.Tensor, after: tuple) -> Copy:
    """A batch of one reload."""
    (reload,) = engine.reloads(CPU, [(host, after)])
    return reload


UNPINNED = SimulatedAccelerator()
"""An engine whose host buffers are pageable."""


def test_copies_complete_lag_ticks_after_issue_in_order() -> None:
    engine = SimulatedAccelerator(lag=2)
    src = torch.arange(4096, dtype=torch.uint8)
    expected = src.clone()
    host = torch.zeros(4096, dtype=torch.uint8)
    offload = engine.offload(src, host, ())
    engine.tick()
    reload = reload_one(engine, host, (offload,))
    assert not offload.done() and torch.count_nonzero(host) == 0
    engine.tick()
    assert offload.done()
    assert not reload.done(), "issued a tick later, it completes a tick later"
    engine.tick()
    assert reload.done()
    reload.fence()
    assert torch.equal(reload.result(), expected)


def test_a_fence_completes_the_copy_and_everything_it_waits_for() -> None:
    engine = SimulatedAccelerator(lag=5)
    src = torch.full((64,), 7, dtype=torch.uint8)
    host = torch.zeros(64, dtype=torch.uint8)
    reload = reload_one(engine, host, (engine.offload(src, host, ()),))
    reload.fence()
    assert torch.equal(reload.result(), src)
    assert engine._sim.pending() == 0


def test_source_released_before_its_copy_completed_is_a_hazard() -> None:
    engine = SimulatedAccelerator(lag=1)
    src = torch.ones(1 << 16, dtype=torch.uint8)
    ref = StorageWeakRef(src.untyped_storage())
    offload = engine.offload(src, torch.empty_like(src), ())
    with pytest.raises(HazardError, match="released before its copy completed"):
        offload.release_source()
    del src
    assert not ref.expired(), "the engine holds the source until it is released"
    offload.fence()
    offload.release_source()
    assert ref.expired()


def test_reading_a_reload_without_a_fence_is_a_hazard() -> None:
    engine = SimulatedAccelerator(lag=0)
    host = torch.zeros(16, dtype=torch.uint8)
    reload = reload_one(
        engine, host, (engine.offload(torch.ones(16, dtype=torch.uint8), host, ()),)
    )
    assert reload.done()
    with pytest.raises(HazardError, match="before compute waited"):
        reload.result()


def test_rewriting_a_host_buffer_a_reload_still_reads_is_a_hazard() -> None:
    engine = SimulatedAccelerator(lag=1)
    host = torch.zeros(16, dtype=torch.uint8)
    first = engine.offload(torch.ones(16, dtype=torch.uint8), host, ())
    reload = reload_one(engine, host, (first,))
    engine.offload(torch.full((16,), 2, dtype=torch.uint8), host, ())
    with pytest.raises(HazardError, match="rewritten while a reload still reads it"):
        engine.tick()
    engine = SimulatedAccelerator(lag=1)
    first = engine.offload(torch.ones(16, dtype=torch.uint8), host, ())
    reload = reload_one(engine, host, (first,))
    engine.offload(torch.full((16,), 2, dtype=torch.uint8), host, (reload,))
    engine.tick()
    reload.fence()
    assert torch.equal(reload.result(), torch.ones(16, dtype=torch.uint8))


def test_reading_a_host_buffer_before_its_offload_is_a_hazard() -> None:
    engine = SimulatedAccelerator(lag=3)
    host = torch.zeros(16, dtype=torch.uint8)
    engine.offload(torch.ones(16, dtype=torch.uint8), host, ())
    reload = reload_one(engine, host, ())
    with pytest.raises(HazardError, match="before its offload filled it"):
        reload.fence()


def test_nothing_is_legal_while_capturing() -> None:
    engine = SimulatedAccelerator(lag=1)
    offload = engine.offload(
        torch.ones(8, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8), ()
    )
    with engine.capture():
        assert engine.capturing()
        for call in (offload.done, offload.fence):
            with pytest.raises(HazardError, match="captures a graph"):
                call()
        with pytest.raises(HazardError, match="captures a graph"):
            engine.offload(torch.ones(8, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8), ())
    assert not engine.capturing()


@pytest.mark.parametrize("lag", [-1, 1.5, True])
def test_simulated_lag_must_be_a_non_negative_int(lag) -> None:
    with pytest.raises(ValueError, match="lag must be an int >= 0"):
        SimulatedAccelerator(lag=lag)


def test_size_classes_bound_the_slack() -> None:
    assert size_class(1, pinned=False) == 4096
    assert size_class(3 << 20, pinned=True) == 4 << 20
    for n in (4097, 5000, (1 << 20) + 1, 3_000_000, 123_456_789):
        c = size_class(n, pinned=False)
        assert n <= c <= n * 1.125
        assert size_class(c, pinned=False) == c
        p = size_class(n, pinned=True)
        assert p >= n and p & (p - 1) == 0 and p < 2 * n


def test_pool_reuses_a_class_and_respects_its_cap() -> None:
    pool = HostPool(max_bytes=3 << 20)
    a = pool.acquire(CPU, 1_000_000, UNPINNED)
    assert not isinstance(a, Refusal)
    pool.release(a, ())
    b = pool.acquire(CPU, 1_010_000, UNPINNED)
    assert b is a, "a nearby size reuses the same class"
    assert pool.acquire(CPU, 3 << 20, UNPINNED) is Refusal.POOL_FULL
    pool.release(b, ())
    c = pool.acquire(CPU, 2 << 20, UNPINNED)
    assert not isinstance(c, Refusal)
    assert pool.reserved_bytes <= 3 << 20


def test_pool_keeps_buffers_per_device() -> None:
    pool = HostPool(max_bytes=1 << 30)
    a = pool.acquire(torch.device("cpu", 0), 1 << 20, UNPINNED)
    assert not isinstance(a, Refusal)
    pool.release(a, ())
    b = pool.acquire(torch.device("meta"), 1 << 20, UNPINNED)
    assert b is not a


def test_pool_trims_idle_buffers_to_twice_the_peak_in_use_at_a_step_boundary() -> None:
    engine = SimulatedAccelerator()
    pool = HostPool(max_bytes=1 << 40)
    for n in range(1, 200):
        freed = engine.calls["host_free", "host"]
        buf = pool.acquire(CPU, n * 50_000, engine)
        assert not isinstance(buf, Refusal)
        pool.release(buf, ())
        assert engine.calls["host_free", "host"] == freed, "nothing is dropped inside a step"
        pool.trim()
        assert pool.reserved_bytes <= 2 * pool.peak_in_use_bytes
    assert engine.calls["host_free", "host"] > 0


def test_failed_allocation_is_a_refusal(monkeypatch) -> None:
    pool = HostPool(max_bytes=1 << 30)
    engine = SimulatedAccelerator()

    def fail(device: torch.device, nbytes: int) -> torch.Tensor:
        raise torch.OutOfMemoryError("no pinned memory left")

    monkeypatch.setattr(engine, "host_buffer", fail)
    assert pool.acquire(CPU, 1 << 20, engine) is Refusal.ALLOC_FAILED
    assert pool.reserved_bytes == pool.in_use_bytes == 0


def test_pool_cap_must_be_non_negative() -> None:
    with pytest.raises(ValueError, match="max_host_bytes"):
        HostPool(-1)


def test_the_no_op_device_copies_at_once_and_orders_nothing() -> None:
    """Every copy is done when issued; fences, queries and releases need no device."""
    engine = NoOpAccelerator()
    src = torch.arange(64, dtype=torch.uint8)
    ref = StorageWeakRef(src.untyped_storage())
    host = torch.zeros(64, dtype=torch.uint8)
    offload = engine.offload(src, host, ())
    assert torch.equal(host, src) and offload.done()
    del src
    assert offload.release_source() is None and ref.expired()
    engine.tick()
    reload = reload_one(engine, host, (offload,))
    assert reload.done()
    reload.fence()
    assert torch.equal(reload.result(), host)
    assert not engine.capturing() and not engine.pin
    assert type(pickle.loads(pickle.dumps(engine))) is NoOpAccelerator


@pytest.mark.compat
def test_an_engine_written_for_0_1_implements_loads_and_is_told_reloads() -> None:
    """0.1.0's ``CopyEngine.loads`` is ``reloads`` (one word per concept), until 0.3: an
    engine that implements ``loads`` serves reloads through it, with a warning."""
    inner = NoOpAccelerator()
    with pytest.warns(DeprecationWarning, match=r"Old\.loads: .*implement CopyEngine\.reloads"):

        class Old(NoOpAccelerator):
            def loads(self, device: torch.device, items: list) -> list[Copy]:  # type: ignore[override]
                return inner.reloads(device, items)

    host = torch.arange(16, dtype=torch.uint8)
    reload = reload_one(Old(), host, (inner.offload(host.clone(), host, ()),))
    reload.fence()
    assert torch.equal(reload.result(), host)
    with pytest.warns(DeprecationWarning, match=r"use CopyEngine\.reloads"):
        (again,) = inner.loads(CPU, [(host, ())])
    again.fence()
    assert torch.equal(again.result(), host)


def test_a_subclass_that_overrides_offload_is_asked_through_it(toy_model) -> None:
    """The built-in engine writes its offloads into the runtime's entries
    (``_fills_records``); a subclass that overrides ``offload`` is asked through it, and
    its reloads are ordered after the records it returned, under every hazard check."""
    from graphswap import SwapManager

    class Counting(SimulatedAccelerator):
        def __init__(self) -> None:
            super().__init__(lag=2)
            self.offloads: list[Copy] = []

        def offload(self, src: torch.Tensor, host: torch.Tensor, after: tuple) -> Copy:
            copy = super().offload(src, host, after)
            self.offloads.append(copy)
            return copy

    ids = torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(0))
    expected = toy_model(0)
    expected(input_ids=ids, labels=ids).loss.backward()
    engine = Counting()
    manager = SwapManager(engine=engine, keep_last=False)
    model = toy_model(0, manager=manager)
    for _ in range(2):
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
    assert len(engine.offloads) == manager.stats.offloaded_tensors > 0
    assert manager.stats.reloaded_tensors == manager.stats.offloaded_tensors
    for got, want in zip(model.parameters(), expected.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad)
