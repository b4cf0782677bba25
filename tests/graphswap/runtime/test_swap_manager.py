"""Runtime semantics of the swap on CPU: numbers, lifetimes, order, guards.

On the toy transformer of this folder's ``conftest.py``; the tiny Qwen3-MoE trains
once, to show that a real model's attention swaps the same way."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphswap import CheckpointPolicy, SwapManager, swap_wrapper
from graphswap.errors import SwapIntegrityError
from graphswap.runtime import CopyEngine, NoOpAccelerator
from graphswap.runtime.policy import size_threshold_policy, swap_large_activations
from graphswap.runtime.sim import SimulatedAccelerator

VOCAB = 512
SEQ = 256
"""The toy's sequence length: its attention probabilities (2 MiB) swap, the rest stays."""
swap_everything = size_threshold_policy(0)


def swap_what_needs_grad(t: torch.Tensor) -> CheckpointPolicy:
    """Views and slices too, unlike the size-threshold policies."""
    return CheckpointPolicy.MUST_SWAP if t.requires_grad else CheckpointPolicy.MUST_SAVE


def wrap_attention(model: torch.nn.Module, manager: SwapManager) -> None:
    """Every attention of a Hugging Face model swap-wrapped and linked in order."""
    attns = [
        swap_wrapper(layer.self_attn, manager=manager, name=f"model.layers.{i}.self_attn")
        for i, layer in enumerate(model.model.layers)
    ]
    for prev, nxt in itertools.pairwise(attns):
        manager.link(prev, nxt)


class Timeline:
    """What a manager does, in order, seen through its copy engine (a ``RecordingEngine``)
    and the watched modules' own hooks: ``(offload | backward_begin | prefetch | unpack,
    group)``; ``unpack`` is the unpack of a swapped tensor, ``prefetch`` a batch of
    reloads issued ahead of it, and ``backward_begin`` the module boundary that follows
    the moment backward reached a group's output (where the manager learns it)."""

    def __init__(self, engine: CopyEngine) -> None:
        self.engine: Any = engine  # a ``RecordingEngine`` (conftest.py): its ``calls``
        self.marks: list[tuple[int, str, str]] = []  # (calls so far, "forward" | "output", group)

    def watch(self, module: torch.nn.Module, name: str) -> None:
        """Mark where ``module``'s forward starts and where backward reaches its output."""
        calls = self.engine.calls

        def output_reached(_grad: torch.Tensor) -> None:
            self.marks.append((len(calls), "output", name))

        def forward_starts(_module: torch.nn.Module, _args: object) -> None:
            self.marks.append((len(calls), "forward", name))

        def forward_ends(_module: torch.nn.Module, _args: object, out: object) -> None:
            first = out[0] if isinstance(out, tuple) else out
            assert isinstance(first, torch.Tensor)
            first.register_hook(output_reached)

        module.register_forward_pre_hook(forward_starts)
        module.register_forward_hook(forward_ends)

    @property
    def events(self) -> list[tuple[str, str]]:
        seen: list[tuple[str, str]] = []
        owner: dict[int, str] = {}  # a host copy's address -> the group that offloaded it
        marks = iter(self.marks)
        mark = next(marks, None)
        group, reached = "", ""
        for index, (call, host) in enumerate(self.engine.calls):
            while mark is not None and mark[0] <= index:
                if mark[1] == "forward":
                    group = mark[2]
                else:
                    reached = mark[2]
                mark = next(marks, None)
            if call == "offload":
                assert isinstance(host, torch.Tensor)
                owner[host.data_ptr()] = group
                seen.append(("offload", group))
            elif call == "boundary" and reached:
                seen.append(("backward_begin", reached))
                reached = ""
            elif call == "reload" and seen[-1][0] != "prefetch":  # one batch, one prefetch
                assert isinstance(host, torch.Tensor)
                seen.append(("prefetch", owner[host.data_ptr()]))
            elif call == "read":
                assert isinstance(host, torch.Tensor)
                seen.append(("unpack", owner[host.data_ptr()]))
        return seen


@pytest.fixture
def timeline(recording_engine) -> Timeline:
    return Timeline(recording_engine())


