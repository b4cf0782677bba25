"""One training step traced on the meta device: what the device would run, in order.

The model is built on ``meta`` (:func:`graphswap.planning.saved_tensors.build_meta_model`), given
the AdamW state its first step leaves, and then run for one steady-state step: forward,
``loss.backward()``, ``optimizer.step()`` and ``zero_grad(set_to_none=True)``, as
``graphswap train`` runs it. An :class:`~graphswap.runtime.timeline.OpTape` above the trace
modes reports every operator with its roofline time on the device profile, and every
device storage's birth and death; :func:`~graphswap.runtime.timeline.step_labels` labels
them as the simulated device does.

The saved-tensor hooks *drop* what autograd saves: pack records the save and hands
autograd a small description, unpack hands back a fresh meta tensor of the same size
and stride. So the tape shows each saved storage dying when its last *other*
reference goes, and the description's death shows when autograd releases the save.
Any swap mode's memory follows from these two times (:mod:`graphswap.planning._replay`).
The trace also records where each wrapped module's forward begins and ends (both the
attention and the whole decoder layer), which is where the runtime's offload fence runs.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from graphswap._compat import Renamed
from graphswap.hf.checkpoints import decoder_layers
from graphswap.planning.saved_tensors import (
    MetaModel,
    SavedTensor,
    SavedTensorCollector,
    SavedTensorTrace,
    running_backward,
)
from graphswap.runtime.policy import SwapPolicy, policy_name, swap_large_activations
from graphswap.runtime.profile import DeviceProfile, OpCost
from graphswap.runtime.timeline import OPTIMIZER_LABEL, OpTape, step_labels


class Event(enum.IntEnum):
    """What one entry of :attr:`StepTrace.events` says; its payload follows it."""

    COMPUTE = 0
    """Operators ran on the compute stream: seconds (consecutive operators merged; their
    costs are the event's entry in :attr:`StepTrace.costs`)."""
    LABEL = 1
    """The step moved on to the label given (``F<i>``, ``B<i>``, ``optimizer``...)."""
    ALLOC = 2
    """A device storage was born: its :class:`Block` index."""
    FREE = 3
    """The last reference other than autograd's saves dropped a storage: block index."""
    PACK = 4
    """Autograd saved a tensor: its index in :attr:`StepTrace.saves`."""
    UNPACK = 5
    """Backward read a saved tensor: save index."""
    RELEASE = 6
    """Autograd released a saved tensor: save index."""
    ENTER = 7
    """A wrapped module's forward begins: ``(scope, layer)``, the scope being
    ``attention`` or ``layer``."""
    EXIT = 8
    """A wrapped module's forward ends: ``(scope, layer)``."""


EventPayload = Any
"""What follows an :class:`Event` in :attr:`StepTrace.events`: its type depends on the
event (seconds for ``COMPUTE``, a label for ``LABEL``, an index for the others, ``(scope,
layer)`` for ``ENTER`` and ``EXIT``; see :class:`Event`). ``Any``, not the union of
those: the replay (:mod:`graphswap.planning._replay`) reads each payload as its event
says, in its inner loop, where narrowing every payload would add a check per event."""


class BlockKind(enum.Enum):
    """What a device storage holds, for what sharding divides."""

    ACTIVATION = "activation"
    """Forward and backward working memory: activations, logits, backward temporaries."""
    GRADIENT = "gradient"
    """A parameter's gradient (its storage, from the operator that made it)."""
    OPTIMIZER = "optimizer"
    """A temporary of the optimizer step."""


class Block(NamedTuple):
    """One device storage's lifetime in the traced step (a named tuple: a fit makes
    tens of thousands per length)."""

    nbytes: int
    """The storage's size."""
    kind: BlockKind
    """What it holds (what ``state_shards`` divides)."""


@dataclass(frozen=True)
class TracedSave:
    """One pack call of the traced step."""

    save: SavedTensor
    """As :class:`~graphswap.planning.saved_tensors.SavedTensorTrace` lists it; ``policy_swaps``
    is the trace's policy's answer."""
    layer: int | None
    """The decoder layer whose forward saved it; ``None`` for the embedding and head."""
    block: int | None
    """The storage's :class:`Block`; ``None`` for one alive before the step began (a
    parameter, a buffer, the input ids): never device memory of the step."""


@dataclass(frozen=True)
class StepTrace:
    """One steady-state training step of one rank, traced on meta."""

    seq_len: int
    """Tokens per sequence traced."""
    batch_size: int
    """Sequences per batch traced."""
    dtype: torch.dtype
    """The parameters' dtype, and the activations' but where autocast casts them."""
    attn_implementation: str
    """Hugging Face attention: ``sdpa`` or ``eager``."""
    loss_head: str
    """The head the loss ran: ``full``, ``chunked`` or ``trl``."""
    loss_head_chunk_size: int | None
    """``chunked``: its tokens per chunk; else ``None``."""
    device: str
    """The device training runs on: it chose the attention kernel and the optimizer's
    implementation."""
    events: tuple[tuple[Event, EventPayload], ...]
    """``(event, payload)`` in the order the device runs them (see :class:`Event`)."""
    blocks: tuple[Block, ...]
    """Every device storage born in the step, by the index ``ALLOC`` and ``FREE`` carry."""
    saves: tuple[TracedSave, ...]
    """Every pack call of the step, by the index ``PACK``, ``UNPACK`` and ``RELEASE`` carry."""
    saved: SavedTensorTrace
    """The forward's saves per scope, as the forward-only trace gives them."""
    policy: str
    """The name of the swap policy each save was asked (``policy_swaps``)."""
    profile: DeviceProfile
    """The device the operators were timed on."""
    parameter_bytes: int
    """The model's parameters on this rank, as they sit on the device."""
    buffer_bytes: int
    """The model's buffers (the rotary frequencies)."""
    optimizer_state_bytes: int
    """AdamW's ``exp_avg`` and ``exp_avg_sq`` (the step counters stay on the host); 0
    without the optimizer."""
    optimizer: bool = True
    """The step ends with AdamW's step; ``False``: forward and backward only."""
    attention_timing: tuple[str, ...] = ()
    """How the fused attention kernels of the step were timed: ``causal`` (the scores
    a causal mask leaves), ``full`` (every score), both, or neither (eager attention,
    sdpa's math path)."""
    costs: tuple[tuple[OpCost, ...], ...] = ()
    """Per ``COMPUTE`` event in order, the operators it merges: what times the step at
    another length (:mod:`graphswap.planning._lengths`); empty in a trace made by hand or
    interpolated."""
    recomputed: tuple[tuple[str, ...], ...] = ()
    """Per decoder layer, the submodules recomputed in backward (paths in the layer);
    empty: none anywhere."""
    recomputed_bytes: tuple[int, ...] = ()
    """Per decoder layer, the storage bytes its recomputed submodules saved and dropped
    (what the runtime's ``stats.recomputed_bytes`` counts); empty: none anywhere."""
    autocast_dtype: torch.dtype | None = None
    """The dtype the step computed in under autocast; ``None``: no autocast."""
    lora_rank: int | None = None
    """The rank of the LoRA adapters that trained, the base weights frozen; ``None``:
    every parameter trained."""

    seq = Renamed("seq_len")  # 0.1.0's names, until 0.3
    batch = Renamed("batch_size")

    @property
    def num_layers(self) -> int:
        return len(self.saved.layers)


class _Dropped:
    """What autograd holds instead of a saved tensor during the trace."""

    __slots__ = ("dtype", "recorder", "save", "size", "stride")

    def __init__(self, recorder: _StepRecorder, save: int, t: torch.Tensor) -> None:
        self.recorder = recorder
        self.save = save
        self.size = t.size()
        self.stride = t.stride()
        self.dtype = t.dtype

    def __del__(self) -> None:
        self.recorder.event(Event.RELEASE, self.save)


class _StepRecorder(SavedTensorCollector):
    """Listens to the tape and to the saved-tensor hooks; writes the event list."""

    def __init__(self, model: torch.nn.Module, policy: SwapPolicy) -> None:
        super().__init__(model, policy)
        self.tape: OpTape | None = None
        self.events: list[tuple[Event, EventPayload]] = []
        self.blocks: list[Block] = []
        """Per block, in birth order."""
        self.traced: list[TracedSave] = []
        self._label = ""
        self._seconds = 0.0
        """Operator time not yet written as a ``COMPUTE`` event."""
        self._costs: list[OpCost] = []
        """The operators of that time."""
        self.costs: list[tuple[OpCost, ...]] = []
        """Per ``COMPUTE`` event written, its operators."""
        self._live: dict[int, int] = {}
        """Block of each live storage, by ``_cdata``."""
        self._unpacking = False
        self._ghosts: set[int] = set()
        """Storages made by unpack: stand-ins for saved tensors, not device memory."""

    # The tape's listener.
    def on_op(self, cost: OpCost | None, seconds: float) -> None:
        if seconds:
            assert cost is not None
            self._sync_label()
            self._seconds += seconds
            self._costs.append(cost)

    def on_alloc(self, key: int, nbytes: int) -> None:
        if self._unpacking:
            self._ghosts.add(key)
            return
        block = len(self.blocks)
        assert self.tape is not None
        kind = BlockKind.OPTIMIZER if self.tape.label == OPTIMIZER_LABEL else BlockKind.ACTIVATION
        self.blocks.append(Block(nbytes, kind))
        self._live[key] = block
        self.event(Event.ALLOC, block)

    def on_free(self, key: int, nbytes: int) -> None:
        if key in self._ghosts:
            self._ghosts.discard(key)
            return
        self.event(Event.FREE, self._live.pop(key))

    def event(self, event: Event, payload: EventPayload) -> None:
        self._sync_label()
        self.flush()
        self.events.append((event, payload))

    def _sync_label(self) -> None:
        assert self.tape is not None
        label = self.tape.label
        if label != self._label:
            self.flush()
            self.events.append((Event.LABEL, label))
            self._label = label

    def flush(self) -> None:
        """Write the operator time not yet written."""
        if self._seconds:
            self.events.append((Event.COMPUTE, self._seconds))
            self.costs.append(tuple(self._costs))
            self._seconds = 0.0
            self._costs = []

    def mark_gradients(self) -> None:
        for p in self.model.parameters():
            if p.grad is not None:
                block = self._live.get(p.grad.untyped_storage()._cdata)
                if block is not None:
                    self.blocks[block] = self.blocks[block]._replace(kind=BlockKind.GRADIENT)

    # The saved-tensor hooks.
    def _storage_id(self, t: torch.Tensor, storage: torch.UntypedStorage) -> int:
        """A storage born in the step is told apart by its block (its address may be
        reused once it dies); one alive before the step, by its address."""
        key = storage._cdata
        block = self._live.get(key)
        identity: Hashable = ("block", block) if block is not None else ("storage", key)
        storage_id = self._storage_ids.get(identity)
        if storage_id is None:
            storage_id = self._storage_ids[identity] = len(self._storage_ids)
        return storage_id

    def _pack(self, t: torch.Tensor) -> _Dropped | torch.Tensor:
        if running_backward():
            # Made inside backward (the chunked head projects each chunk again there):
            # not the step's save, and no hook of the runtime's sees it; autograd keeps
            # it as it would.
            return t
        save = self.record(t)
        index = len(self.traced)
        block = self._live.get(t.untyped_storage()._cdata)
        self.traced.append(TracedSave(save, self._layer, block))
        self.event(Event.PACK, index)
        return _Dropped(self, index, t)

    def _unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        assert isinstance(packed, _Dropped)
        self.event(Event.UNPACK, packed.save)
        self._unpacking = True
        try:
            return torch.empty_strided(
                packed.size, packed.stride, dtype=packed.dtype, device="meta"
            )
        finally:
            self._unpacking = False

    def _boundary(self, scope: str, layer: int, enter: bool) -> None:
        if torch.is_grad_enabled():
            self.event(Event.ENTER if enter else Event.EXIT, (scope, layer))


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` (tied parameters count once)."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _first_step_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state of ``p`` as its first step leaves it (``amsgrad`` off, neither
    ``capturable`` nor ``fused``: the step counter on the host). Made directly: run on
    meta, that step costs as much as the traced optimizer step (on CPU, a third of a trace)."""
    return {
        "step": torch.tensor(1.0, dtype=torch.float32, device="cpu"),
        "exp_avg": torch.zeros_like(p),
        "exp_avg_sq": torch.zeros_like(p),
    }


def _backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` inside the trace's modes. ``Tensor.backward`` is itself a torch
    function, which a torch-function mode (fused attention's) handles switched off: a
    recompute in backward would then run attention on another kernel than its forward
    did. The autograd engine, called directly, runs with every mode on."""
    torch.autograd.graph._engine_run_backward(
        (loss,),
        (torch.ones_like(loss),),
        False,
        False,
        (),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def trace_step(
    meta: MetaModel,
    profile: DeviceProfile,
    policy: SwapPolicy = swap_large_activations,
    *,
    optimizer: bool = True,
) -> StepTrace:
    """Trace one steady-state training step of ``meta`` timed on ``profile``; each save
    is asked ``policy`` (its ``policy_swaps``). AdamW runs as it would on the traced
    device: ``foreach`` on CUDA, one tensor at a time on CPU. ``optimizer=False``: the
    step is forward and backward only (no AdamW state, no ``optimizer`` label), as a
    benchmark that never updates runs it; the gradients are still dropped at its end,
    as the next step's ``zero_grad(set_to_none=True)`` would."""
    model = meta.model
    params = [p for p in model.parameters() if p.requires_grad]
    adamw = None
    state: list[torch.Tensor] = []
    if optimizer:
        adamw = torch.optim.AdamW(params, lr=1e-3, foreach=meta.device == "cuda")
        for p in params:
            adamw.state[p] = _first_step_state(p)
        state = [t for s in adamw.state.values() for t in s.values() if t.device.type == "meta"]
    recorder = _StepRecorder(model, policy)
    tape = OpTape("meta", profile, recorder)
    recorder.tape = tape
    _, layers = decoder_layers(model)
    try:
        with meta.tracing(), tape, step_labels(layers, tape), recorder.collect():
            loss = meta.forward().loss
            _backward(loss)
            recorder.mark_gradients()
            if adamw is not None:
                tape.label = OPTIMIZER_LABEL
                with meta.optimizer_step():
                    adamw.step()
                adamw.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
            del loss
            recorder.flush()
    finally:
        tape.close()
    batch, seq = meta.ids.shape
    return StepTrace(
        seq_len=seq,
        batch_size=batch,
        dtype=next(model.parameters()).dtype,
        attn_implementation=meta.rank_config._attn_implementation,
        loss_head=meta.loss_head,
        loss_head_chunk_size=meta.loss_head_chunk_size,
        device=meta.device,
        events=tuple(recorder.events),
        costs=tuple(recorder.costs),
        attention_timing=tuple(
            sorted({c.attention for cs in recorder.costs for c in cs if c.attention is not None})
        ),
        blocks=tuple(recorder.blocks),
        saves=tuple(recorder.traced),
        saved=meta.saved_tensor_trace(recorder.saves),
        policy=policy_name(policy),
        profile=profile,
        parameter_bytes=storage_bytes(list(model.parameters())),
        buffer_bytes=storage_bytes(list(model.buffers())),
        optimizer_state_bytes=storage_bytes(state),
        optimizer=optimizer,
        lora_rank=meta.lora_rank,
        recomputed=meta.recomputed,
        recomputed_bytes=tuple(meta.recompute_counts.get(i, (0, 0))[1] for i in range(len(layers)))
        if meta.recomputed
        else (),
        autocast_dtype=None if meta.autocast is None else meta.autocast.dtype,
    )
