"""``chunk_loss_head(model)``: a Hugging Face causal LM whose loss, when it is given
labels, is computed over chunks of tokens, no (tokens x vocabulary) logits kept.

Like ``swap_wrapper``, and through the same class swap
(:class:`graphswap.runtime._class_swap.ClassSwap`), the install swaps the model's class
for a generated subclass (same name, so ``save_pretrained`` records the architecture it
always did): the object, its parameters, FQNs, ``state_dict`` keys and ``isinstance``
stay, the class pickles by recipe (``_head_class``), a second install is refused and
:func:`unchunk_loss_head` restores the exact class.

With labels, the generated forward runs the family's own forward, so everything but the
head is the model's code: the backbone, the MoE auxiliary loss it adds to ``loss``, the
output type. Two hooks on ``lm_head`` take the hidden states it is called with and let
it project one position only, and ``loss_function`` (for that call) computes
``ForCausalLMLoss`` with the chunked projection and cross-entropy of
:func:`graphswap.runtime.chunked_linear_cross_entropy`; the returned output has
``logits=None``. Without labels the forward is the original one, unchanged
(``generate``, evaluation logits).

The logits the family hands its loss are checked against what the head computes: the
very tensor ``lm_head`` returned, or, where the config names a softcapping or a scale,
that transform of it, bit for bit (checked on the first step, on a real device). A
family that does anything else is refused, naming ``loss_head``.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from graphswap.errors import GraphswapTypeError, LossHeadError
from graphswap.hf.loss_head import (
    FIX,
    HEAD,
    LogitsTransform,
    causal_lm_loss,
    causal_lm_targets,
    head_problem,
    logits_transform,
)
from graphswap.rewriting.transforms import Transform, shown_by
from graphswap.runtime import chunked_linear_cross_entropy
from graphswap.runtime._class_swap import ClassSwap, Forward

__all__ = ["DEFAULT_CHUNK_SIZE", "chunk_loss_head", "loss_head_chunk_size", "unchunk_loss_head"]

DEFAULT_CHUNK_SIZE = 1024
"""Tokens per chunk: at a 150k vocabulary, 1024 tokens of fp32 logits are 0.6 GB, and
a chunk's projection is long enough to run the GPU at its matrix-product rate."""


class ChunkedLossHead:
    """Marker base of every generated chunked-head class."""


