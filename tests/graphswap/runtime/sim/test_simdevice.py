"""The simulated device's streams and the ordering hazards it catches across them.

Each hazard is the shortest sequence of device calls that a real accelerator would
corrupt, beside the same sequence with the wait that makes it legal.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from graphswap.runtime import HazardError
from graphswap.runtime._engines import Copy
from graphswap.runtime.sim import SimulatedAccelerator
from graphswap.runtime.sim._device import SimDevice

CPU = torch.device("cpu")


def reload_one(engine: SimulatedAccelerator, host: torch.Tensor, after: tuple) -> Copy:
    """A batch of one reload."""
    (reload,) = engine.reloads(CPU, [(host, after)])
    return reload


def produced_on(device: SimDevice) -> tuple[torch.Tensor, object]:
    """A tensor computed on a side stream of ``device``, and that stream."""
    side = device.compute_stream()
    side.wait_stream(device.default)
    with side:
        src = torch.ones(4096) * 2
    return src, side


def test_a_source_fenced_on_another_stream_than_its_allocation_stream_is_a_hazard() -> None:
    """The caching allocator hands a block freed on its allocation stream to that stream's
    next kernel at once: only a wait by that very stream makes dropping the source legal."""
    device = SimDevice(lag=1, profile=None)
    src, side = produced_on(device)
    copies = device.new_stream("offload")
    host = torch.empty_like(src)
    copies.wait_stream(side)
    device.to_host(copies, src, host)
    copied = copies.record_event()
    device.default.wait_event(copied)
    with pytest.raises(HazardError, match=r"before stream \d+ \(the stream that allocated it\)"):
        device.drop(src.untyped_storage(), copied)
    side.wait_event(copied)
    device.drop(src.untyped_storage(), copied)
    assert torch.equal(host, src)


def test_a_source_dropped_before_its_copy_completed_is_a_hazard_until_the_host_saw_it() -> None:
    device = SimDevice(lag=1, profile=None)
    src = torch.ones(4096)
    copies = device.new_stream("offload")
    copies.wait_stream(device.default)
    device.to_host(copies, src, torch.empty_like(src))
    copied = copies.record_event()
    with pytest.raises(HazardError, match="released before its copy completed"):
        device.drop(src.untyped_storage(), copied)
    assert not copied.query()
    device.tick()
    assert copied.query()
    device.drop(src.untyped_storage(), copied)


def test_a_copy_of_a_tensor_its_stream_has_not_waited_for_is_a_hazard() -> None:
    """Waiting for the default stream does not order a copy after a side stream's kernel."""
    device = SimDevice(lag=0, profile=None)
    src, side = produced_on(device)
    copies = device.new_stream("offload")
    copies.wait_stream(device.default)
    with pytest.raises(HazardError, match=r"\d+ wrote before offload copy stream \d+ waited"):
        device.to_host(copies, src, torch.empty_like(src))
    copies.wait_stream(side)
    host = torch.empty_like(src)
    device.to_host(copies, src, host)
    assert torch.equal(host, src)


def test_a_reload_read_on_a_stream_that_did_not_wait_for_it_is_a_hazard() -> None:
    device = SimDevice(lag=0, profile=None)
    side = device.compute_stream()
    host = torch.full((64,), 3.0)
    copies = device.new_stream("offload")
    dst = device.empty(host.shape, host.dtype)
    copies.wait_stream(device.default)
    device.to_device(copies, host, dst)
    loaded = copies.record_event()
    side.wait_event(loaded)
    with pytest.raises(HazardError, match="before compute waited for its copy"):
        device.read(dst, loaded)
    with side:
        assert torch.equal(device.read(dst, loaded), host)


def test_waits_are_transitive_as_on_a_device() -> None:
    """A copy stream that waits for a stream that waited for a side stream follows it."""
    device = SimDevice(lag=0, profile=None)
    src, side = produced_on(device)
    device.default.wait_stream(side)
    copies = device.new_stream("offload")
    copies.wait_stream(device.default)
    host = torch.empty_like(src)
    device.to_host(copies, src, host)
    assert torch.equal(host, src)


def test_user_code_makes_and_enters_streams() -> None:
    engine = SimulatedAccelerator()
    default = engine.current_stream()
    side = engine.stream()
    assert side is not default
    with side:
        assert engine.current_stream() is side
        with default:
            assert engine.current_stream() is default
        assert engine.current_stream() is side
    assert engine.current_stream() is default


def test_a_swapped_tensor_produced_on_a_side_stream_is_fenced_on_that_stream() -> None:
    """The engine's offload waits for, and its fence makes wait, the stream current when
    the tensor was saved; dropping the source then is legal however far the device lags."""
    engine = SimulatedAccelerator(lag=5)
    side = engine.stream()
    with side:
        src = torch.arange(4096.0) * 2
        host = torch.empty_like(src)
        offload = engine.offload(src, host, ())
    assert not offload.done()
    offload.fence()
    offload.release_source()
    reload = reload_one(engine, host, (offload,))
    reload.fence()
    assert torch.equal(reload.result(), src)


def test_a_copy_pickles_as_a_fresh_device_with_the_same_lag_and_profile() -> None:
    engine = SimulatedAccelerator(lag=2, profile="h200,link_gbps=25")
    engine.offload(torch.ones(16), torch.empty(16), ())
    clone = pickle.loads(pickle.dumps(engine))
    assert (clone.lag, clone.profile) == (engine.lag, engine.profile)
    assert engine._sim.pending() == 1 and clone._sim.pending() == 0
    assert repr(clone) == "SimulatedAccelerator(lag=2, profile='h200 (custom)')"
