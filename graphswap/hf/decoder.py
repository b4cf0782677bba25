"""What a Hugging Face decoder is made of, as graphswap relies on it: the layer and
attention classes the model declares (which the family-generic swap rules match by
exact type), and whether its attention is one tensor parallelism can shard by heads
(which the pass, the preflight and the planner ask).

Where the stack lives is :func:`graphswap.hf.checkpoints.decoder_layers`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from graphswap.errors import HierarchyError, NoMatchError
from graphswap.hf.checkpoints import decoder_layers
from graphswap.hf.lora import peft_inner


@dataclass(frozen=True)
class DecoderClasses:
    """A model's own decoder layer and attention classes."""

    layers: tuple[type, ...]
    attention: tuple[type, ...]


def decoder_classes(model: nn.Module, *, rule: str) -> DecoderClasses:
    """The decoder layer and attention classes ``model``'s Hugging Face class declares:
    those whose outputs it records as ``hidden_states`` and ``attentions``
    (``_can_record_outputs``; a hybrid stack, such as Jamba's attention and Mamba
    layers, lists one class per kind of layer).

    Declared, not found in the tree: a subclass or a wrapper put in the model's place
    does not become a target. A PEFT model (``get_peft_model``'s) declares those of the
    model it holds (:func:`graphswap.hf.lora.peft_inner`). A model that declares none, or
    holds no decoder stack, raises :class:`NoMatchError` (for ``rule``) listing the module
    types it holds.
    """
    try:
        decoder_layers(model)
    except HierarchyError as error:
        raise NoMatchError(_undeclared(rule, model, f"no decoder stack ({error})")) from None
    root = type(peft_inner(model)[1])
    records = getattr(root, "_can_record_outputs", None) or {}
    layers = _record_classes(records.get("hidden_states"))
    attention = _record_classes(records.get("attentions"))
    if not layers or not attention:
        raise NoMatchError(
            _undeclared(
                rule,
                model,
                f"{_qualified(root)} declares no decoder layer and attention classes"
                " (_can_record_outputs['hidden_states'] and ['attentions'])",
            )
        )
    return DecoderClasses(layers=layers, attention=attention)


def attention_child(layer: nn.Module, attention: tuple[type, ...]) -> tuple[str, nn.Module] | None:
    """``(name, module)`` of the child of ``layer`` that is exactly one of the declared
    ``attention`` classes, whatever the family names it (``self_attn``, GPT-NeoX's
    ``attention``, JetMoe's ``self_attention``, NemotronH's ``mixer``); ``None`` for a
    layer with another token mixer (Mamba, linear attention)."""
    for name, child in layer.named_children():
        if type(child) in attention:
            return name, child
    return None


def is_hybrid(model: nn.Module) -> bool:
    """Whether some decoder layer of ``model`` holds no declared attention (Jamba's Mamba
    layers, Qwen3-Next's linear attention): such a stack's cache is more than keys and
    values, and its layers compute otherwise without one. ``False`` for a model that
    declares no classes (nothing known)."""
    try:
        attention = decoder_classes(model, rule="attn_swap").attention
    except NoMatchError:
        return False
    _, layers = decoder_layers(model)
    return any(attention_child(layer, attention) is None for layer in layers)


def _record_classes(record: object) -> tuple[type, ...]:
    """The module classes of one ``_can_record_outputs`` entry: a class, an
    ``OutputRecorder`` holding one as ``target_class``, or a list of them."""
    entries = record if isinstance(record, (list, tuple)) else [record]
    classes = [getattr(entry, "target_class", entry) for entry in entries]
    if not all(isinstance(cls, type) and issubclass(cls, nn.Module) for cls in classes):
        return ()
    return tuple(classes)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _undeclared(rule: str, model: nn.Module, reason: str, limit: int = 12) -> str:
    types = list(dict.fromkeys(_qualified(type(m)) for m in model.modules()))
    more = f" (+{len(types) - limit} more)" if len(types) > limit else ""
    return (
        f"rule {rule!r} found no decoder attention to match: {reason}; module types found:"
        f" {', '.join(types[:limit])}{more}. Fix: pass a Hugging Face decoder model (a"
        " ...ForCausalLM or ...Model built by transformers) as it was built, or write a Rule"
        " with targets naming your attention class"
    )


HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""What tensor parallelism shards by heads: q/k/v column-wise, o row-wise."""

HEAD_NORMS = ("q_norm", "k_norm")
"""Norms over one head's width, which a rank applies to its own heads."""


def head_sharding_problem(attention: nn.Module) -> str | None:
    """Why tensor parallelism cannot shard ``attention`` by heads, or ``None``.

    A rank holding some heads runs the attention when its weights are the q/k/v/o
    projections (``nn.Linear``) and norms over one head's width, and nothing else: a
    parameter per head (gpt-oss's sinks), a norm across all heads (OLMoE's q/k norm) or
    low-rank projections (multi-head latent attention) would need a plan of their own.
    """
    name = type(attention).__name__
    children = dict(attention.named_children())
    missing = [n for n in HEAD_PROJECTIONS if not isinstance(children.get(n), nn.Linear)]
    if missing:
        held = ", ".join(n for n, m in children.items() if any(True for _ in m.parameters()))
        return f"{name} has no {', '.join(missing)} projection (it holds {held})"
    own = [n for n, _ in attention.named_parameters(recurse=False)]
    if own:
        return f"{name} holds {', '.join(own)} itself, one value per head"
    head_dim = getattr(attention, "head_dim", None)
    for child, module in children.items():
        weights = list(module.parameters())
        if child in HEAD_PROJECTIONS or not weights:
            continue
        if child not in HEAD_NORMS:
            return f"{name}.{child} ({type(module).__name__}) holds weights of its own"
        width = weights[0].shape[-1]
        if width != head_dim:
            return (
                f"{name}.{child} normalizes across all heads (width {width}, head_dim"
                f" {head_dim}), which a rank holding some of them cannot compute"
            )
    return None
