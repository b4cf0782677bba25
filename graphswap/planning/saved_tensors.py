"""Every tensor autograd saves in one forward, in saving order, traced on the meta device.

The model is built on ``meta`` and run forward once under saved-tensor hooks: each save
is recorded with the scope that made it (the embedding, a decoder layer, or the head
after the last layer), whether the attention made it, and what the swap policy answers,
exactly as the runtime would ask. Sizes come from the meta tensors, so nothing is
allocated and a 94-layer model at 32k tokens traces in seconds. Attention runs the
kernel the training device will run (:mod:`graphswap.hf.attention_kernels`), and under
tensor parallelism the model is one rank's share of it (:func:`per_rank_config`).

A layer's saves are listed in the order its forward makes them, every pack call
counted (parameters too), so that a runtime hook counting its own pack calls can find
a save by its index and check it by shape and dtype.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphswap.errors import HierarchyError, LossHeadError, NoMatchError, RewriteError
from graphswap.hf import trl_head
from graphswap.hf.attention_kernels import AttentionKernel, FusedAttentionMode, PlanSettingError
from graphswap.hf.checkpoints import build_model, decoder_layers, eager_only
from graphswap.hf.decoder import attention_child, decoder_classes, head_sharding_problem
from graphswap.hf.lora import LORA_TARGET_MODULES, inject_lora
from graphswap.hf.loss_head import LossHead
from graphswap.planning._autocast import AutocastTrace
from graphswap.planning._settings import StepShape
from graphswap.planning._units import (
    RecomputeKind,
    recompute_units,
    reruns_down_projections,
    saves_matmuls,
)
from graphswap.rewriting.loss_head import chunk_loss_head
from graphswap.rewriting.rules import SWAP_MODE_RULES, check_rule
from graphswap.runtime._recompute import recompute_wrapper
from graphswap.runtime.policy import (
    CheckpointPolicy,
    SwapPolicy,
    is_parameter_like,
    swap_large_activations,
    tensor_nbytes,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

EMBED = "embed"
HEAD = "head"

ATTENTION_SCOPE = "attention"
"""A boundary of a decoder layer's attention forward (what ``attention`` swap wraps)."""
LAYER_SCOPE = "layer"
"""A boundary of a whole decoder layer's forward (what ``layer`` and ``auto`` wrap)."""


@dataclass(frozen=True)
class SavedTensor:
    """One save autograd made, as a pack hook sees it."""

    index: int
    """Position among the saves of its scope (every pack call counts, parameters too)."""
    shape: tuple[int, ...]
    """The shape one rank holds: under tensor parallelism, a DTensor's local shape."""
    dtype: torch.dtype
    nbytes: int
    """Bytes of the tensor itself."""
    storage: int
    """Saves of one storage share this id (numbered in order of first save in the trace)."""
    storage_nbytes: int
    parameter: bool
    """A parameter, a buffer or a view of one: not an activation, never swapped."""
    in_attention: bool
    policy_swaps: bool
    """The swap policy answers ``MUST_SWAP`` (never for a parameter)."""


def attention_swap(save: SavedTensor) -> bool:
    """What attention swap moves: saves made inside the attention that the policy swaps."""
    return save.in_attention and save.policy_swaps


def in_attention(save: SavedTensor) -> bool:
    """The save was made inside the attention, the module attention swap wraps."""
    return save.in_attention


