"""Count the activation bytes still held on the compute device at the end of forward.

It is independent of the swap runtime: it never asks graphswap what it swapped, so
the trainer and the benchmark can check the runtime's claims against it.
A dispatch mode records a weak reference to every storage that an operator
allocates while it is active; at the end of forward, the storages still alive (less
the model's outputs) are the ones autograd holds for backward. Storages allocated
inside a saved-tensor pack hook are the swap's own host copies, not activations,
so any pack hook pushed while the tracker runs is wrapped to mark its extent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from torch._ops import OpOverload


class ResidentActivationTracker(TorchDispatchMode):
    """Records storages born on ``device`` while active; :meth:`resident_bytes` sums
    the ones alive now."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode unannotated
        self.device = torch.device(device)
        self._born: dict[int, tuple[StorageWeakRef, int]] = {}
        self._pack_depth = 0
        self.packed_bytes = 0
        """Bytes of tensors that pack hooks received (what a swap could move)."""

    def __torch_dispatch__(
        self,
        func: OpOverload[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._pack_depth:
            return out
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or not self._on_device(t):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs:
                continue
            known = self._born.get(key)
            if known is None or known[0].expired():
                self._born[key] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def _on_device(self, t: torch.Tensor) -> bool:
        if t.device.type != self.device.type:
            return False
        return self.device.index is None or t.device.index == self.device.index

    def resident_bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """Bytes of recorded storages alive now, less those of ``exclude`` (the outputs)."""
        skip = {t.untyped_storage()._cdata for t in exclude}
        return sum(
            nbytes
            for key, (ref, nbytes) in self._born.items()
            if key not in skip and not ref.expired()
        )

    def _wrap_pack(self, pack: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
        def pack_marked(t: torch.Tensor) -> Any:
            self.packed_bytes += t.numel() * t.element_size()
            self._pack_depth += 1
            try:
                return pack(t)
            finally:
                self._pack_depth -= 1

        return pack_marked

    @contextmanager
    def track(self) -> Iterator[ResidentActivationTracker]:
        """Active tracking: the dispatch mode plus pack hooks marked as they are pushed."""
        autograd = torch._C._autograd
        push = autograd._push_saved_tensors_default_hooks

        def push_marked(
            pack_hook: Callable[[torch.Tensor], Any], unpack_hook: Callable[[Any], torch.Tensor]
        ) -> None:
            push(self._wrap_pack(pack_hook), unpack_hook)

        autograd._push_saved_tensors_default_hooks = push_marked
        try:
            with self:
                yield self
        finally:
            autograd._push_saved_tensors_default_hooks = push


def output_tensors(output: object) -> list[torch.Tensor]:
    """Every tensor in a model output (a ``ModelOutput``, tuple or dict)."""
    if hasattr(output, "to_tuple"):
        output = output.to_tuple()
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
