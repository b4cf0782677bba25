"""The swap runtime: the manager, the wrappers (swap and recompute), the copy engines,
the host pool, and the chunked projection and cross-entropy of the loss head. The
simulated accelerator is :mod:`graphswap.runtime.sim`, which this package does not
import. ``_manager.py`` maps the runtime's objects, one file each.

The hot path (the pack and unpack hooks, the module boundary, the copy engine) runs for
every saved tensor of every wrapped forward, so it is written for the interpreter
(``tools/swap_counts.py`` counts its calls and bytecodes, ``tools/bench_swap.py
--overhead`` times it beside two bare hooks). Every trick it uses, and why:

- A forward is its own pack hook and the dict of its offloads: ``_forward._Forward``
  subclasses ``dict`` (storage key -> entry) and defines ``__call__``, so a forward costs
  one object and autograd calls no bound method. It compares and hashes by identity
  (``object.__eq__``/``__hash__``): a dict's value equality would make two forwards
  equal and unhashable. Its truth is the dict's (offloaded anything); test ``is None``.
- A kept tensor's handle is a plain tuple ``(alias, version, forward)``, built without a
  Python call; the unpack tells it from a ``_Swapped`` by ``isinstance(packed, tuple)``.
- Version aliasing (I7): ``t.detach()`` shares ``t``'s version counter, and setting its
  ``.data`` to an empty tensor (a DTensor: its ``_local_tensor``) drops the bytes but
  keeps the counter, so an in-place change through any alias is seen at unpack after
  every Python object of ``t`` died (``_handles.version_alias``, ``_Swapped``).
- A swapped storage is one object: ``_handles._Entry`` subclasses the engine's
  ``_engines._Offload``, and the built-in engine writes the copy's fields into it
  (``AcceleratorCopyEngine._offload_into``, allowed by ``CopyEngine._fills_records``). A
  user's engine returns its own ``Copy``: its entries are ``_ForeignEntry``, which pass
  the offload's calls on to it. The runtime calls them on the entry either way; the
  class, chosen once in ``_Forward.offload``, is the one place the two are told apart
  (``copy()``: what the engine is handed back in ``after``; ``in_order``). The pack hands
  ``_offload_into`` the size, device and storage it has already read: ``Tensor.nbytes``,
  ``.device``, ``.untyped_storage()`` and the like cost a hundred-odd nanoseconds each, so
  none is read twice per tensor: the storage key goes from the pack to ``offload``, a host
  buffer keeps its view's stride (``HostBuffer.view_stride``: a saved tensor with that
  stride is contiguous, not asked), and a reload counts its group's bytes with its
  offload's ``nbytes``, not the host tensor's.
- Storages are keyed by ``UntypedStorage._cdata`` (the C pointer, stable while alive):
  one host copy per storage however many views are saved (I10).
- The parameter check is inline in the pack hook (``type(t) is Tensor``, ``_base``,
  ``_is_param``) and the protected storages (``_state_storages``) are read from the
  modules' ``_parameters``/``_buffers``/``_modules`` tables, only when a tensor may
  share one: ``Module.parameters()`` would also build every name.
- Backward is detected at a forward's first unpack by ``_current_graph_task_id``, not by
  a hook on its outputs (which would cost more than a small layer's swap); a forward
  that saved nothing registers one (``_Forward.begin_at_outputs``).
- Copies are ordered by what the host knows (``_engines._Lane``): events are pooled and
  recorded again, a module boundary's offloads share one mark (``_Batch`` is that mark),
  copies under ``GROUP_BYTES`` go in groups (one wait for their producer and one for the
  newest reload of their host buffers, one mark per group of reloads, made open and
  handed to its copies as they are issued), and a wait implied by an earlier one, or by
  a completion the host saw, is skipped: at most three accelerator calls per swapped
  tensor and direction.
- Class swaps (``_class_swap.ClassSwap``, shared by ``swap_wrapper``,
  ``recompute_wrapper`` and the chunked loss head of ``graphswap.rewriting.loss_head``):
  ``module.__class__`` becomes a generated subclass, so the object, FQNs and
  ``isinstance`` stay (I3); ``copyreg`` pickles it by recipe.
- Hot names are read once into module globals (``_TENSOR``, ``_MUST_SWAP``,
  ``_task_id``, ``_use_count``); locks are taken with ``acquire``/``release``, not
  ``with`` (which makes two bound methods a call); every hot class has ``__slots__``;
  in-flight forwards are held by weak reference, so a graph dropped unused is freed by
  reference counting alone (I8).

Private torch entry points, all of them, and why:

- ``torch._C._autograd._push_saved_tensors_default_hooks`` / ``_pop_...``
  (``_manager``): what ``torch.autograd.graph.saved_tensors_hooks`` does, without its
  object and calls per forward.
- ``torch._C._autograd._top_saved_tensors_default_hooks`` (``_manager``, ``_group``,
  ``_recompute``): which hooks are installed, to refuse checkpointing and other
  offloaders under the swap (I6) and to nest the recompute's.
- ``torch._C._current_graph_task_id`` (``_manager``, ``_group``, ``_handles``): whether a
  backward runs and which: backward begin, and reentrant checkpointing refused.
- ``torch._C._storage_Use_Count`` (``_engines``): whether another reference keeps an
  offloaded source on device (copied but not freed, I12).
- ``torch._C._set_grad_enabled`` (``_engines``): grad off while a group of offloads is
  queued at a module boundary, without ``torch.no_grad()``'s object and calls.
- ``torch._C._DisableTorchDispatch`` (``_handles``): the one empty tensor per device
  that version aliases hold is made unseen by any dispatch mode, so the step that
  happens to make it (a planner's trace, a clocked step) does not count it as its own.
- ``Tensor._base``, ``Tensor._version``, ``Tensor._is_param``, ``UntypedStorage._cdata``
  (``_forward``, ``_handles``, ``_recompute``, ``policy``, ``sim``, ``timeline``): views of
  parameters, the in-place check, the flag ``Parameter``'s instance check reads on a plain
  tensor, storage identity.
- ``DTensor._local_tensor`` and ``DTensor._spec`` (``policy``, ``_handles``): swap a
  DTensor's shard and rebuild the DTensor around the reload.
- ``Module._parameters``, ``_buffers``, ``_modules`` (``_forward``): see above.
- ``torch.utils._pytree.tree_leaves`` (``_forward``, ``profile``, ``sim``, ``timeline``):
  the tensors of a nested output.
- ``torch.utils._python_dispatch.TorchDispatchMode`` and ``OpOverload._overloadpacket``
  (``_recompute``, ``sim``, ``profile``, ``timeline``): see every operator below
  autograd (saved matmuls, the simulated streams, the clock's costs).
- ``torch._dynamo.exc.TorchRuntimeError`` and ``_dynamo_marked_constant`` (``_group``):
  the refusal of torch.compile reaches the user as raised, in every mode.
"""