def bytes_by_scope(
    scopes: Mapping[str, Sequence[SavedTensor]],
    swapped: Callable[[SavedTensor], bool] = attention_swap,
    wrapped: Callable[[SavedTensor], bool] = in_attention,
) -> dict[str, tuple[int, int]]:
    """``scope -> (saved bytes, swappable bytes)``.

    A storage counts once, in the scope that saved it first. It is swappable when the
    runtime frees it: its first save is ``swapped``, and every later save of it is
    made in the same scope's ``wrapped`` module, where the runtime hands it the same
    copy whatever the policy would answer (a view the policy keeps included). A save
    anywhere else keeps the storage on device, and a copy then frees nothing.
    """
    owner: dict[int, tuple[str, int]] = {}
    held: set[int] = set()
    for scope, saves in scopes.items():
        for save in saves:
            if save.parameter:
                continue
            first = owner.get(save.storage)
            if first is None:
                owner[save.storage] = (scope, save.storage_nbytes)
                if not swapped(save):
                    held.add(save.storage)
            elif first[0] != scope or not wrapped(save):
                held.add(save.storage)
    totals: dict[str, tuple[int, int]] = {}
    for storage, (scope, nbytes) in owner.items():
        saved, swappable = totals.get(scope, (0, 0))
        moved = 0 if storage in held else nbytes
        totals[scope] = (saved + nbytes, swappable + moved)
    return totals


@dataclass(frozen=True)
class LayerTrace:
    name: str
    moe: bool
    saves: tuple[SavedTensor, ...]


@dataclass(frozen=True)
class SavedTensorTrace:
    """One forward's saves, per scope in saving order, and what was traced."""

    embed: tuple[SavedTensor, ...]
    layers: tuple[LayerTrace, ...]
    head: tuple[SavedTensor, ...]
    kernel: AttentionKernel | None
    """The sdpa kernel traced; ``None`` for eager attention."""
    rank_config: PretrainedConfig
    """The model one rank runs (the whole model when ``tp`` is 1)."""
    tp: int

    def scopes(self) -> dict[str, tuple[SavedTensor, ...]]:
        return {
            EMBED: self.embed,
            **{layer.name: layer.saves for layer in self.layers},
            HEAD: self.head,
        }

    def bytes_by_scope(
        self, swapped: Callable[[SavedTensor], bool] = attention_swap
    ) -> dict[str, tuple[int, int]]:
        return bytes_by_scope(self.scopes(), swapped)


