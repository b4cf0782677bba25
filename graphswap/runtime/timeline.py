"""A step's timeline, and the op tape it is made from: every operator a step runs on
one device, with its time and memory.

Public: the planner's ``MemoryPlan.timeline`` and the clocked runs report
:class:`StepTimeline` objects, and both label the step with :func:`step_labels`.

A dispatch mode sees each operator once, below autograd, in the order the device
would run it. For each it reports the kernel's cost and roofline time
(:func:`~graphswap.runtime.profile.op_cost`) and the storages it allocated; a
finalizer on each storage reports when it dies (PyTorch keeps a storage's Python
object alive with the storage, so the finalizer runs when the last reference, Python
or C++, is dropped). The simulated device drives
its clock from a live tape of the real run; the planner records a tape of the same
step traced on the meta device. Both label it with :func:`step_labels`, so a
stall or a peak is attributed to the same layer and phase on both sides.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from graphswap.runtime.profile import DeviceProfile, OpCost, op_cost

EMBED_LABEL = "embed"
HEAD_LABEL = "head"
OPTIMIZER_LABEL = "optimizer"


def forward_label(index: int) -> str:
    return f"F{index}"


def backward_label(index: int) -> str:
    return f"B{index}"


class TapeListener(Protocol):
    """What a tape reports to: the simulated device's clock, or the planner's recorder."""

    def on_op(self, cost: OpCost | None, seconds: float) -> None:
        """An operator ran; its kernel (``None``: it launches none) takes ``seconds`` on the
        compute stream."""

    def on_alloc(self, key: int, nbytes: int) -> None:
        """A device storage was born (after the operator that made it)."""

    def on_free(self, key: int, nbytes: int) -> None:
        """A device storage died."""


_ALIASING: dict[Any, bool] = {}


def _may_alias(func: Any) -> bool:
    """Whether an output of ``func`` may alias an input (its schema says so: views,
    in-place and ``out=`` variants, ``set_``)."""
    found = _ALIASING.get(func)
    if found is None:
        found = _ALIASING[func] = any(r.alias_info is not None for r in func._schema.returns)
    return found


class OpTape(TorchDispatchMode):
    """While active, reports every operator touching ``device_type`` to ``listener``.

    ``label`` says where the step is (set by :func:`step_labels` or the caller).
    Work the tape's owner does itself (a simulated copy, a host buffer) runs under
    :meth:`suspended`; a device storage made there is reported with :meth:`track`.
    """

    def __init__(self, device_type: str, profile: DeviceProfile, listener: TapeListener) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode unannotated
        self.device_type = device_type
        self.profile = profile
        self.listener = listener
        self.label = EMBED_LABEL
        self._suspended = 0
        self._live: dict[int, weakref.finalize[..., Any]] = {}
        """Device storages born while the tape runs and still alive, by ``_cdata``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._suspended:
            return out
        device_type = self.device_type
        outputs = [
            t
            for t in tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.device.type == device_type
        ]
        if not outputs and not any(
            isinstance(t, torch.Tensor) and t.device.type == device_type
            for t in tree_leaves((args, kwargs))
        ):
            return out
        cost = op_cost(func, args, kwargs, out)
        self.listener.on_op(cost, 0.0 if cost is None else cost.seconds(self.profile))
        live = self._live
        fresh = [s for s in (t.untyped_storage() for t in outputs) if s._cdata not in live]
        if fresh and _may_alias(func):
            # An output that aliases an input (a view, an in-place result) was not born
            # here; one not known to the tape was alive before it started (a parameter).
            inputs = {
                (x.untyped_storage() if isinstance(x, torch.Tensor) else x)._cdata
                for x in tree_leaves((args, kwargs))
                if isinstance(x, torch.UntypedStorage)
                or (isinstance(x, torch.Tensor) and x.layout is torch.strided)
            }
            fresh = [storage for storage in fresh if storage._cdata not in inputs]
        for storage in fresh:
            self.track(storage)
        return out

    def track(self, storage: torch.UntypedStorage) -> None:
        """Report ``storage`` born now, unless it is known already."""
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        finalizer = weakref.finalize(storage, self._died, key, nbytes)
        finalizer.atexit = False
        self._live[key] = finalizer
        self.listener.on_alloc(key, nbytes)

    def is_tracked(self, storage: torch.UntypedStorage) -> bool:
        return storage._cdata in self._live

    def _died(self, key: int, nbytes: int) -> None:
        del self._live[key]
        self.listener.on_free(key, nbytes)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Operators run here are not the model's: not timed, their storages not tracked."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def close(self) -> None:
        """Stop reporting deaths: storages that outlive the tape are no longer its concern."""
        for finalizer in self._live.values():
            finalizer.detach()
        self._live.clear()


class Labelled(Protocol):
    """What :func:`step_labels` labels: a tape, or a user's own recorder."""

    label: str


@contextlib.contextmanager
def step_labels(layers: Iterable[torch.nn.Module], tape: Labelled) -> Iterator[None]:
    """Label the tape by decoder layer: ``embed``, ``F<i>`` in layer i's forward,
    ``head`` after the last, ``B<i>`` from when the gradient of layer i's output
    arrives (its backward begins) until the next layer's does. The caller sets
    ``optimizer`` itself.

    The planner and the clocked simulator name a step's peak and stalls by these
    labels (``StepTimeline.peak_label``); a recorder of one's own (any object with a
    ``label`` attribute, read while it measures) gets the same names on a real device."""

    def enter(index: int) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            tape.label = forward_label(index)

        return hook

    def leave(index: int) -> Any:
        def set_backward(grad: torch.Tensor) -> None:
            tape.label = backward_label(index)

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            tape.label = HEAD_LABEL
            if not torch.is_grad_enabled():
                return
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(set_backward)
                    break

        return hook

    handles = []
    try:
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(enter(i)))
            handles.append(layer.register_forward_hook(leave(i)))
        tape.label = EMBED_LABEL
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class StepTimeline:
    """One step on a clocked device: what the planner predicts and the simulated device
    measures, in the same terms. Times in seconds from the step's start, on the
    device's streams; bytes of device memory."""

    step_seconds: float = 0.0
    """When the last stream went idle."""
    compute_seconds: float = 0.0
    """Compute stream busy: the sum of the operators' roofline times."""
    stalls: dict[str, float] = field(default_factory=dict)
    """Compute stream waiting on a swap copy, by label (``F<i>``, ``B<i>``, ...)."""
    d2h_seconds: float = 0.0
    """Device-to-host stream busy."""
    h2d_seconds: float = 0.0
    """Host-to-device stream busy."""
    base_bytes: int = 0
    """Device memory already held when the step began (parameters, optimizer state)."""
    peak_bytes: int = 0
    """The most device memory held at once, ``base_bytes`` included."""
    peak_label: str = EMBED_LABEL
    """Where the peak fell."""
    peak_seconds: float = 0.0
    memory: list[tuple[float, int]] = field(default_factory=list, repr=False)
    """``(seconds, bytes)`` after each change of device memory."""

    @property
    def stall_seconds(self) -> float:
        return sum(self.stalls.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_seconds": self.step_seconds,
            "compute_seconds": self.compute_seconds,
            "stall_seconds": self.stall_seconds,
            "stalls": dict(self.stalls),
            "d2h_seconds": self.d2h_seconds,
            "h2d_seconds": self.h2d_seconds,
            "base_bytes": self.base_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_label": self.peak_label,
            "peak_seconds": self.peak_seconds,
        }