def train(model: torch.nn.Module, steps: int, seq: int = SEQ) -> tuple[list[float], list]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def test_three_steps_bitwise_equal_to_unwrapped(tiny_model) -> None:
    """The model path: a Hugging Face model's attentions, whose queries, keys, values
    and probabilities swap at seq 512, train bit for bit as without swap."""
    base_losses, base_grads = train(tiny_model(), steps=3, seq=512)
    model = tiny_model()
    manager = SwapManager()
    wrap_attention(model, manager)
    losses, grads = train(model, steps=3, seq=512)

    assert losses == base_losses
    for step_grads, step_base in zip(grads, base_grads, strict=True):
        assert step_grads.keys() == step_base.keys()
        for name, grad in step_grads.items():
            assert torch.equal(grad, step_base[name]), name
    stats = manager.stats
    assert stats.offloaded_bytes > 0
    assert stats.reloaded_bytes == stats.offloaded_bytes
    assert stats.prefetch_misses == 0
    assert stats.per_group["model.layers.3.self_attn"].offloaded_bytes == 0
    assert stats.per_group["model.layers.3.self_attn"].kept_bytes > 0


def recording(policy: Callable, record: list) -> Callable:
    def wrapped(t: torch.Tensor) -> CheckpointPolicy:
        decision = policy(t)
        if decision is CheckpointPolicy.MUST_SWAP:
            record.append(StorageWeakRef(t.untyped_storage()))
        return decision

    return wrapped


def test_swapped_storages_are_freed_after_forward_except_last_layer(toy_model) -> None:
    records: list[list] = [[] for _ in range(4)]
    manager = SwapManager()
    model = toy_model(
        manager=manager, policy=[recording(swap_large_activations, r) for r in records]
    )
    ids = torch.randint(0, VOCAB, (2, SEQ))
    loss = model(input_ids=ids, labels=ids).loss
    manager.synchronize()
    gc.collect()

    for layer, refs in enumerate(records[:-1]):
        assert refs, f"layer {layer} swapped nothing"
        assert all(ref.expired() for ref in refs), f"layer {layer} kept a swapped storage"
    assert records[-1] and not any(ref.expired() for ref in records[-1])
    loss.backward()


def test_prefetch_is_issued_when_next_layer_backward_begins(toy_model, timeline) -> None:
    manager = SwapManager(engine=timeline.engine)
    model = toy_model(manager=manager)
    name = "layers.{}.attn".format
    for i, layer in enumerate(model.layers):
        timeline.watch(layer.attn, name(i))
    ids = torch.randint(0, VOCAB, (2, SEQ))
    model(input_ids=ids, labels=ids).loss.backward()
    events = timeline.events

    for i in range(1, 4):
        begin = events.index(("backward_begin", name(i)))
        prefetch = events.index(("prefetch", name(i - 1)))
        first_unpack = events.index(("unpack", name(i - 1)))
        assert begin < prefetch < first_unpack
        assert events[begin + 1] == ("prefetch", name(i - 1))
    assert ("prefetch", name(3)) not in events
    assert manager.prefetch_schedule() == [(name(i), name(i - 1)) for i in (3, 2, 1)]


def test_prefetch_depth_two(toy_model) -> None:
    _, base = train(toy_model(), steps=1)
    manager = SwapManager(swap_prefetch_depth=2)
    _, grads = train(toy_model(manager=manager), steps=1)
    name = "layers.{}.attn".format
    assert manager.prefetch_schedule() == [
        (name(3), name(2)),
        (name(3), name(1)),
        (name(2), name(0)),
    ]
    assert manager.stats.prefetch_misses == 0
    assert all(torch.equal(grads[0][k], base[0][k]) for k in base[0])


def test_unlinked_module_reloads_synchronously_as_a_miss() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)
    manager = SwapManager()
    swap_wrapper(lin, manager=manager, policy=swap_everything)
    x = torch.randn(1024, 256, requires_grad=True)
    (lin(x) ** 2).sum().backward()
    stats = manager.stats
    assert stats.offloaded_tensors == 1 and stats.prefetch_misses == 1 and stats.prefetch_hits == 0
    expected = x.grad.clone()
    x.grad = None
    lin_plain = torch.nn.Linear(256, 256)
    lin_plain.load_state_dict(lin.state_dict())
    (lin_plain(x) ** 2).sum().backward()
    assert torch.equal(x.grad, expected)