class _ShapeOnlyGroupedMM(TorchDispatchMode):
    """On meta, ``_grouped_mm`` rejects non-bf16 inputs (a CUDA kernel limit it checks).

    Its output shape is all the trace needs; autograd above this mode still records the
    op and saves its inputs, so saved bytes are exact. Forward and the input gradient
    multiply 2D by 3D (tokens x K by groups x K x N: tokens x N); the weight gradient
    multiplies 2D by 2D (K x tokens by tokens x N, split at ``offs``: groups x K x N).
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].device.type == "meta":
            mat_a, mat_b = args[0], args[1]
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            if mat_a.dim() == 2 and mat_b.dim() == 3:
                shape: tuple[int, ...] = (mat_a.shape[0], mat_b.shape[-1])
            elif mat_a.dim() == 2 and mat_b.dim() == 2 and offs is not None:
                shape = (offs.shape[0], mat_a.shape[0], mat_b.shape[1])
            else:
                return func(*args, **kwargs)
            return torch.empty(shape, dtype=mat_a.dtype, device=mat_a.device)
        return func(*args, **kwargs)


class SavedTensorCollector:
    """Records each tensor autograd saves, attributed to the running decoder layer.

    Scopes are ``embed`` (before the first layer), ``model.layers.<i>`` and ``head``
    (after the last). Saves are kept as autograd would keep them; a subclass may change
    what the hooks hand autograd (``_pack``, ``_unpack``), how storages are told apart
    (``_storage_id``) and what a module boundary does (``_boundary``).
    """

    def __init__(self, model: torch.nn.Module, policy: SwapPolicy = swap_large_activations):
        self.model = model
        self.policy = policy
        self.saves: dict[str, list[SavedTensor]] = {}
        self._storage_ids: dict[Hashable, int] = {}
        self._held: list[torch.Tensor] = []
        self._scope = EMBED
        self._layer: int | None = None
        self._in_attention = 0
        self._param_storages = {
            t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())
        }

    def record(self, t: torch.Tensor) -> SavedTensor:
        """Describe ``t`` as the save it is and append it to its scope's saves."""
        storage = t.untyped_storage()
        key = storage._cdata
        parameter = key in self._param_storages or is_parameter_like(t)
        saves = self.saves.setdefault(self._scope, [])
        save = SavedTensor(
            index=len(saves),
            shape=tuple(t.shape),
            dtype=t.dtype,
            nbytes=tensor_nbytes(t),
            storage=self._storage_id(t, storage),
            storage_nbytes=storage.nbytes(),
            parameter=parameter,
            in_attention=self._in_attention > 0,
            policy_swaps=not parameter and self.policy(t) is CheckpointPolicy.MUST_SWAP,
        )
        saves.append(save)
        return save

    def _storage_id(self, t: torch.Tensor, storage: torch.UntypedStorage) -> int:
        """Saves of one storage share an id, numbered in order of first save."""
        key = storage._cdata
        storage_id = self._storage_ids.get(key)
        if storage_id is None:
            storage_id = self._storage_ids[key] = len(self._storage_ids)
            # Holding the tensor keeps its storage address from being reused by a later one.
            self._held.append(t)
        return storage_id

    def _pack(self, t: torch.Tensor) -> Any:
        if not running_backward():  # a recompute's save inside backward is not the step's
            self.record(t)
        return t

    def _unpack(self, packed: Any) -> torch.Tensor:
        return cast(torch.Tensor, packed)  # what _pack returned: here the tensor itself

    @contextmanager
    def collect(self) -> Iterator[SavedTensorCollector]:
        handles = []
        fqn, layers = decoder_layers(self.model)
        declared = _declared_attention(self.model)
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(self._enter_layer(i, f"{fqn}.{i}")))
            # Prepended: a boundary at the end of a layer comes before other hooks see it end.
            handles.append(layer.register_forward_hook(self._leave_layer, prepend=True))
            found = attention_child(layer, declared)
            # By the declared class whatever its name; a model that declares none: self_attn.
            attention = found[1] if found is not None else getattr(layer, "self_attn", None)
            if attention is None:  # another token mixer (linear attention): no attention scope
                continue
            handles.append(attention.register_forward_pre_hook(self._enter_attention))
            handles.append(attention.register_forward_hook(self._leave_attention, prepend=True))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for handle in handles:
                handle.remove()

    def _boundary(self, scope: str, layer: int, enter: bool) -> None:
        """The forward of ``layer``'s attention or of the whole layer (``scope``) begins
        (``enter``) or ends; the base collector needs nothing there."""

    def _enter_layer(self, index: int, name: str) -> Callable[[torch.nn.Module, Any], None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._scope = name
            self._layer = index
            self._boundary(LAYER_SCOPE, index, True)

        return hook

    def _leave_layer(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        assert self._layer is not None
        self._boundary(LAYER_SCOPE, self._layer, False)
        self._scope = HEAD  # until the next layer starts; after the last one it stays
        self._layer = None

    def _enter_attention(self, module: torch.nn.Module, args: Any) -> None:
        if running_backward():
            return
        self._in_attention += 1
        assert self._layer is not None
        self._boundary(ATTENTION_SCOPE, self._layer, True)

    def _leave_attention(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if running_backward():
            return
        assert self._layer is not None
        self._boundary(ATTENTION_SCOPE, self._layer, False)
        self._in_attention -= 1


def running_backward() -> bool:
    """Backward is running: a forward now is a checkpoint regenerating what it dropped,
    a save now is a recompute's (a checkpoint's, a chunked loss head's), not the step's."""
    return torch._C._current_graph_task_id() != -1


def _declared_attention(model: torch.nn.Module) -> tuple[type, ...]:
    """The attention classes ``model`` declares (what ``attn_swap`` wraps), or none."""
    try:
        return decoder_classes(model, rule=SWAP_MODE_RULES["attention"]).attention
    except NoMatchError:
        return ()


def head_dim(config: PretrainedConfig) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def per_rank_config(config: PretrainedConfig, tp_size: int) -> PretrainedConfig:
    """The model one rank runs under ``passes/tensor_parallel.py``'s plan with ``tp_size``
    ranks (a :class:`StepShape`'s, checked there).

    That plan shards the attention heads (q/k/v column-parallel, o row-parallel, the q/k
    norms over the local heads) and replicates everything else, so one rank runs exactly
    the attention of a model with ``1/tp_size`` of the query and key/value heads, at the
    same head size, and the full embedding, norms, router, experts and head.
    """
    if tp_size == 1:  # the whole model, whatever its attention (GPT-NeoX has no kv heads)
        return copy.deepcopy(config)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp_size or kv_heads % tp_size:
        fitting = [n for n in range(1, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise PlanSettingError(
            "tp_size",
            tp_size,
            f"must divide num_attention_heads ({heads}) and num_key_value_heads "
            f"({kv_heads}); use one of {', '.join(map(str, fitting))}",
        )
    rank = copy.deepcopy(config)
    rank.head_dim = head_dim(config)
    rank.num_attention_heads = heads // tp_size
    rank.num_key_value_heads = kv_heads // tp_size
    return rank


@dataclass(frozen=True)
class MetaModel:
    """A model built on the meta device to be traced, and what its forward is fed."""

    model: torch.nn.Module
    """One rank's model, on meta, in training mode."""
    kernel: AttentionKernel | None
    """The sdpa kernel its attention runs; ``None`` for eager attention."""
    rank_config: PretrainedConfig
    """The model one rank runs (the whole model when ``tp`` is 1)."""
    tp: int
    """Tensor-parallel ranks the model is one rank of."""
    device: str
    """The device training runs on (``cuda`` or ``cpu``): it chose the kernel."""
    ids: torch.Tensor
    """Token ids of one batch (on meta), used as inputs and labels."""
    loss_head: LossHead = "full"
    """The head its loss runs (installed on ``model``, but for ``full``)."""
    loss_head_chunk_size: int | None = None
    """``chunked``: tokens per chunk."""
    lora_rank: int | None = None
    """The rank of the LoRA adapters installed, every other parameter frozen; ``None``:
    no adapters."""

    recomputed: tuple[tuple[str, ...], ...] = ()
    """Per decoder layer, the submodules recompute-wrapped (paths in the layer); empty:
    nothing is recomputed."""
    recompute_counts: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per layer index, the tensors and storage bytes its recomputed submodules saved in
    the last forward (what recompute dropped), as the runtime counts them."""
    autocast: AutocastTrace | None = None
    """Autocast as the step runs it on ``device``; ``None``: the step runs without."""
    inputs_require_grad: bool = False
    """The input embeddings' output requires grad, frozen embeddings (LoRA's) or not:
    what a trainer's activation checkpointing turns on (``enable_input_require_grads``),
    under which the first layer saves for its input's gradient as every other does."""

    @contextmanager
    def tracing(self) -> Iterator[None]:
        """The modes a meta forward and backward need: fused attention runs its kernel's
        op, ``_grouped_mm`` only shapes its output, and the mask code does not look for
        packed sequences (a data-dependent check meta cannot answer; training batches are
        not packed). A dispatch mode entered inside sees the kernels' own ops."""
        from transformers import masking_utils  # loaded with the model code already

        attention = nullcontext() if self.kernel is None else FusedAttentionMode(self.kernel)
        head = trl_head.tracing(self.device) if self.loss_head == "trl" else nullcontext()
        autocast = self.autocast
        with (
            mock.patch.object(masking_utils, "find_packed_sequence_indices", _not_packed),
            _ShapeOnlyGroupedMM(),  # type: ignore[no-untyped-call]  # torch's __init__ is unannotated
            attention,
            head,
            nullcontext() if autocast is None else autocast.answering(),
            nullcontext() if autocast is None else autocast,  # above attention: sdpa's casts
        ):
            yield

    def optimizer_step(self) -> AbstractContextManager[None]:
        """Where the step's optimizer runs: outside autocast, as trainers run it."""
        return nullcontext() if self.autocast is None else self.autocast.region(False)

    def forward(self) -> Any:
        """One training forward: no cache, so nothing outside autograd keeps keys/values."""
        self.recompute_counts.clear()
        fused = trl_head.FORWARD_KWARGS if self.loss_head == "trl" else {}
        output = self.model(input_ids=self.ids, labels=self.ids, use_cache=False, **fused)
        if self.autocast is not None:
            self.autocast.forward_done()  # autocast's region ends with the loss
        return output

    def saved_tensor_trace(self, saves: Mapping[str, Sequence[SavedTensor]]) -> SavedTensorTrace:
        """``saves`` (per scope, as a collector gathers them) as a trace of this model."""
        fqn, decoder = decoder_layers(self.model)
        layers = tuple(
            LayerTrace(
                name=f"{fqn}.{i}",
                moe=hasattr(getattr(layer, "mlp", None), "experts"),
                saves=tuple(saves.get(f"{fqn}.{i}", ())),
            )
            for i, layer in enumerate(decoder)
        )
        return SavedTensorTrace(
            embed=tuple(saves.get(EMBED, ())),
            layers=layers,
            head=tuple(saves.get(HEAD, ())),
            kernel=self.kernel,
            rank_config=self.rank_config,
            tp=self.tp,
        )


def _not_packed(position_ids: torch.Tensor) -> None:
    return None


def _static_rope(model: torch.nn.Module) -> None:
    """Dynamic NTK rope's frequencies kept as built: transformers recomputes them when a
    sequence outgrows the pretraining window, a data-dependent branch meta cannot take.
    The recomputed frequencies have the same shape, so the step traced is the same."""
    for module in model.modules():
        kind = getattr(module, "rope_type", None)
        if isinstance(kind, str) and "dynamic" in kind:
            setattr(module, "rope_type", "default")  # noqa: B010  # not a declared attribute
        elif isinstance(kind, dict):
            static = {k: "default" if "dynamic" in str(v) else v for k, v in kind.items()}
            setattr(module, "rope_type", static)  # noqa: B010


def _install_loss_head(model: torch.nn.Module, shape: StepShape) -> None:
    """Put the head ``shape`` names on ``model`` (nothing for ``full``), or refuse it
    naming ``loss_head``."""
    try:
        if shape.loss_head == "chunked":
            chunk_loss_head(model, chunk_size=shape.loss_head_chunk_size)
        elif shape.loss_head == "trl":
            trl_head.install(model)
    except LossHeadError as error:
        raise PlanSettingError("loss_head", shape.loss_head, str(error)) from None


def build_meta_model(
    config: PretrainedConfig,
    shape: StepShape,
    *,
    activation_swap: str | None = None,
    recompute: Sequence[RecomputeKind] = (),
    activation_checkpointing: bool = False,
) -> MetaModel:
    """One rank's model of ``config`` on meta, ready to trace at ``shape``.

    ``shape`` was checked when made; what only the model shows is checked here before
    it is traced: ``tp_size`` against the attention's layout, eager experts against a
    model that has experts, and ``activation_swap`` (when given) against what its rule
    accepts, so that a plan is never made of a rewrite that cannot run; a bad one raises
    :class:`PlanSettingError` naming it (``model`` for a model graphswap cannot plan at
    all). ``recompute``: the kinds of submodule every layer recomputes
    (:mod:`graphswap.planning._units`), wrapped as the runtime wraps them.
    ``activation_checkpointing``: the trainer checkpoints every layer, and so makes the
    input embeddings' output require grad, as Hugging Face's and TRL's checkpointing do
    for a ``PeftModel`` (its embeddings frozen, the first layer's input would need none).
    """
    attn_implementation, tp_size = shape.attn_implementation, shape.tp_size
    model_class = eager_only(config)
    if attn_implementation == "sdpa" and model_class is not None:
        raise PlanSettingError(
            "attn_implementation",
            "sdpa",
            f"{model_class} runs eager attention only in this transformers; use eager",
        )
    rank_config = per_rank_config(config, tp_size)
    rank_config._attn_implementation = attn_implementation
    model = build_model(rank_config, device="meta", dtype=shape.dtype).train()
    _static_rope(model)
    try:
        _, layers = decoder_layers(model)
    except HierarchyError as error:
        raise PlanSettingError("model", type(model).__name__, str(error)) from None
    experts = any(name.rpartition(".")[2] == "experts" for name, _ in model.named_modules())
    if experts and getattr(config, "_experts_implementation", None) == "eager":
        raise PlanSettingError(
            "experts_implementation",
            "eager",
            "it routes tokens with data-dependent shapes, which a meta-device trace cannot "
            "follow; plan with experts_implementation='grouped_mm' (the Hugging Face "
            "default), whose saved bytes match it",
        )
    rule = SWAP_MODE_RULES.get(activation_swap or "none")
    if rule is not None:
        try:
            check_rule(model, rule)
        except RewriteError as error:
            raise PlanSettingError("activation_swap", activation_swap, str(error)) from None
    if tp_size > 1:
        attention = getattr(layers[0], "self_attn", None)
        problem = (
            "a layer without self_attn" if attention is None else head_sharding_problem(attention)
        )
        if problem is not None:
            raise PlanSettingError(
                "tp_size",
                tp_size,
                f"shards attention heads, which this model's cannot be: {problem}; use 1",
            )
    if shape.lora_rank is not None:
        _install_lora(model, shape.lora_rank, shape)
    _install_loss_head(model, shape)
    if activation_checkpointing:  # Hugging Face's own call, as the trainer makes it
        cast("PreTrainedModel", model).enable_input_require_grads()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    ids = torch.zeros(shape.batch_size, shape.seq_len, dtype=torch.long, device="meta")
    chunk_size = shape.loss_head_chunk_size if shape.loss_head == "chunked" else None
    meta = MetaModel(
        model,
        shape.kernel,
        rank_config,
        tp_size,
        shape.device,
        ids,
        shape.loss_head,
        chunk_size,
        shape.lora_rank,
        autocast=None
        if shape.autocast_dtype is None
        else AutocastTrace(shape.device, shape.autocast_dtype),
        inputs_require_grad=activation_checkpointing,
    )
    if not recompute:
        return meta
    units = tuple(recompute_units(layer, recompute) for layer in layers)
    meta = dataclasses.replace(meta, recomputed=units)
    for index, (layer, names) in enumerate(zip(layers, units, strict=True)):
        counter = functools.partial(_count_recompute, meta.recompute_counts, index)
        for name in names:
            recompute_wrapper(
                layer.get_submodule(name),
                counter=counter,
                save_matmuls=saves_matmuls(recompute, name),
                rerun_to_input_width=reruns_down_projections(recompute, name),
            )
    return meta


def _install_lora(model: torch.nn.Module, rank: int, shape: StepShape) -> None:
    """The step of a LoRA fine-tune: the base weights frozen, adapters of the shape's
    rank on its target modules, as ``get_peft_model`` puts them."""
    targets = shape.lora_target_modules or LORA_TARGET_MODULES
    try:
        inject_lora(model, rank, targets, shape.lora_dropout or 0.0)
    except NoMatchError as error:
        raise PlanSettingError("lora_target_modules", ",".join(targets), str(error)) from None


def _count_recompute(
    counts: dict[int, tuple[int, int]], layer: int, tensors: int, nbytes: int
) -> None:
    before = counts.get(layer, (0, 0))
    counts[layer] = (before[0] + tensors, before[1] + nbytes)


def trace_saved_tensors(
    config: PretrainedConfig, shape: StepShape, *, policy: SwapPolicy = swap_large_activations
) -> SavedTensorTrace:
    """Trace one training forward of ``config`` at ``shape`` on meta: one rank's saves,
    per scope (see :func:`build_meta_model`)."""
    meta = build_meta_model(config, shape)
    collector = SavedTensorCollector(meta.model, policy)
    with collector.collect(), meta.tracing():
        meta.forward()
    return meta.saved_tensor_trace(collector.saves)