class _HeadState:
    """What one installed head holds: the class to restore, the chunk size, and the
    call in progress (never pickled)."""

    def __init__(self, original_type: type, chunk_size: int, transform: LogitsTransform | None):
        self.original_type = original_type
        """The class :func:`unchunk_loss_head` puts back."""
        self.chunk_size = chunk_size
        """Tokens per chunk."""
        self.transform = transform
        """The logits transform the config names (``None``: none)."""
        self.verified = False
        """Whether the family's transform was checked against ``transform`` by value."""
        self.call: _Call | None = None
        """The forward with labels in progress, which ``loss_function`` answers for."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "call": None}


class _Call:
    """One forward with labels: ``lm_head``'s input and output, and the loss."""

    def __init__(self, model: nn.Module, state: _HeadState) -> None:
        self.model = model
        self.state = state
        self.hidden: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.done = False

    def take_hidden(self, head: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Forward pre-hook: keep the hidden states, project the first position only."""
        if self.hidden is not None:
            raise LossHeadError(
                f"{_name(self.model)}.{HEAD} ran twice in one forward; the chunked head"
                f" computes one projection per forward: {FIX}"
            )
        hidden = args[0]
        self.hidden = hidden
        return (hidden.narrow(-2, 0, min(1, hidden.shape[-2])), *args[1:])

    def take_logits(self, head: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        """Forward hook: the (one-position) logits, to recognise them in the loss."""
        self.logits = output

    def loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``ForCausalLMLoss``'s signature and result, over chunks."""
        hidden = self.hidden
        if hidden is None:
            when = "a second time in one forward" if self.done else f"before {HEAD} ran"
            raise LossHeadError(
                f"{_name(self.model)} asked for its loss {when}; the chunked head computes"
                f" one loss per forward from {HEAD}'s input: {FIX}"
            )
        transform = self._transform_of(logits)
        head = getattr(self.model, HEAD)
        weight, bias = head.weight, head.bias
        _refuse_sharded(self.model, weight)
        rows = hidden.reshape(-1, hidden.shape[-1])
        if shift_labels is not None:
            shift_labels = shift_labels.to(rows.device)
        targets = causal_lm_targets(labels.to(rows.device), shift_labels, ignore_index)
        if targets.shape[0] != rows.shape[0]:
            raise LossHeadError(
                f"{_name(self.model)}: {HEAD} projects {rows.shape[0]} positions but the labels"
                f" give {targets.shape[0]} targets (logits_to_keep with labels?); pass labels"
                f" for every position, or {FIX}"
            )
        loss_sum = chunked_linear_cross_entropy(
            rows,
            weight,
            bias,
            targets,
            chunk_size=self.state.chunk_size,
            ignore_index=ignore_index,
            transform=transform,
        )
        self.done = True
        self.hidden = None
        return causal_lm_loss(loss_sum, targets, num_items_in_batch, ignore_index)

    def _transform_of(self, logits: torch.Tensor) -> LogitsTransform | None:
        """The transform between ``lm_head`` and the loss: none when the family passed
        ``lm_head``'s output itself, else the config's, checked once by value."""
        projected = self.logits
        if logits is projected:
            return None
        expected = self.state.transform
        model = self.model
        if expected is None or projected is None:
            raise LossHeadError(
                f"{_name(model)} changes its logits between {HEAD} and its loss in a way"
                f" the chunked head does not know (no softcapping or logit scale in its"
                f" config); {FIX}"
            )
        if not self.state.verified and projected.device.type != "meta":
            with torch.no_grad():
                made = expected(projected)
            same = made.dtype == logits.dtype and made.shape == logits.shape
            if not (same and torch.equal(made, logits)):
                raise LossHeadError(
                    f"{_name(model)} transforms its logits otherwise than its config's"
                    f" {expected} as the chunked head applies it (a {logits.dtype} result"
                    f" of shape {tuple(logits.shape)} that differs); {FIX}"
                )
            self.state.verified = True
        return expected


def _name(model: nn.Module) -> str:
    return type(model).__name__


def _refuse_sharded(model: nn.Module, weight: torch.Tensor) -> None:
    """A head split across ranks (tensor parallelism's vocabulary or column shards, or
    an ``lm_head`` fully_shard-ed on its own, whose weight is sharded outside its own
    forward): each chunk's softmax needs the whole row of logits on one rank."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if isinstance(dtensor, type) and isinstance(weight, dtensor):
        placements = getattr(weight, "placements", ())
        raise LossHeadError(
            f"{_name(model)}.{HEAD}.weight is a DTensor sharded as {placements}"
            f" where the chunked head reads it (tensor parallelism splits the vocabulary or"
            f" the hidden width across ranks, or {HEAD} is fully_shard-ed apart from the"
            f" root), and the head computes each chunk's softmax on one rank; keep {HEAD}"
            f" unsharded (FSDP2 on the root gathers it for the root's forward) or {FIX}"
        )


def _head_forward(original: Forward) -> Forward:
    """The forward of the chunked-head class: the chunked path when given labels, else
    ``original`` (the family's ``forward``) unchanged."""
    labels_at = list(inspect.signature(original).parameters).index("labels") - 1  # after self

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        labels = args[labels_at] if len(args) > labels_at else kwargs.get("labels")
        if labels is None:
            return original(self, *args, **kwargs)
        return _chunked_forward(self, original, args, kwargs)

    return forward


def _head_members(cls: type) -> dict[str, Any]:
    """A ``loss_function`` that answers for the chunked path during a forward with
    labels, and is ``cls``'s own otherwise."""
    loss_property = inspect.getattr_static(cls, "loss_function")  # PreTrainedModel's property

    def get_loss_function(self: nn.Module) -> Any:
        call = self.__dict__[_CLASSES.state_attr].call
        if call is not None:
            return call.loss
        return loss_property.fget(self)

    def set_loss_function(self: nn.Module, value: Any) -> None:
        loss_property.fset(self, value)

    return {"loss_function": property(get_loss_function, set_loss_function)}


_CLASSES = ClassSwap(
    prefix=None,
    marker=ChunkedLossHead,
    state_attr="_graphswap_loss_head",
    forward=_head_forward,
    wrapper="chunk_loss_head",
    members=_head_members,
)
"""The generated chunked-head classes (each named as its original) and the models'
``_HeadState``."""


@_CLASSES.bind
def _head_class(cls: type[nn.Module]) -> type:
    """The chunked-head subclass of ``cls``; what a pickled model rebuilds its class with
    (pickles made before the class swap was shared name it too)."""
    return _CLASSES.generated(cls)


def _chunked_forward(
    model: nn.Module, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The family's forward with the head's hooks on, its output without logits, as a
    tuple where the caller or the config asks for one (``can_return_tuple``'s rule)."""
    state: _HeadState = model.__dict__[_CLASSES.state_attr]
    as_dict = kwargs.pop("return_dict", None)
    if as_dict is None:
        as_dict = getattr(getattr(model, "config", None), "return_dict", True)
    if not as_dict:
        kwargs["return_dict"] = True
    head = getattr(model, HEAD)
    call = _Call(model, state)
    hooks: list[RemovableHandle] = [
        head.register_forward_pre_hook(call.take_hidden),
        head.register_forward_hook(call.take_logits),
    ]
    state.call = call
    try:
        output: Any = original(model, *args, **kwargs)
    finally:
        state.call = None
        for hook in hooks:
            hook.remove()
    if not call.done:
        raise LossHeadError(
            f"{_name(model)}.forward was given labels but computed no loss through its"
            f" loss_function; {FIX}"
        )
    if not isinstance(output, Mapping):
        raise LossHeadError(
            f"{_name(model)}.forward returned {type(output).__name__}, not a ModelOutput the"
            f" chunked head can take its logits out of; {FIX}"
        )
    output = type(output)(**{key: value for key, value in output.items() if key != "logits"})
    return output if as_dict else output.to_tuple()


def chunk_loss_head(model: nn.Module, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> nn.Module:
    """Compute ``model``'s loss over chunks of ``chunk_size`` tokens when it is given
    labels: each chunk's ``lm_head`` projection and cross-entropy are made again in
    backward, so no (tokens x vocabulary) tensor outlives one chunk, and the output's
    ``logits`` is ``None``. Without labels ``model`` runs as before.

    Numbers: the hidden states' gradients (every parameter below the head) are the full
    head's bit for bit; the loss and ``lm_head``'s weight gradient differ by the order
    of their sums over chunks only (the weight gradient is summed in fp32). Returns the
    same object; :func:`unchunk_loss_head` undoes it. A refusal (``LossHeadError``)
    leaves the model as it was.
    """
    if not isinstance(model, nn.Module):
        raise GraphswapTypeError(
            f"chunk_loss_head expects an nn.Module, got {type(model).__name__}"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise LossHeadError(
            f"loss_head_chunk_size: must be an integer >= 1 (tokens per chunk of the loss"
            f" head), got {chunk_size!r}"
        )
    installed = loss_head_chunk_size(model)
    if installed is not None:
        raise LossHeadError(
            f"{_name(model)} already has a chunked loss head ({installed} tokens per chunk);"
            " call unchunk_loss_head(model) first"
        )
    shown = shown_by(model) & {Transform.COMPILE, Transform.FSDP}
    if shown:
        kinds = " and ".join(sorted(kind.value for kind in shown))
        raise LossHeadError(
            f"{_name(model)} is already {kinds}: the chunked head swaps the model's class,"
            f" which {kinds} replaced; install it first (loss_head: chunked runs before every"
            f" pass), or {FIX}"
        )
    problem = head_problem(model)
    if problem is not None:
        raise LossHeadError(f"loss_head: chunked needs a causal LM's head: {problem}; {FIX}")
    _refuse_sharded(model, getattr(model, HEAD).weight)
    cls = type(model)
    if type(cls) is not type:
        raise LossHeadError(
            f"{cls.__qualname__} uses the metaclass {type(cls).__qualname__}; the chunked"
            f" head swaps classes of the default metaclass only; {FIX}"
        )
    _CLASSES.install(model, _HeadState(cls, chunk_size, logits_transform(model)))
    return model


def unchunk_loss_head(model: nn.Module) -> nn.Module:
    """Undo :func:`chunk_loss_head`: the original class, the full head."""
    state: _HeadState | None = _CLASSES.state(model)
    if state is None:
        raise LossHeadError(f"{_name(model)} has no chunked loss head; nothing to undo")
    if type(model) is not _CLASSES.generated(state.original_type):
        raise LossHeadError(
            f"{_name(model)} changed class since its chunked head was installed (it is"
            f" {type(model).__qualname__}, fully_shard-ed or otherwise wrapped); undo that"
            " first, then unchunk_loss_head(model)"
        )
    _CLASSES.remove(model, state.original_type)
    return model


def loss_head_chunk_size(model: nn.Module) -> int | None:
    """Tokens per chunk of ``model``'s chunked loss head; ``None``: it computes its own."""
    state: _HeadState | None = _CLASSES.state(model)
    return None if state is None else state.chunk_size
