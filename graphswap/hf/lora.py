"""PEFT's LoRA, as graphswap meets it: the Hugging Face model inside a ``PeftModel``, the
adapters a PEFT config puts on it, and the same adapters on a meta model for the planner.

With LoRA only the adapters train: the base weights get no gradient and no AdamW
state, and backward computes no weight gradient for them, so a plan that counted every
parameter would overstate the state by gigabytes and the backward by a third. The
planner traces the step with adapters of the same rank on the same modules
(:func:`inject_lora`), run as PEFT runs them (:class:`LoraLinear`), so that a plan's
saves are the ones a ``PeftModel`` makes and its peak is theirs. Importing this module
imports no PEFT: it is optional, and a ``PeftModel`` is recognised by what it holds.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from graphswap.errors import NoMatchError

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The modules a LoRA fine-tune usually adapts: every projection of the attention and of a
dense feed-forward block. A mixture of experts' fused experts are parameters, not linear
layers, and stay frozen here (PEFT adapts them as ``target_parameters``, which
:func:`lora_settings` refuses)."""

_FLOAT32_ADAPTERS = (torch.bfloat16, torch.float16)
"""Base dtypes whose adapters PEFT keeps in float32 (``get_peft_model``'s
``autocast_adapter_dtype``, on by default)."""


def _is_peft(module: nn.Module) -> bool:
    return type(module).__module__.partition(".")[0] == "peft"


def peft_inner(model: nn.Module) -> tuple[str, nn.Module]:
    """``(fqn, module)`` of the model a PEFT wrapper holds (a ``PeftModel``'s
    ``base_model.model``, a ``LoraModel``'s ``model``); ``("", model)`` for any other
    module. Read from the registered children, not attributes: PEFT forwards unknown
    attributes to the model inside, so ``LoraModel.base_model`` is the transformer."""
    path: list[str] = []
    while _is_peft(model):
        children = model._modules
        name = next((n for n in ("base_model", "model") if children.get(n) is not None), None)
        if name is None:
            break
        path.append(name)
        model = children[name]  # type: ignore[assignment]  # checked not None above
    return ".".join(path), model


def lora_settings(model: nn.Module) -> dict[str, Any] | None:
    """The planner's LoRA settings (``lora_rank``, ``lora_target_modules``,
    ``lora_dropout``) of a ``PeftModel`` whose active adapter is LoRA; ``None`` for a
    model without PEFT. The targets are the names of the modules PEFT adapted (whatever
    pattern the config gave), so that the planner adapts the same ones. Another PEFT
    method raises :class:`NoMatchError`: the planner traces LoRA's step only."""
    if not _is_peft(model):
        return None
    configs = getattr(model, "peft_config", None) or {}
    active = getattr(model, "active_adapter", "default")
    config = configs.get(active if isinstance(active, str) else active[0])
    method = str(getattr(config, "peft_type", None)).rpartition(".")[2]
    if config is None or method != "LORA" or not isinstance(getattr(config, "r", None), int):
        raise NoMatchError(
            f"{type(model).__name__}'s active adapter is {method}, not LoRA; graphswap plans"
            " the step of a LoRA adapter (or of the whole model): pass a model made with a"
            " peft LoraConfig, or the Hugging Face model itself"
        )
    parameters = sorted(getattr(config, "target_parameters", None) or ())
    if parameters:
        raise NoMatchError(
            f"the LoRA config adapts parameters ({', '.join(parameters)}: PEFT's"
            " target_parameters, which it sets for a mixture of experts' fused experts when"
            " target_modules names their projections); graphswap plans adapters on linear"
            " layers only: name the attention's projections alone in target_modules"
            " (q_proj, k_proj, v_proj, o_proj)"
        )
    others = [
        name
        for name, p in model.named_parameters()
        if p.requires_grad and ".lora_A." not in name and ".lora_B." not in name
    ]
    if others:
        raise NoMatchError(
            f"{type(model).__name__} trains {len(others)} parameters besides LoRA adapters on"
            f" linear layers (first {others[0]!r}: modules_to_save, an adapted embedding, a"
            " trained bias); graphswap plans adapters on linear layers alone: drop them from"
            " the LoraConfig"
        )
    adapted = [(fqn, m) for fqn, m in model.named_modules() if _adapted(m)]
    for fqn, module in adapted:
        base = module.base_layer.weight.dtype
        found = next(iter(module.lora_A.values())).weight.dtype
        if found != adapter_dtype(base):
            raise NoMatchError(
                f"{fqn}'s adapter is {found} over {base} weights; graphswap plans PEFT's"
                f" default, {adapter_dtype(base)} adapters (get_peft_model's"
                " autocast_adapter_dtype=True): make the PeftModel with it"
            )
    targets = sorted({fqn.rpartition(".")[2] for fqn, _ in adapted})
    return {
        "lora_rank": config.r,
        "lora_target_modules": tuple(targets),
        "lora_dropout": float(getattr(config, "lora_dropout", 0.0)),
    }


def adapter_dtype(base: torch.dtype) -> torch.dtype:
    """The dtype PEFT gives the adapters of weights in ``base``: float32 over bfloat16
    and float16 (``autocast_adapter_dtype``), else ``base``."""
    return torch.float32 if base in _FLOAT32_ADAPTERS else base


def _adapted(module: nn.Module) -> bool:
    return isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and bool(module.lora_A)


class LoraLinear(nn.Module):
    """A linear layer with a LoRA adapter, computed as PEFT's ``lora.Linear`` computes it
    (the same operators in the same order, so autograd saves the same tensors): the base
    layer, the input cast to the adapter's dtype, dropout, ``A`` then ``B`` scaled, added,
    cast back to the base output's dtype. The planner's stand-in, on meta."""

    def __init__(self, base: nn.Linear, rank: int, dropout: float) -> None:
        super().__init__()
        weight = base.weight
        dtype = adapter_dtype(weight.dtype)
        self.base_layer = base
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(
            base.in_features, rank, bias=False, device=weight.device, dtype=dtype
        )
        self.lora_B = nn.Linear(
            rank, base.out_features, bias=False, device=weight.device, dtype=dtype
        )
        self.scaling = 8 / rank  # PEFT's default lora_alpha over r; any value saves alike

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        dtype = result.dtype
        x = x if x.dtype == self.lora_A.weight.dtype else x.to(self.lora_A.weight.dtype)
        result = result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        return result.to(dtype)


def inject_lora(
    model: nn.Module, rank: int, target_modules: Sequence[str], dropout: float = 0.0
) -> int:
    """Freeze every parameter of ``model`` and put a rank-``rank`` adapter on each linear
    layer named one of ``target_modules`` (the last part of its FQN, or an ``fnmatch``
    pattern of it), as ``get_peft_model`` does with a ``LoraConfig`` of those targets;
    returns the number adapted. None adapted raises :class:`NoMatchError` listing the
    linear layers' names the model has, as PEFT refuses such a config."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    linears = [(fqn, m) for fqn, m in model.named_modules() if type(m) is nn.Linear and fqn]
    chosen = [
        (fqn, m)
        for fqn, m in linears
        if any(fnmatch.fnmatchcase(fqn.rpartition(".")[2], t) for t in target_modules)
    ]
    if not chosen:
        names = sorted({fqn.rpartition(".")[2] for fqn, _ in linears})
        raise NoMatchError(
            f"lora_target_modules {', '.join(target_modules)} matched no linear layer of"
            f" {type(model).__name__}; its linear layers are named: {', '.join(names)}"
        )
    for fqn, linear in chosen:
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent), name, LoraLinear(linear, rank, dropout))
    return len(chosen)
