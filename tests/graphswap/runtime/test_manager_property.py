"""A wrapped model behaves exactly as the plain one, whatever users do in whatever order.

A stateful property test drives a swap-wrapped toy transformer (this folder's
``conftest.py``) and an unwrapped copy through random sequences of forwards (with and
without grad, new sequence lengths), backwards (with and without ``retain_graph``),
dropped graphs, forwards that raise and in-place changes to saved tensors, also
changes after which the caller drops every reference to the changed tensor (directly
or through a view) while its copy may still be in flight; with the default CPU engine
and with simulated accelerators that lag up to 50 module boundaries, at
``offload_lag`` up to 3. After every action the two agree bit for bit, raise
together, and once no graph is alive the swap holds no host buffer and no object of
its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from graphswap import SwapManager
from graphswap.errors import SwapIntegrityError
from graphswap.runtime._handles import _Entry
from graphswap.runtime.policy import size_threshold_policy
from graphswap.runtime.sim import SimulatedAccelerator

LAYERS = 2
swap_from_4k = size_threshold_policy(4096)
"""At seq 16 to 40 the attention's probabilities swap, its 2-5 KiB input, queries, keys
and values swap from seq 32 and stay on device below: both kinds in one group."""


class SwapVsPlain(RuleBasedStateMachine):
    engine_lag: int | None = None
    offload_lag: int = 1
    make_model: Callable[..., torch.nn.Module]
    entries: weakref.WeakSet[_Entry]
    """Every host copy record made since this example began (the test records each)."""

    def __init__(self) -> None:
        super().__init__()
        self.entries.clear()  # an earlier example's, if a cycle held them: not this one's
        self.plain = self.make_model(layers=LAYERS)
        engine = None if self.engine_lag is None else SimulatedAccelerator(lag=self.engine_lag)
        self.manager = SwapManager(engine=engine, swap_offload_lag=self.offload_lag)
        self.swap = self.make_model(layers=LAYERS, manager=self.manager, policy=swap_from_4k)
        self.graphs: list[tuple] = []

    def run_both(self, fn) -> list:
        results = []
        for model in (self.plain, self.swap):
            try:
                results.append(fn(model))
            except RuntimeError as error:
                # The traceback's frames would hold the graph in a cycle through ``results``.
                results.append(error.with_traceback(None))
        return results

    def check_errors(self, plain, swap) -> bool:
        """True when both raised; plain PyTorch's error must be matched by graphswap's."""
        plain_failed = isinstance(plain, RuntimeError)
        assert plain_failed == isinstance(swap, RuntimeError), (plain, swap)
        if plain_failed and "inplace operation" in str(plain):
            assert isinstance(swap, SwapIntegrityError), swap
        return plain_failed

    def check_grads(self) -> None:
        for (name, p), q in zip(self.plain.named_parameters(), self.swap.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), name

    @initialize(seq=st.integers(16, 40), seed=st.integers(0, 3))
    def first_forward(self, seq: int, seed: int) -> None:
        self.forward(seq, seed)

    @rule(seq=st.integers(16, 40), seed=st.integers(0, 3))
    def forward(self, seq: int, seed: int) -> None:
        ids = torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(seed))
        plain, swap = self.run_both(lambda m: m(input_ids=ids, labels=ids, output_attentions=True))
        assert torch.equal(plain.loss, swap.loss)
        self.graphs.append((plain, swap))

    @rule(seq=st.integers(16, 48))
    def forward_no_grad(self, seq: int) -> None:
        ids = torch.arange(seq).remainder(512)[None]
        with torch.no_grad():
            plain, swap = self.run_both(lambda m: m(input_ids=ids).logits)
        assert torch.equal(plain, swap)

    @rule(layer=st.integers(0, LAYERS - 1))
    def forward_raises_half_way(self, layer: int) -> None:
        def boom(*_args) -> None:
            raise RuntimeError("boom")

        hooks = [m.layers[layer].mlp.register_forward_hook(boom) for m in (self.plain, self.swap)]
        ids = torch.arange(32)[None]
        try:
            plain, swap = self.run_both(lambda m: m(input_ids=ids, labels=ids))
        finally:
            for hook in hooks:
                hook.remove()
        assert self.check_errors(plain, swap)

    @precondition(lambda self: self.graphs)
    @rule(
        pick=st.integers(0, 7),
        retain=st.booleans(),
        modify=st.sets(st.integers(0, LAYERS - 1), max_size=LAYERS),
    )
    def backward(self, pick: int, retain: bool, modify: set[int]) -> None:
        """Backward, after an in-place change to the saved attentions of ``modify``."""
        index = pick % len(self.graphs)
        self.modify_saved_tensors_in_place(index, modify)
        outs = dict(zip((self.plain, self.swap), self.graphs[index], strict=True))
        plain, swap = self.run_both(lambda m: outs[m].loss.backward(retain_graph=retain))
        failed = self.check_errors(plain, swap)
        self.check_grads()
        if failed or not retain:
            del self.graphs[index]

    @precondition(lambda self: self.graphs)
    @rule(pick=st.integers(0, 7))
    def drop_graph(self, pick: int) -> None:
        del self.graphs[pick % len(self.graphs)]

    @precondition(lambda self: self.graphs)
    @rule(
        pick=st.integers(0, 7),
        layers=st.sets(st.integers(0, LAYERS - 1), min_size=1, max_size=LAYERS),
        through_view=st.booleans(),
    )
    def change_in_place_then_drop(self, pick: int, layers: set[int], through_view: bool) -> None:
        """Change saved attentions in place, then drop every reference to them: only
        autograd (and, for a swapped tensor, a copy perhaps still in flight) holds them."""
        index = pick % len(self.graphs)
        for out in self.graphs[index]:
            if out.attentions is None:
                continue
            for layer in layers:
                saved = out.attentions[layer]
                (saved[..., 1:] if through_view else saved).add_(1.0)
            out.attentions = None

    def modify_saved_tensors_in_place(self, index: int, layers: set[int]) -> None:
        for out in self.graphs[index]:
            if out.attentions is None:
                continue  # dropped by change_in_place_then_drop
            for layer in layers:
                out.attentions[layer].mul_(0.5)

    @invariant()
    def nothing_outlives_its_graph(self) -> None:
        if self.graphs:
            return
        assert self.manager.stats.host_in_use_bytes == 0
        # No host copy record is left, not even in a cycle the collector has yet to free
        # (such a cycle keeps its weak references alive too).
        assert not self.entries


@pytest.mark.parametrize(
    ("engine_lag", "offload_lag"),
    [(None, 1), (3, 1), (50, 0), (50, 2), (50, 3)],
    ids=["cpu", "sim3", "sim50-offload0", "sim50-offload2", "sim50-offload3"],
)
def test_swap_behaves_as_plain_pytorch(
    toy_model: Callable[..., torch.nn.Module],
    engine_lag: int | None,
    offload_lag: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entries: weakref.WeakSet[_Entry] = weakref.WeakSet()
    make_entry = _Entry.__init__

    def record_entry(entry: _Entry, *args: object) -> None:
        make_entry(entry, *args)  # type: ignore[arg-type]
        entries.add(entry)

    monkeypatch.setattr(_Entry, "__init__", record_entry)
    machine = type(
        f"SwapVsPlain_{engine_lag}_{offload_lag}",
        (SwapVsPlain,),
        {
            "engine_lag": engine_lag,
            "offload_lag": offload_lag,
            "make_model": staticmethod(toy_model),
            "entries": entries,
        },
    )
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=25,
            stateful_step_count=12,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