class AddOne(torch.nn.Module):
    """Saves nothing for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_a_layer_that_saves_nothing_still_prefetches_its_prev(timeline) -> None:
    """A group's backward begins at its first unpack, or at its output if it saved nothing."""
    lin, add = torch.nn.Linear(64, 64), AddOne()
    manager = SwapManager(engine=timeline.engine)
    swap_wrapper(lin, manager=manager, policy=swap_everything, name="lin")
    swap_wrapper(add, manager=manager, policy=swap_everything, name="add")
    manager.link(lin, add)
    timeline.watch(lin, "lin")
    timeline.watch(add, "add")
    add(lin(torch.randn(32, 64, requires_grad=True))).pow(2).sum().backward()
    events = timeline.events
    stats = manager.stats
    assert (stats.offloaded_tensors, stats.prefetch_hits, stats.prefetch_misses) == (1, 1, 0)
    assert events[events.index(("backward_begin", "add")) + 1] == ("prefetch", "lin")
    assert events.index(("prefetch", "lin")) < events.index(("unpack", "lin"))


class Tanh(torch.nn.Module):
    """Saves its own output: the tensor a caller may modify in place."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        if self.fail:
            raise RuntimeError("boom inside forward")
        return y


def test_in_place_modification_after_pack_is_an_error() -> None:
    module = Tanh()
    swap_wrapper(module, manager=SwapManager(), policy=swap_everything, name="act")
    y = module(torch.randn(32, 64, requires_grad=True))
    y.add_(1)
    with pytest.raises(SwapIntegrityError, match=r"\(32, 64\).*'act'.*in-place"):
        y.sum().backward()


def test_parameters_are_never_swapped_whatever_the_policy() -> None:
    lin = torch.nn.Linear(512, 512)
    manager = SwapManager()
    swap_wrapper(lin, manager=manager, policy=lambda t: CheckpointPolicy.MUST_SWAP)
    x = torch.randn(8, 512)
    lin(x).sum().backward()
    stats = manager.stats
    assert (stats.offloaded_tensors, stats.offloaded_bytes) == (1, x.numel() * 4)
    assert lin.weight.grad is not None


class SavesState(torch.nn.Module):
    """Saves its input and an activation, and beside them a parameter, a buffer, a
    ``.detach()`` alias of the parameter and a view of the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 64))
        self.register_buffer("scale", torch.randn(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x @ self.weight) * self.scale  # x, the weight; the buffer
        out = (h @ self.weight.detach()) * self.scale.view(1, 64)  # the alias; the view
        return out + h.exp()  # exp's output


def test_buffers_and_aliases_of_the_state_are_never_swapped_whatever_the_policy() -> None:
    module = SavesState()
    manager = SwapManager()
    swap_wrapper(module, manager=manager, policy=lambda t: CheckpointPolicy.MUST_SWAP)
    x = torch.randn(8, 64, requires_grad=True)
    module(x).sum().backward()
    stats = manager.stats
    assert (stats.offloaded_tensors, stats.offloaded_bytes) == (2, 2 * x.numel() * 4)
    assert stats.reloaded_bytes == stats.offloaded_bytes


class Gram(torch.nn.Module):
    """``h @ h.t()`` saves two aliases of one storage, ``h`` itself among them;
    ``h[:, 32:] * h[:, :32]`` saves only slices, so the storage is copied as bytes."""

    def __init__(self, slices: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.slices = slices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h[:, 32:] * h[:, :32] if self.slices else h @ h.t()


@pytest.mark.parametrize("slices", [False, True])
def test_aliases_are_copied_once_and_restored_with_their_layout(slices) -> None:
    torch.manual_seed(0)
    plain = Gram(slices)
    module = Gram(slices)
    module.load_state_dict(plain.state_dict())
    manager = SwapManager()
    swap_wrapper(module, manager=manager, policy=swap_what_needs_grad)
    x = torch.randn(128, 64)
    module(x).pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    assert manager.stats.offloaded_tensors == 1
    assert torch.equal(module.lin.weight.grad, plain.lin.weight.grad)


def test_retain_graph_backward_twice(toy_model) -> None:
    manager = SwapManager()
    model = toy_model(manager=manager)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss.backward()
    assert all(torch.equal(p.grad, first[n]) for n, p in model.named_parameters())
    stats = manager.stats
    assert stats.reloaded_bytes == 2 * stats.offloaded_bytes
    assert stats.prefetch_misses == 0


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_forward_creates_nothing(toy_model, mode, timeline) -> None:
    manager = SwapManager(engine=timeline.engine)
    model = toy_model(manager=manager)
    with mode():
        model(input_ids=torch.randint(0, VOCAB, (2, SEQ)))
    stats = manager.stats
    assert stats.offloaded_tensors == stats.kept_tensors == 0
    assert stats.host_reserved_bytes == 0
    assert timeline.events == []


def test_exception_in_forward_removes_hooks_and_releases_group() -> None:
    module = Tanh(fail=True)
    manager = SwapManager()
    swap_wrapper(module, manager=manager, policy=swap_everything)
    x = torch.randn(32, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="boom"):
        module(x)
    gc.collect()
    manager.synchronize()
    offloaded = manager.stats.offloaded_tensors
    assert offloaded == 2
    assert manager.stats.host_in_use_bytes == 0
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        torch.tanh(x).sum().backward()
    assert manager.stats.offloaded_tensors == offloaded
    assert len(packed) == 1


def test_two_forwards_before_one_backward(toy_model) -> None:
    """Gradient accumulation with both graphs alive: groups pair up per forward."""
    ids = [
        torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(s))
        for s in (1, 2)
    ]

    def accumulate(model: torch.nn.Module) -> dict:
        losses = [model(input_ids=i, labels=i).loss for i in ids]
        losses[1].backward()
        losses[0].backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    base = accumulate(toy_model())
    manager = SwapManager()
    grads = accumulate(toy_model(manager=manager))
    assert all(torch.equal(grads[n], base[n]) for n in base)
    assert manager.stats.prefetch_misses == 0


def test_exhausted_pool_keeps_tensors_on_device(toy_model) -> None:
    _, base = train(toy_model(), steps=1)
    manager = SwapManager(max_host_bytes=3 * 2**20)
    _, grads = train(toy_model(manager=manager), steps=1)
    stats = manager.stats
    assert stats.pool_exhausted > 0
    assert stats.offloaded_bytes > 0
    assert stats.host_reserved_bytes <= 3 * 2**20
    assert all(torch.equal(grads[0][k], base[0][k]) for k in base[0])


def test_host_memory_and_objects_flat_across_steps(toy_model) -> None:
    """After a first step nothing grows: not the pool, nor the objects the garbage
    collector tracks, by fewer than one per step (a swap group or host copy left
    behind per step would be several)."""
    manager = SwapManager()
    model = toy_model(manager=manager)
    train(model, steps=1)
    gc.collect()
    reserved = manager.stats.host_reserved_bytes
    objects = len(gc.get_objects())
    steps = 10
    train(model, steps=steps)
    gc.collect()
    stats = manager.stats
    assert reserved > 0
    assert stats.host_reserved_bytes == reserved
    assert stats.host_in_use_bytes == 0
    assert stats.peak_host_bytes <= reserved
    assert len(gc.get_objects()) - objects < steps


def test_linking_requires_wrapped_modules_and_refuses_cycles() -> None:
    manager = SwapManager()
    a, b, c = (swap_wrapper(torch.nn.Linear(2, 2), manager=manager) for _ in range(3))
    with pytest.raises(ValueError, match="not swap-wrapped"):
        manager.link(a, torch.nn.Linear(2, 2))
    manager.link(a, b)
    manager.link(b, c)
    with pytest.raises(ValueError, match="already linked"):
        manager.link(a, c)
    with pytest.raises(ValueError, match="cycle"):
        manager.link(c, a)
    assert [g.keep_on_device for g in manager.groups()] == [False, False, True]
    assert manager.links == [("Linear_0", "Linear_1"), ("Linear_1", "Linear_2")]


def test_invalid_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="swap_prefetch_depth"):
        SwapManager(swap_prefetch_depth=0)
    with pytest.raises(ValueError, match="max_host_bytes"):
        SwapManager(max_host_bytes=-1)


@pytest.mark.parametrize("given", [None, SimulatedAccelerator(lag=2)], ids=["default", "given"])
def test_cpu_tensors_get_the_no_op_device_unless_an_engine_is_given(given) -> None:
    """On CPU nothing needs ordering: the default engine orders nothing and checks
    nothing; tests that want every hazard checked pass the simulated device."""
    lin = torch.nn.Linear(64, 64)
    manager = SwapManager(engine=given)
    swap_wrapper(lin, manager=manager, policy=swap_everything)
    lin(torch.randn(8, 64, requires_grad=True)).sum().backward()
    [engine] = manager._ctx.engines.values()
    assert engine is given if given is not None else type(engine) is NoOpAccelerator
    assert manager.stats.offloaded_tensors == manager.stats.reloaded_tensors == 1
