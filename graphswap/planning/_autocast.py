"""Autocast in a meta-device trace, as the training device runs it.

``torch.autocast`` does nothing to meta tensors: its dispatch keys belong to a backend
(CPU, CUDA), and a meta tensor has neither. Yet under autocast an fp32 model saves other
tensors than without: a linear saves bf16 copies of its input and weight, sdpa bf16
copies of q, k and v. So the trace asks PyTorch's own autocast what it does, on fake
tensors of the training device (:class:`~torch._subclasses.fake_tensor.FakeTensorMode`,
which, unlike meta, carries the device's dispatch keys), and does the same to the meta
tensors.

Each torch function the model calls is asked once per signature (the function, its
arguments' dtypes and their other values): run on fakes under autocast and without, the
difference is the casts autocast makes of its inputs. The meta call then casts those
inputs first (a leaf parameter's cast kept for the rest of the forward, as autocast's
weight cache keeps it) and runs with autocast off inside, as autocast's own kernels do.
A function whose autocast casts something other than its inputs (a composite whose inner
operator autocast lists) cannot be replayed this way, and is refused rather than traced
wrong. Autocast regions the model opens itself (``maybe_autocast(enabled=False)`` around
the rotary frequencies) and its questions (``torch.is_autocast_enabled``) are answered
as the training device would answer them.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from graphswap.hf.attention_kernels import PlanSettingError

AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes autocast computes in, by name (``--autocast-dtype``, the config's spelling)."""


@dataclass(frozen=True)
class _Answer:
    """What autocast does to one call of a function with one signature."""

    casts: tuple[tuple[int, torch.dtype], ...]
    """``(leaf index, dtype)``: the inputs autocast casts, and to what."""


_NOTHING = _Answer(())

_CAPACITY = 4096
_answers: collections.OrderedDict[Hashable, _Answer] = collections.OrderedDict()
"""Answers by ``(device, dtype, function, signature)``, least recently used first: a
signature holds no sizes, so one model's layers share theirs."""
_lock = threading.Lock()


class _Ops(TorchDispatchMode):
    """Records every operator below it: a ``_to_copy`` as its source's id and dtype,
    any other as ``None`` (metadata queries not at all)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's __init__ is unannotated
        self.ops: list[tuple[int, torch.dtype | None] | None] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        cast = func is torch.ops.aten._to_copy.default
        if cast:
            self.ops.append((id(args[0]), kwargs.get("dtype")))
        elif func.namespace != "prim":  # not a query of metadata (prim.device)
            self.ops.append(None)
        return func(*args, **kwargs)


_Cast = tuple[int | None, torch.dtype | None]
"""A ``_to_copy`` a run made: the leaf it cast (``None``: a tensor made inside), its dtype."""


def _leading(ops: list[_Cast | None]) -> list[tuple[int, torch.dtype]]:
    """The casts of inputs a run began with, before its first other operator: where an
    autocast kernel casts the operator's inputs, before it runs it."""
    found = []
    for op in ops:
        if op is None or op[0] is None or op[1] is None:
            break
        found.append((op[0], op[1]))
    return found


@contextmanager
def _autocast_state(device: str, dtype: torch.dtype, enabled: bool) -> Iterator[None]:
    """Autocast on ``device`` set directly, without ``torch.autocast``'s check that the
    device is present: a CUDA step is planned on a host that has none. No weight cache:
    the fakes are thrown away."""
    before = (
        torch.is_autocast_enabled(device),
        torch.get_autocast_dtype(device),
        torch.is_autocast_cache_enabled(),
    )
    torch.set_autocast_enabled(device, enabled)
    torch.set_autocast_dtype(device, dtype)
    torch.set_autocast_cache_enabled(False)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        torch.autocast_decrement_nesting()
        torch.set_autocast_enabled(device, before[0])
        torch.set_autocast_dtype(device, before[1])
        torch.set_autocast_cache_enabled(before[2])