from graphswap._compat import module_getattr
from graphswap.runtime._engines import (
    AcceleratorCopyEngine,
    CopyEngine,
    HazardError,
    NoOpAccelerator,
)
from graphswap.runtime._group import GroupInfo
from graphswap.runtime._loss_head import chunked_linear_cross_entropy
from graphswap.runtime._manager import SwapManager
from graphswap.runtime._pool import default_max_host_bytes
from graphswap.runtime._recompute import (
    is_recompute_wrapped,
    recompute_wrapper,
    unwrap_recompute,
)
from graphswap.runtime._stats import GroupStats, SwapStats
from graphswap.runtime._wrapper import (
    is_swap_wrapped,
    swap_manager_of,
    swap_wrapper,
    unwrap_swap,
)
from graphswap.runtime.timeline import step_labels

__all__ = [
    "AcceleratorCopyEngine",
    "CopyEngine",
    "GroupInfo",
    "GroupStats",
    "HazardError",
    "NoOpAccelerator",
    "SwapManager",
    "SwapStats",
    "chunked_linear_cross_entropy",
    "default_max_host_bytes",
    "is_recompute_wrapped",
    "is_swap_wrapped",
    "recompute_wrapper",
    "step_labels",
    "swap_manager_of",
    "swap_wrapper",
    "unwrap_recompute",
    "unwrap_swap",
]

__getattr__ = module_getattr(__name__)  # 0.1.0 names that moved, until 0.3
