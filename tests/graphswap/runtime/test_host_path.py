"""The host side of a step, counted on the simulated device: few accelerator calls per
swapped tensor, nothing in a hook that allocates, frees or empties host memory once
warm, a host budget per node, and bytes copied but not freed reported."""

from __future__ import annotations

import itertools
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from graphswap import CheckpointPolicy, SwapManager, swap_wrapper
from graphswap.planning.measure import ResidentActivationTracker
from graphswap.runtime import _pool as pool_module
from graphswap.runtime._engines import GROUP_BYTES
from graphswap.runtime._forward import _Forward
from graphswap.runtime._handles import unpack_hook
from graphswap.runtime.sim import SimulatedAccelerator

BLOCKS = 6
WIDTH = 256
ROWS = 512
"""A block saves its input and its output, 512 KiB each in fp32: the host path counts
calls and allocations, which do not depend on the size."""


def swap_all(t: torch.Tensor) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SWAP


def chain(manager: SwapManager) -> torch.nn.Sequential:
    """``BLOCKS`` wrapped ``Linear + ReLU`` blocks, linked in order."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())
            for _ in range(BLOCKS)
        )
    )
    blocks = [
        swap_wrapper(b, manager=manager, policy=swap_all, name=f"b{i}") for i, b in enumerate(model)
    ]
    for prev, nxt in itertools.pairwise(blocks):
        manager.link(prev, nxt)
    return model


def step(model: torch.nn.Module, rows: int = ROWS) -> None:
    x = torch.randn(rows, WIDTH)
    model(x).sum().backward()


@pytest.mark.parametrize("engine_lag", [0, 2])
def test_three_calls_per_swapped_tensor_and_direction_and_a_few_per_module(
    engine_lag: int,
) -> None:
    """Counted per kind on the simulated device over a warm step. Per swapped tensor and
    direction: the copy, and its ordering (offload: a wait for the stream that produced
    it and the record it waits on; reload: its own mark and the unpack's wait for it).
    Per module: offload, the batch's mark, its completion query and the lag fence;
    reload, one wait of the copy stream for compute's allocations (record and wait).
    One capture query per module boundary; no event is created once warm."""
    engine = SimulatedAccelerator(lag=engine_lag)
    manager = SwapManager(engine=engine)
    model = chain(manager)
    step(model)
    step(model)
    before = engine.calls.copy()
    manager.reset_stats()
    step(model)
    calls = engine.calls - before
    stats = manager.stats
    tensors, modules = stats.offloaded_tensors, BLOCKS - 1
    assert tensors == 2 * modules and stats.reloaded_tensors == tensors
    assert stats.prefetch_misses == 0
    by_role: dict[str, int] = {}
    for (_, role), n in calls.items():
        by_role[role] = by_role.get(role, 0) + n
    assert set(by_role) == {"offload", "reload", "boundary"}, calls
    assert by_role["offload"] <= 3 * tensors + 3 * modules, calls
    assert by_role["reload"] <= 3 * tensors + 2 * modules, calls
    assert calls["copy", "offload"] == calls["copy", "reload"] == tensors
    assert by_role["boundary"] == 3 * BLOCKS, "2 boundaries in forward, 1 in backward"
    assert not any(kind == "event_create" for kind, _ in calls), "events are pooled"


def test_small_saves_share_their_ordering_at_most_three_calls_per_tensor() -> None:
    """Saves under ``GROUP_BYTES`` (2 KiB here) share the ordering a large one has alone:
    a module's offloads go as one group after one wait for the stream that produced
    them, a batch of reloads records one event, and an unpack skips a wait an earlier
    one implied, so the copy dominates: at most three calls per swapped tensor and
    direction, the module's own calls included (the last module's reloads too, issued by
    its first unpack as one batch). On a device that keeps up (lag 0, as the
    ``--overhead`` count), where the completion query at a module's end answers yes and
    no fence follows."""
    rows = 2
    assert rows * WIDTH * 4 * 2 <= GROUP_BYTES, "a block's two saves fit one group"
    engine = SimulatedAccelerator(lag=0)
    manager = SwapManager(engine=engine, keep_last=False)
    model = chain(manager)
    step(model, rows)
    step(model, rows)
    before = engine.calls.copy()
    manager.reset_stats()
    step(model, rows)
    calls = engine.calls - before
    stats = manager.stats
    tensors = stats.offloaded_tensors
    assert tensors == 2 * BLOCKS and stats.reloaded_tensors == tensors
    assert stats.prefetch_misses == 2, "the last block's two storages, reloaded as one batch"
    by_role: dict[str, int] = {}
    for (_, role), n in calls.items():
        by_role[role] = by_role.get(role, 0) + n
    assert by_role["offload"] <= 3 * tensors, calls
    assert by_role["reload"] <= 3 * tensors, calls
    assert calls["copy", "offload"] == calls["copy", "reload"] == tensors


_HOOKS = {_Forward.__call__.__code__, unpack_hook.__code__}
"""The code of the pack and the unpack hook, as a frame of the call stack shows it."""


def _in_hook() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _HOOKS:
            return True
        frame = frame.f_back
    return False


class HostWatch(SimulatedAccelerator):
    """The simulated engine, recording the host allocations and frees a hook asks of it
    (``seen``, while not None): the engine seam, not the runtime's methods."""

    def __init__(self, lag: int = 0) -> None:
        super().__init__(lag)
        self.seen: list[str] | None = None

    def host_buffer(self, device: torch.device, nbytes: int) -> torch.Tensor:
        if self.seen is not None and _in_hook():
            self.seen.append("host_alloc")
        return super().host_buffer(device, nbytes)

    def free_host_buffer(self, device: torch.device, host: torch.Tensor) -> None:
        if self.seen is not None and _in_hook():
            self.seen.append("host_free")
        super().free_host_buffer(device, host)