def _run(
    func: Callable[..., Any],
    leaves: list[Any],
    spec: pytree.TreeSpec,
    device: str,
    dtype: torch.dtype,
    *,
    autocast: bool,
    casts: tuple[tuple[int, torch.dtype], ...] = (),
) -> tuple[list[_Cast | None], tuple[torch.dtype, ...]]:
    """``func`` on fakes of ``leaves`` (meta ones on ``device``), their ``casts`` made
    first: the operators it ran (:class:`_Ops`, a cast's source as a leaf index) and
    its outputs' dtypes."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        mirrors = [
            (
                torch.empty_strided(
                    leaf.shape,
                    leaf.stride(),
                    dtype=leaf.dtype,
                    device=device if leaf.device.type == "meta" else leaf.device,
                )
                if isinstance(leaf, torch.Tensor)
                else leaf
            )
            for leaf in leaves
        ]
        for index, to in casts:
            mirrors[index] = mirrors[index].to(to)
    index_of = {id(m): i for i, m in enumerate(mirrors) if isinstance(m, torch.Tensor)}
    args, kwargs = pytree.tree_unflatten(mirrors, spec)
    recorder = _Ops()
    state = _autocast_state(device, dtype, autocast)
    with fake, state, recorder, torch.no_grad():
        out = func(*args, **kwargs)
    made = [None if op is None else (index_of.get(op[0]), op[1]) for op in recorder.ops]
    dtypes = tuple(t.dtype for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    return made, dtypes


def _ask(
    func: Callable[..., Any],
    leaves: list[Any],
    spec: pytree.TreeSpec,
    device: str,
    dtype: torch.dtype,
) -> _Answer:
    """What autocast on ``device`` in ``dtype`` does to ``func`` of ``leaves``: the casts
    of its inputs it begins with under autocast and not without; refused (naming the
    function) when making those casts and running it without autocast does not run
    what autocast runs."""
    with _disable_current_modes(), torch._C.DisableTorchFunction(), _quiet():
        try:
            under, under_out = _run(func, leaves, spec, device, dtype, autocast=True)
        except Exception:  # no operator fakes run (a storage's, a hook's): no cast
            return _NOTHING
        try:
            plain, plain_out = _run(func, leaves, spec, device, dtype, autocast=False)
        except Exception:  # runs only under autocast (q, k, v of two dtypes)
            plain, plain_out = [], None
        if under == plain and under_out == plain_out:
            return _NOTHING
        own = collections.Counter(_leading(plain))
        casts: dict[int, torch.dtype] = {}
        for index, to in _leading(under):
            if own[(index, to)]:
                own[(index, to)] -= 1
            elif casts.setdefault(index, to) != to:
                raise _cannot_follow(func, device, dtype)
        answer = _Answer(tuple(sorted(casts.items())))
        replayed, replayed_out = _run(
            func, leaves, spec, device, dtype, autocast=False, casts=answer.casts
        )
        rest = collections.Counter(op[1] for op in under if op is not None)
        rest.subtract(to for _, to in answer.casts)
        if +rest != collections.Counter(op[1] for op in replayed if op is not None) or (
            replayed_out != under_out
        ):
            raise _cannot_follow(func, device, dtype)
    return answer


@contextmanager
def _quiet() -> Iterator[None]:
    """Fake tensors log an operator that fails on them before raising; here a failure
    is an answer (the call runs only under autocast, or on no fake), not an error."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    before, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = before


def _cannot_follow(func: Callable[..., Any], device: str, dtype: torch.dtype) -> PlanSettingError:
    return PlanSettingError(
        "autocast_dtype",
        str(dtype).removeprefix("torch."),
        f"under {device} autocast, {getattr(func, '__name__', func)} casts tensors made"
        " inside it, which a meta-device trace cannot follow; plan without autocast"
        " (build the model in the dtype autocast computes in)",
    )


