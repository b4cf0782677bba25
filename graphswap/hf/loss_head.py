"""What a chunked loss head must know of a Hugging Face causal LM to compute the loss the
model computes: where the head is, what the family does to its logits before the loss,
and how ``ForCausalLMLoss`` shifts the labels and reduces.

Transformers' causal LMs end alike: ``logits = self.lm_head(hidden)``, an optional
transform of the logits (Gemma's final-logit softcapping, Cohere's ``logit_scale``,
Granite's ``logits_scaling``), then ``self.loss_function(logits, labels, vocab_size,
**kwargs)``, which is ``ForCausalLMLoss``: pad the labels with ``ignore_index``, shift
them left one token, upcast the logits to fp32, cross-entropy summed and divided by the
count of labels that are not ``ignore_index`` (or by ``num_items_in_batch`` when the
trainer passes it). What comes after (the MoE auxiliary loss added to ``loss``, the
output type) is the family's own code, which the head leaves to run as it is.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

LossHead = Literal["full", "chunked", "trl"]
"""The loss head a step runs, one name everywhere (``loss_head`` in the trainer's config,
the planner, ``plan-memory --loss-head``): the model's own (``full``: every token's
logits at once, kept in fp32 for backward), graphswap's chunked head (``chunked``:
``loss_head_chunk_size`` tokens at a time, each chunk recomputed in backward), or TRL
``SFTTrainer``'s fused head (``trl``: scored in tiles, no logits kept), which the
trainer installs itself."""
LOSS_HEADS: tuple[LossHead, ...] = get_args(LossHead)

HEAD = "lm_head"
"""The attribute of a causal LM that holds its output projection."""

FIX = "set loss_head: full"
"""How every refusal of the chunked head ends: the head the model computes itself."""


@dataclass(frozen=True)
class LogitsTransform:
    """What a family does to the logits between ``lm_head`` and the loss, with the ops
    in the order and dtype its forward runs them (so that the same bits come out)."""

    scale: float | None = None
    """``logits * scale``: Cohere's ``logit_scale``."""
    divide: float | None = None
    """``logits / divide``: Granite's ``logits_scaling``."""
    softcap: float | None = None
    """``tanh(logits / softcap) * softcap``: Gemma's ``final_logit_softcapping``, after
    any scale."""

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            logits = logits * self.scale
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = logits / self.softcap
            logits = torch.tanh(logits)
            logits = logits * self.softcap
        return logits

    def __str__(self) -> str:
        parts = {"logit_scale": self.scale, "logits_scaling": self.divide}
        parts["final_logit_softcapping"] = self.softcap
        return ", ".join(f"{key}: {value}" for key, value in parts.items() if value is not None)


def logits_transform(model: nn.Module) -> LogitsTransform | None:
    """The transform ``model``'s config (or, for Cohere, the model) asks for; ``None``
    where the logits go to the loss as ``lm_head`` returns them."""
    config: Any = getattr(model, "config", None)
    if config is not None:
        config = config.get_text_config()
    scale = getattr(model, "logit_scale", None)
    if scale is None:
        scale = getattr(config, "logit_scale", None)
    divide = getattr(config, "logits_scaling", None)
    transform = LogitsTransform(
        scale=None if scale is None else float(scale),
        divide=None if divide is None else float(divide),
        softcap=getattr(config, "final_logit_softcapping", None),
    )
    return None if transform == LogitsTransform() else transform


def head_problem(model: nn.Module) -> str | None:
    """Why the chunked head cannot compute ``model``'s loss, or ``None``: no ``lm_head``
    (a ``Linear``), a forward that takes no ``labels``, or one that does not compute its
    logits through ``lm_head`` and its loss through ``loss_function``, or a
    ``loss_function`` other than transformers' ``ForCausalLMLoss``."""
    name = type(model).__name__
    head = getattr(model, HEAD, None)
    if head is None:
        return f"{name} has no {HEAD} (the chunked head replaces a causal LM's {HEAD} and loss)"
    if not isinstance(head, nn.Linear):
        return f"{name}.{HEAD} is {type(head).__name__}, not an nn.Linear the head can project with"
    forward = inspect.unwrap(type(model).forward)
    if "labels" not in inspect.signature(forward).parameters:
        return f"{name}.forward takes no labels"
    read = set(getattr(getattr(forward, "__code__", None), "co_names", ()))
    missing = [n for n in (HEAD, "loss_function") if n not in read]
    if missing:
        return (
            f"{name}.forward does not read {' or '.join(missing)}: it computes its logits or"
            " its loss otherwise than transformers' causal LMs do"
        )
    from transformers.loss.loss_utils import ForCausalLMLoss  # model code only when asked

    if model.loss_function is not ForCausalLMLoss:
        return (
            f"{name}.loss_function is {getattr(model.loss_function, '__name__', '?')}, not"
            " transformers' ForCausalLMLoss, the loss the chunked head computes"
        )
    return None


def causal_lm_targets(
    labels: torch.Tensor, shift_labels: torch.Tensor | None, ignore_index: int
) -> torch.Tensor:
    """The target of every position, flattened, as ``ForCausalLMLoss`` makes it: the
    labels shifted left one token, the last position of each row ``ignore_index``;
    ``shift_labels`` (context parallelism shifts them itself) as given."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def causal_lm_loss(
    loss_sum: torch.Tensor,
    targets: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None,
    ignore_index: int,
) -> torch.Tensor:
    """The summed cross-entropy reduced as ``fixed_cross_entropy`` reduces it: divided by
    ``num_items_in_batch`` when given, else by the count of targets that are not
    ``ignore_index`` (the mean; a tensor, no host sync). The same division gives the
    same gradient scale, bit for bit."""
    if num_items_in_batch is None:
        return loss_sum / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss_sum.device)
    return loss_sum / num_items_in_batch