@contextmanager
def inside_hooks(engine: HostWatch) -> Iterator[list[str]]:
    """Record every host allocation or free that happens inside a pack or unpack hook,
    and every emptying of torch's host cache."""
    seen: list[str] = []

    def empty_cache() -> None:
        seen.append("host_cache_emptied")

    mp = pytest.MonkeyPatch()
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        if hasattr(torch._C, name):
            mp.setattr(torch._C, name, empty_cache)
    engine.seen = seen
    try:
        yield seen
    finally:
        engine.seen = None
        mp.undo()


def test_no_host_allocation_free_or_cache_emptying_inside_a_hook_after_warm_up() -> None:
    engine = HostWatch(lag=1)
    manager = SwapManager(engine=engine, keep_last=False)
    model = chain(manager)
    step(model, rows=2 * ROWS)  # warm-up: the longest step allocates what shorter ones use
    with inside_hooks(engine) as seen:
        for rows in (2 * ROWS, ROWS, 2 * ROWS, ROWS // 2):
            step(model, rows=rows)
    assert seen == []
    assert manager.stats.offloaded_bytes > 0


def test_a_new_shape_allocates_in_its_first_step_only() -> None:
    engine = HostWatch()
    manager = SwapManager(engine=engine, keep_last=False)
    model = chain(manager)
    step(model)
    with inside_hooks(engine) as seen:
        step(model, rows=2 * ROWS)
    assert "host_alloc" in seen
    with inside_hooks(engine) as seen:
        step(model, rows=2 * ROWS)
    assert seen == []


def test_default_host_budget_is_a_share_of_the_node_per_local_rank(monkeypatch) -> None:
    monkeypatch.setattr(pool_module, "node_memory", lambda: 64 << 30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert SwapManager().stats.max_host_bytes == 32 << 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert SwapManager().stats.max_host_bytes == 4 << 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='eight'"):
        SwapManager()


def test_container_limit_bounds_the_node_memory(tmp_path, monkeypatch) -> None:
    """cgroup v2: the tightest ``memory.max`` of this cgroup and its parents."""
    (tmp_path / "job" / "step").mkdir(parents=True)
    (tmp_path / "job" / "memory.max").write_text(f"{8 << 30}\n")
    (tmp_path / "job" / "step" / "memory.max").write_text("max\n")
    real = pool_module.Path.read_text

    def read_text(path: pool_module.Path, *args: object, **kwargs: object) -> str:
        if str(path) == "/proc/self/cgroup":
            return "0::/job/step\n"
        return real(path, *args, **kwargs)

    monkeypatch.setattr(pool_module.Path, "read_text", read_text)
    assert pool_module._cgroup_limit(tmp_path) == 8 << 30


def test_a_host_budget_over_the_node_warns_naming_it_and_negative_is_an_error(
    monkeypatch,
) -> None:
    monkeypatch.setattr(pool_module, "node_memory", lambda: 16 << 30)
    with pytest.warns(RuntimeWarning, match=r"max_host_bytes=34359738368 \(32.0 GiB\)"):
        assert SwapManager(max_host_bytes=32 << 30).stats.max_host_bytes == 32 << 30
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SwapManager(max_host_bytes=8 << 30)
    with pytest.raises(ValueError, match=r"^max_host_bytes must be an int >= 0"):
        SwapManager(max_host_bytes=-1)


def resident_after_forward(swap: bool) -> tuple[int, SwapManager | None]:
    """A wrapped ``Linear + ReLU`` block under bf16 autocast, whose weight cast autocast
    caches: activation bytes alive after forward, by the independent tracker."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())
    manager = SwapManager(keep_last=False) if swap else None
    if manager is not None:
        swap_wrapper(block, manager=manager, policy=swap_all, name="block")
    x = torch.randn(ROWS, WIDTH)
    tracker = ResidentActivationTracker("cpu")
    with tracker.track(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x)
        resident = tracker.resident_bytes(exclude=[out])
        out.float().sum().backward()
    return resident, manager


def test_autocast_weight_cache_is_counted_as_copied_but_not_freed() -> None:
    plain, _ = resident_after_forward(swap=False)
    with pytest.warns(RuntimeWarning, match="autocast's weight cache"):
        swapped, manager = resident_after_forward(swap=True)
    assert manager is not None
    stats = manager.stats
    weight_cast = WIDTH * WIDTH * 2
    assert stats.offloaded_not_freed_bytes >= weight_cast
    assert plain - swapped == stats.offloaded_bytes - stats.offloaded_not_freed_bytes
    assert plain - swapped > 0