def _key(leaf: Any) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return (leaf.dtype, leaf.device.type == "meta")
    try:
        hash(leaf)
    except TypeError:
        return ("unhashable", repr(leaf))
    return (type(leaf), leaf)


class AutocastTrace(TorchFunctionMode):
    """Autocast on ``device`` in ``dtype`` for the meta tensors of a trace (see the
    module's docstring); enter it inside the trace's other torch-function modes, so that
    they see the casts' results."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.device = device
        self.dtype = dtype
        self.enabled = [True]
        """Autocast's state, innermost region last (the model's own regions push)."""
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Autocast's weight cache: a leaf parameter's cast, by the parameter's id (the
        parameter held too), until the forward ends (:meth:`forward_done`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if not self.enabled[-1] or getattr(func, "__name__", "") == "__get__":
            return func(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in leaves):
            return func(*args, **kwargs)
        key: Hashable | None = (self.device, self.dtype, func, spec, tuple(map(_key, leaves)))
        try:
            with _lock:
                answer = _answers.get(key)
                if answer is not None:
                    _answers.move_to_end(key)
        except TypeError:  # an argument that cannot be told apart: asked every time
            answer, key = None, None
        if answer is None:
            answer = _ask(func, leaves, spec, self.device, self.dtype)
            if key is not None:
                with _lock:
                    _answers[key] = answer
                    while len(_answers) > _CAPACITY:
                        _answers.popitem(last=False)
        if not answer.casts:
            return func(*args, **kwargs)
        for index, to in answer.casts:
            leaves[index] = self._cast(leaves[index], to)
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        self.enabled.append(False)  # autocast's kernels run the operator with autocast off
        try:
            return func(*args, **kwargs)
        finally:
            self.enabled.pop()

    def _cast(self, t: torch.Tensor, to: torch.dtype) -> torch.Tensor:
        """``t.to(to)``, from autocast's weight cache for what it caches: an fp32 leaf
        that requires grad cast to the lower precision, in forward."""
        cached = (
            to == self.dtype
            and t.dtype == torch.float32
            and t.is_leaf
            and t.requires_grad
            and not t._is_view()
            and torch._C._current_graph_task_id() == -1  # a recompute's region has its own
        )
        if not cached:
            return t.to(to)
        found = self.weights.get(id(t))
        if found is None:
            found = self.weights[id(t)] = (t, t.to(to))
        return found[1]

    def forward_done(self) -> None:
        """The forward's autocast region ends: its weight cache is cleared."""
        self.weights.clear()

    @contextmanager
    def region(self, enabled: bool) -> Iterator[None]:
        """A region the model opens (``maybe_autocast`` on meta): autocast on or off."""
        self.enabled.append(enabled)
        try:
            yield
        finally:
            self.enabled.pop()

    @contextmanager
    def answering(self) -> Iterator[None]:
        """The model's questions about autocast on meta answered as on the training
        device, and its own autocast regions there kept."""
        is_enabled, get_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

        def enabled(*args: Any) -> bool:
            if args and args[0] == "meta":
                return self.enabled[-1]
            return is_enabled(*args)

        def dtype(device_type: str) -> torch.dtype:
            return self.dtype if device_type == "meta" else get_dtype(device_type)

        from transformers.utils import generic

        original = generic.maybe_autocast

        def maybe_autocast(
            device_type: str,
            dtype: torch.dtype | None = None,
            enabled: bool = True,
            cache_enabled: bool | None = None,
        ) -> Any:
            if device_type == "meta":
                return self.region(enabled) if enabled != self.enabled[-1] else nullcontext()
            return original(device_type, dtype, enabled, cache_enabled)

        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(torch, "is_autocast_enabled", enabled))
            stack.enter_context(mock.patch.object(torch, "get_autocast_dtype", dtype))
            for name, module in list(sys.modules.items()):
                if name.startswith("transformers.") and (
                    getattr(module, "maybe_autocast", None) is original
                ):
                    stack.enter_context(mock.patch.object(module, "maybe_autocast", maybe_autocast))
            yield
