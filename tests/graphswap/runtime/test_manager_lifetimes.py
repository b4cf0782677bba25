"""Off the happy path: graphs never backpropagated, forwards that raise, in-place changes
to kept tensors, tensors saved by several nodes, varying shapes, graph capture; on the
toy transformer of this folder's ``conftest.py`` and blocks of a few operators."""

from __future__ import annotations

import copy
import gc
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from graphswap import SwapManager, swap_wrapper
from graphswap.errors import SwapExclusionError, SwapIntegrityError
from graphswap.runtime._handles import _Entry
from graphswap.runtime.policy import size_threshold_policy
from graphswap.runtime.sim import SimulatedAccelerator

VOCAB = 512
SEQ = 256
"""The toy's sequence length: its attention probabilities (2 MiB) swap, the rest stays."""


def ids(seq: int = SEQ, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Reference counting alone must free what a dropped graph held."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def live_entries() -> int:
    return sum(type(o) is _Entry for o in gc.get_objects())


def test_forwards_without_backward_free_everything_by_refcount(toy_model, no_gc) -> None:
    manager = SwapManager()
    model = toy_model(layers=3, manager=manager)
    x = ids()
    for _ in range(5):
        model(input_ids=x, labels=x)
        assert manager.stats.host_in_use_bytes == 0
    stats = manager.stats
    assert stats.offloaded_bytes > 0, "the test must swap something to mean anything"
    assert stats.host_reserved_bytes <= stats.peak_host_bytes * 2
    group = manager._latest[model.layers[0].attn]
    assert group() is None, "a dropped graph left a swap group alive"
    assert live_entries() == 0


def test_dropped_retain_graph_releases_host_buffers(toy_model, no_gc) -> None:
    manager = SwapManager()
    model = toy_model(layers=3, manager=manager)
    x = ids()
    loss = model(input_ids=x, labels=x).loss
    loss.backward(retain_graph=True)
    assert manager.stats.host_in_use_bytes > 0, "a retained graph keeps its buffers"
    del loss
    assert manager.stats.host_in_use_bytes == 0
    assert live_entries() == 0


def test_forward_that_raises_half_way_releases_everything(toy_model, no_gc) -> None:
    manager = SwapManager()
    model = toy_model(layers=3, manager=manager)

    def boom(*_args) -> None:
        raise RuntimeError("boom in layer 2")

    handle = model.layers[2].mlp.register_forward_hook(boom)
    x = ids()
    with pytest.raises(RuntimeError, match="boom in layer 2"):
        model(input_ids=x, labels=x)
    handle.remove()
    assert manager.stats.offloaded_bytes > 0
    assert manager.stats.host_in_use_bytes == 0
    assert live_entries() == 0


def plain_and_swapped_grads(
    toy_model: Callable[..., torch.nn.Module], modify: Callable[[Any], object]
) -> tuple[BaseException | None, BaseException | None]:
    """Run the same forward, in-place change and backward on a plain and a wrapped model."""
    errors: list[BaseException | None] = []
    for manager in (None, SwapManager()):
        model = toy_model(layers=3, manager=manager)
        x = ids()
        out = model(input_ids=x, labels=x, output_attentions=True)
        modify(out)
        try:
            out.loss.backward()
            errors.append(None)
        except RuntimeError as e:
            errors.append(e)
    return errors[0], errors[1]


@pytest.mark.parametrize("layer", [-1, 0], ids=["kept_last_layer", "swapped_layer"])
def test_in_place_change_of_a_saved_tensor_raises_where_pytorch_does(toy_model, layer) -> None:
    plain, swapped = plain_and_swapped_grads(toy_model, lambda out: out.attentions[layer].mul_(0.5))
    assert plain is not None and "modified by an inplace operation" in str(plain)
    assert isinstance(swapped, SwapIntegrityError)
    assert f"'layers.{layer % 3}.attn'" in str(swapped) and "in-place" in str(swapped)


class ReturnsWhatItSaves(torch.nn.Module):
    """``y`` is saved by ``sin``'s backward and returned: the caller can change it."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n, n) / n**0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x @ self.w
        return y.sin(), y


def chain_grads(
    manager: SwapManager | None, change: Callable[[list[torch.Tensor]], None], blocks: int = 4
) -> list[torch.Tensor] | RuntimeError:
    """Run a chain of blocks, let ``change`` act on the tensors they returned, drop every
    reference to those, and backpropagate: the weights' gradients, or the error."""
    torch.manual_seed(0)
    chain = [ReturnsWhatItSaves(64) for _ in range(blocks)]
    if manager is not None:
        wrapped = [
            swap_wrapper(b, manager=manager, name=f"b{i}", policy=size_threshold_policy(1024))
            for i, b in enumerate(chain)
        ]
        for prev, nxt in itertools.pairwise(wrapped):
            manager.link(prev, nxt)
    h = torch.randn(64, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    returned = []
    for block in chain:
        h, y = block(h)
        returned.append(y)
    change(returned)
    returned.clear()
    try:
        h.sum().backward()
    except RuntimeError as error:
        return error.with_traceback(None)
    return [block.w.grad for block in chain]


CHANGES: dict[str, Callable[[torch.Tensor], object]] = {
    "directly": lambda y: y.add_(1.0),
    "through_a_view": lambda y: y[1:].add_(1.0),
    "through_a_detached_alias": lambda y: y.detach().mul_(2.0),
}


@pytest.mark.parametrize("how", CHANGES)
@pytest.mark.parametrize("offload_lag", [0, 1, 2, 3])
@pytest.mark.parametrize("lag", [0, 3, 50])
def test_a_saved_tensor_changed_then_dropped_raises_where_pytorch_does(
    how: str, offload_lag: int, lag: int
) -> None:
    """The handle holds the version counter, not the tensor: after the caller dropped
    every reference to it, a change made while its copy was in flight (lag 50,
    offload_lag 2-3) or after it completed is still an error, never a wrong gradient."""
    for block in range(4):

        def change(returned: list[torch.Tensor], block: int = block) -> None:
            CHANGES[how](returned[block])

        plain = chain_grads(None, change)
        assert isinstance(plain, RuntimeError) and "inplace operation" in str(plain)
        manager = SwapManager(engine=SimulatedAccelerator(lag=lag), swap_offload_lag=offload_lag)
        swapped = chain_grads(manager, change)
        assert isinstance(swapped, SwapIntegrityError), (block, swapped)
        assert f"'b{block}'" in str(swapped) and "(64, 64)" in str(swapped)
        if block < 3:  # the last block is kept on device
            assert manager.stats.per_group[f"b{block}"].offloaded_tensors == 2, "x and y"


def test_unchanged_returned_tensors_dropped_before_backward_give_the_same_gradients() -> None:
    plain = chain_grads(None, lambda returned: None)
    manager = SwapManager(engine=SimulatedAccelerator(lag=50), swap_offload_lag=3)
    swapped = chain_grads(manager, lambda returned: None)
    assert not isinstance(plain, RuntimeError) and not isinstance(swapped, RuntimeError)
    assert all(torch.equal(p, q) for p, q in zip(plain, swapped, strict=True))


class SavesTwice(torch.nn.Module):
    """Saves ``y`` twice in one forward, the first time by a node that dies at once
    or only at the end of the forward; ``change`` changes ``y`` in place in between."""

    def __init__(self, change: bool, first_alive: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64))
        self.change = change
        self.first_alive = first_alive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w
        first = y.sin()  # saves y; never backpropagated
        if not self.first_alive:
            del first  # its node and the handle of y's first save die here
        if self.change:
            y.mul_(2.0)
        return y.cos()


@pytest.mark.parametrize(
    ("first_alive", "change", "offloaded", "kept_changed"),
    [(False, False, 6, 0), (False, True, 6, 0), (True, False, 4, 0), (True, True, 4, 2)],
    ids=["dropped-unchanged", "dropped-changed", "alive-unchanged", "alive-changed"],
)
@pytest.mark.parametrize("lag", [0, 3])
def test_a_storage_saved_again_in_one_forward_gives_the_bytes_of_that_save(
    first_alive: bool, change: bool, offloaded: int, kept_changed: int, lag: int
) -> None:
    """A save after every handle of the storage's copy died copies it again; a save
    after an in-place change while that copy's handles live keeps its bytes on device,
    since the copy may hold either version. Per swapped block x and y are offloaded,
    and y once more when its first copy was released."""
    grads = []
    for swap in (False, True):
        torch.manual_seed(0)
        chain = [SavesTwice(change, first_alive) for _ in range(3)]
        manager = SwapManager(engine=SimulatedAccelerator(lag=lag))
        if swap:
            for i, block in enumerate(chain):
                swap_wrapper(
                    block, manager=manager, name=f"b{i}", policy=size_threshold_policy(1024)
                )
            for prev, nxt in itertools.pairwise(chain):
                manager.link(prev, nxt)
        h = torch.randn(64, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        for block in chain:
            h = block(h)
        h.sum().backward()
        grads.append([block.w.grad for block in chain])
    assert all(torch.equal(p, q) for p, q in zip(*grads, strict=True))
    stats = manager.stats
    assert (stats.offloaded_tensors, stats.kept_changed) == (offloaded, kept_changed)
    assert stats.host_in_use_bytes == 0


@pytest.fixture
def fake_mesh() -> Iterator[object]:
    """Rank 0 of a two-rank world whose collectives do nothing."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


class Doubles(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        return y.sin(), y


def dtensor_chain_grad(mesh: object, swap: bool, change: bool) -> torch.Tensor | RuntimeError:
    from torch.distributed.tensor import DTensor, Shard

    chain: list[torch.nn.Module] = [Doubles() for _ in range(3)]
    manager = SwapManager(engine=SimulatedAccelerator(lag=50), swap_offload_lag=2)
    if swap:
        for i, block in enumerate(chain):
            swap_wrapper(block, manager=manager, name=f"d{i}", policy=size_threshold_policy(1024))
        for prev, nxt in itertools.pairwise(chain):
            manager.link(prev, nxt)
    local = torch.randn(32, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    h = DTensor.from_local(local, mesh, [Shard(0)])
    returned = []
    for block in chain:
        h, y = block(h)
        returned.append(y)
    if change:
        returned[1].add_(1.0)
    returned.clear()
    assert manager.stats.offloaded_tensors == (2 if swap else 0)
    try:
        h.to_local().sum().backward()
    except RuntimeError as error:
        return error.with_traceback(None)
    return local.grad


def test_a_saved_dtensor_changed_then_dropped_raises(fake_mesh: object) -> None:
    """A DTensor's handle holds the wrapper's version counter, not its local shard."""
    plain = dtensor_chain_grad(fake_mesh, swap=False, change=False)
    swapped = dtensor_chain_grad(fake_mesh, swap=True, change=False)
    assert isinstance(plain, torch.Tensor) and isinstance(swapped, torch.Tensor)
    assert torch.equal(plain, swapped)
    assert isinstance(dtensor_chain_grad(fake_mesh, swap=False, change=True), RuntimeError)
    error = dtensor_chain_grad(fake_mesh, swap=True, change=True)
    assert isinstance(error, SwapIntegrityError) and "'d1'" in str(error)


def test_in_place_change_of_an_unsaved_output_is_no_error(toy_model) -> None:
    plain, swapped = plain_and_swapped_grads(toy_model, lambda out: out.logits.detach().mul_(1.0))
    assert plain is None and swapped is None


def test_a_tensor_saved_by_three_nodes_is_reloaded_once(toy_model) -> None:
    """The attention input is saved by q, k and v projections: one reload, no miss.
    At 64 KiB the input swaps, with every other activation of the attention."""
    manager = SwapManager()
    model = toy_model(layers=3, manager=manager, policy=size_threshold_policy(1 << 16))
    x = ids()
    model(input_ids=x, labels=x).loss.backward()
    stats = manager.stats
    assert stats.offloaded_bytes > 0
    assert stats.reloaded_bytes == stats.offloaded_bytes
    assert stats.reloaded_tensors == stats.offloaded_tensors
    assert stats.prefetch_misses == 0


def test_varying_sequence_lengths_keep_host_memory_within_twice_the_peak(toy_model) -> None:
    """Trimmed at each step boundary: when the next step's first wrapped forward begins."""
    manager = SwapManager()
    model = toy_model(layers=3, manager=manager, policy=size_threshold_policy(4096))
    checked = []

    def at_step_start(module: torch.nn.Module, args: object) -> None:
        stats = manager.stats
        if stats.host_in_use_bytes == 0:
            assert stats.host_reserved_bytes <= 2 * stats.peak_host_bytes
            checked.append(stats.host_reserved_bytes)

    model.layers[0].attn.q_proj.register_forward_pre_hook(at_step_start)
    for step, seq in enumerate(range(17, 300, 11)):
        x = ids(seq, seed=step)
        model(input_ids=x, labels=x).loss.backward()
        assert manager.stats.host_in_use_bytes == 0
    assert manager.stats.offloaded_bytes > 0
    assert len(checked) == len(range(17, 300, 11)) and max(checked) > 0


def test_under_graph_capture_tensors_stay_on_device_and_are_counted(toy_model) -> None:
    base = toy_model(layers=3)
    engine = SimulatedAccelerator(lag=2)
    manager = SwapManager(engine=engine)
    model = toy_model(layers=3, manager=manager)
    x = ids()
    model(input_ids=x, labels=x).loss.backward()
    offloaded = manager.stats.offloaded_tensors
    with engine.capture():
        loss = model(input_ids=x, labels=x).loss
    stats = manager.stats
    assert stats.offloaded_tensors == offloaded
    assert stats.kept_capturing > 0
    loss.backward()
    base(input_ids=x, labels=x).loss.backward()
    base(input_ids=x, labels=x).loss.backward()
    for (name, p), q in zip(model.named_parameters(), base.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


class Scale(torch.nn.Module):
    """Saves nothing: its backward begins at its output's gradient node."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


@pytest.mark.parametrize("last", ["saves", "saves_nothing"])
def test_a_backward_under_capture_of_a_forward_outside_it_is_refused(last: str) -> None:
    """Reloading would capture host-to-device copies into the graph, replayed later from
    reused host buffers: refused before any copy, naming both modules and the fix."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(2)]
    blocks.append(Scale() if last == "saves_nothing" else torch.nn.Linear(64, 64))
    plain = copy.deepcopy(blocks)
    engine = SimulatedAccelerator(lag=2)
    manager = SwapManager(engine=engine)
    for i, block in enumerate(blocks):
        swap_wrapper(block, manager=manager, name=f"b{i}", policy=size_threshold_policy(1024))
    for prev, nxt in itertools.pairwise(blocks):
        manager.link(prev, nxt)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    loss = torch.nn.Sequential(*blocks)(x.requires_grad_()).sum()
    assert manager.stats.offloaded_tensors > 0
    with engine.capture(), pytest.raises(SwapExclusionError) as info:
        loss.backward(retain_graph=True)
    message = str(info.value)
    assert message.startswith(
        "activation swap excludes capturing a backward whose forward ran outside the capture:"
        " the backward of 'b2' began while the current stream captures a graph, but 'b1'"
    )
    assert "run that forward under the same capture" in message
    assert manager.stats.reloaded_tensors == 0, "no copy was issued under capture"
    loss.backward()  # outside the capture the same graph runs as plain PyTorch does
    x_plain = x.detach().clone().requires_grad_()
    torch.nn.Sequential(*plain)(x_plain).sum().backward()
    assert torch.equal(x.grad, x_plain.grad)
    for block, reference in zip(blocks, plain, strict=True):
        for p, q in zip(block.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)


def test_failed_host_allocation_keeps_the_tensor_and_counts_it(toy_model, monkeypatch) -> None:
    engine = SimulatedAccelerator()
    manager = SwapManager(engine=engine)
    model = toy_model(layers=3, manager=manager)

    def fail(device: torch.device, nbytes: int) -> torch.Tensor:
        raise torch.OutOfMemoryError("pinned allocation failed")

    monkeypatch.setattr(engine, "host_buffer", fail)
    x = ids()
    model(input_ids=x, labels=x).loss.backward()
    stats = manager.stats
    assert stats.offloaded_tensors == 0
    assert stats.alloc_failures > 0 and stats.kept_tensors >= stats.alloc_failures


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"swap_offload_lag": -1}, "swap_offload_lag"),
        ({"swap_offload_lag": 1.5}, "swap_offload_lag"),
        ({"swap_prefetch_depth": 0}, "swap_prefetch_depth"),
        ({"max_host_bytes": -1}, "max_host_bytes"),
        ({"engine": object()}, "engine"),
        ({"engine": "cpu"}, "engine"),
        (
            {"max_host_bytes": True},
            r"^max_host_bytes must be an int >= 0 \(or None: a share of the node\)",
        ),
        ({"max_host_bytes": "1GiB"}, r"^max_host_bytes must be an int >= 0"),
        ({"max_host_bytes": 2.0**30}, r"^max_host_bytes must be an int >= 0"),
        ({"swap_prefetch_depth": True}, r"^swap_prefetch_depth must be an int >= 1, got True"),
        ({"swap_offload_lag": "2"}, r"^swap_offload_lag must be an int >= 0, got '2'"),
        ({"keep_last": "no"}, r"^keep_last must be True or False, got 'no'"),
        ({"keep_last": 0}, r"^keep_last must be True or False, got 0"),
    ],
)
def test_bad_manager_arguments_are_value_errors_naming_them(kwargs, match) -> None:
    """A bool is no number (True would cap the pool at one byte) and a string no bool
    ("no" is true): both are errors naming the argument."""
    with pytest.raises(ValueError, match=match):
        SwapManager(**kwargs)
