import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphswap.runtime.engines import CpuCopyEngine
from graphswap.runtime.pool import HostPool


def test_cpu_copies_run_in_order_only_when_waited_for() -> None:
    engine = CpuCopyEngine()
    src = torch.arange(4096, dtype=torch.uint8)
    expected = src.clone()
    host = torch.zeros(4096, dtype=torch.uint8)
    offload = engine.offload(src, host)
    load = engine.load(host, offload, torch.device("cpu"))
    assert not offload.done() and not load.done()
    assert torch.count_nonzero(host) == 0, "a copy ran before anyone waited for it"

    load.wait()
    assert offload.done() and load.done()
    assert torch.equal(load.result(), expected)
    assert load.result().data_ptr() != host.data_ptr()


def test_offload_source_is_held_until_its_copy_ran() -> None:
    engine = CpuCopyEngine()
    src = torch.ones(1 << 16, dtype=torch.uint8)
    ref = StorageWeakRef(src.untyped_storage())
    offload = engine.offload(src, torch.empty_like(src))
    del src
    assert not ref.expired()
    engine.progress()
    assert offload.done() and ref.expired()


def test_pool_reuses_exact_sizes_and_respects_its_cap() -> None:
    pool = HostPool(max_bytes=3000)
    a = pool.acquire(1000, pin=False)
    assert a is not None
    pool.release(a)
    assert pool.acquire(1000, pin=False) is a
    b = pool.acquire(1500, pin=False)
    assert b is not None
    assert pool.acquire(1000, pin=False) is None
    pool.release(b)
    c = pool.acquire(2000, pin=False)
    assert c is not None, "idle buffers of other sizes are dropped to make room"
    assert pool.reserved_bytes == 3000
    assert pool.peak_in_use_bytes == 3000
