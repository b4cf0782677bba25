"""Declarative rewrite rules, their registry, and the built-ins ``qwen3_attn_swap`` and
``qwen3_moe_layer_swap``.

A rule is data: which exact types it replaces (named by import path, resolved only
when a rewrite runs, so that importing graphswap never imports model code), where
in the tree, with what, how the replacements join the prefetch graph, and the
ordering facts that ``passes/`` checks at plan time.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch.fx
from torch import nn

from graphswap.policy import (
    MIN_SWAP_TENSOR_BYTES,
    SwapPolicy,
    qwen3_attention_swap_policy,
    size_threshold_policy,
)
from graphswap.runtime import swap_wrapper, unwrap_swap

if TYPE_CHECKING:
    from graphswap.runtime import SwapManager

PASS_NAMES: tuple[str, ...] = (
    "swap",
    "tensor_parallel",
    "context_parallel",
    "expert_parallel",
    "activation_checkpointing",
    "compile",
    "fsdp",
    "pipeline_parallel",
)
"""Canonical pass names shared with ``passes/``; a rule names passes only from here."""

LINK_KINDS: tuple[str, ...] = ("sequential", "none")


class RewriteError(ValueError):
    """Base of every error a rewrite raises; the model is unchanged when it is raised."""


class NoMatchError(RewriteError):
    """A rule matched no module (``strict=True``)."""


class HierarchyError(RewriteError):
    """The model does not have the module layout a rule requires."""


class AlreadyTransformedError(RewriteError):
    """The model was already rewritten, sharded, compiled or checkpoint-wrapped."""


class RuleConflictError(RewriteError):
    """Two matches claim the same module, or one lies inside the other."""


class UnknownRuleError(RewriteError, KeyError):
    """No rule is registered under the requested name."""

    def __str__(self) -> str:
        # KeyError would print the repr of the message, quotes included.
        return str(self.args[0])


@dataclass(frozen=True)
class RuleContext:
    """What a factory needs to build one replacement."""

    rule: Rule
    fqn: str
    index: int
    """Position of this match among the rule's matches, in forward order."""
    manager: SwapManager


Factory = Callable[[nn.Module, RuleContext], nn.Module]


@dataclass(frozen=True)
class Rule:
    """A declarative module replacement.

    ``factory`` may change the module in place (and return it) or return a new one;
    an in-place factory needs ``restore`` so that the rewrite can be undone.
    ``link="sequential"`` links consecutive replacements, in forward order, into the
    prefetch graph: when the backward of match ``i`` begins, match ``i - 1`` comes back.
    """

    name: str
    description: str
    targets: tuple[str, ...]
    """Import paths of the replaced classes: ``"pkg.mod:Class"`` or ``"pkg.mod.Class"``."""
    factory: Factory
    restore: Callable[[nn.Module], nn.Module] | None = None
    fqn_pattern: str | None = None
    """``fnmatch`` pattern over dotted FQNs (``*`` spans dots), e.g. ``*layers.*.self_attn``."""
    match_subclasses: bool = False
    link: Literal["sequential", "none"] = "sequential"
    validate: Callable[[nn.Module], None] | None = None
    """Checks the layout around the matches; raises ``HierarchyError`` naming the FQN."""
    must_run_before: tuple[str, ...] = (
        "tensor_parallel",
        "context_parallel",
        "expert_parallel",
        "compile",
        "fsdp",
    )
    excludes: tuple[str, ...] = ("compile", "activation_checkpointing", "pipeline_parallel")
    node_attributes: Callable[[RuleContext], Mapping[str, Any]] | None = None
    """Extra prefetch-graph attributes of one match's node (what a planned policy
    swaps there), added to the DOT and JSON exports."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"rule name must be an identifier, got {self.name!r}")
        if isinstance(self.targets, str) or not self.targets:
            raise ValueError(
                f"rule {self.name!r}: targets must be a non-empty tuple of import paths, "
                f"got {self.targets!r}"
            )
        if self.link not in LINK_KINDS:
            raise ValueError(
                f"rule {self.name!r}: link must be one of {LINK_KINDS}, got {self.link!r}"
            )
        for field_name in ("must_run_before", "excludes"):
            unknown = sorted(set(getattr(self, field_name)) - set(PASS_NAMES))
            if unknown:
                raise ValueError(
                    f"rule {self.name!r}: {field_name} names unknown passes {unknown}; "
                    f"known passes: {', '.join(PASS_NAMES)}"
                )

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(_normalize_path(p) for p in self.targets)

    def resolve_targets(self) -> tuple[type, ...]:
        """Import the target classes; a wrong path fails here, not as a silent no-match."""
        return tuple(_import_class(self.name, p) for p in self.targets)

    def matches(self, fqn: str, module: nn.Module, targets: tuple[type, ...]) -> bool:
        if self.fqn_pattern is not None and not fnmatch.fnmatchcase(fqn, self.fqn_pattern):
            return False
        if self.match_subclasses:
            return isinstance(module, targets)
        return type(module) in targets


def _normalize_path(path: str) -> str:
    return path.replace(":", ".")


def _import_class(rule_name: str, path: str) -> type:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise RewriteError(
            f"rule {rule_name!r}: cannot import target {path!r} ({exc}); "
            "write targets as 'package.module:Class'"
        ) from exc
    if not isinstance(cls, type):
        raise RewriteError(f"rule {rule_name!r}: target {path!r} is not a class: {cls!r}")
    return cls


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_REGISTRY: dict[str, Rule] = {}


def register_rule(rule: Rule) -> Rule:
    """Add ``rule`` to the registry; names are unique, a second one is rejected."""
    if rule.name in _REGISTRY:
        raise ValueError(
            f"a rule named {rule.name!r} is already registered "
            f"({_REGISTRY[rule.name].description}); choose another name"
        )
    _REGISTRY[rule.name] = rule
    return rule


def available_rules() -> list[str]:
    return sorted(_REGISTRY)


def get_rule(name: str) -> Rule:
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, _REGISTRY, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownRuleError(
            f"unknown rule {name!r}{hint}; available rules: {', '.join(available_rules())}"
        ) from None


_QWEN3_MOE = "transformers.models.qwen3_moe.modeling_qwen3_moe"

qwen3_layer_swap_policy: SwapPolicy = size_threshold_policy(
    MIN_SWAP_TENSOR_BYTES, name="qwen3_layer_swap_policy"
)
"""What ``qwen3_moe_layer_swap`` moves: the attention policy's test, applied to every
save of the layer (attention, router, experts, norms)."""


@dataclass(frozen=True)
class _HierarchyValidator:
    """A check that every decoder layer has a module of exact type ``class_name`` (the
    layer itself when ``attr`` is ``None``, else its ``attr`` child): one layer without
    it would leave a hole in the prefetch chain. An object, not a closure, so a
    rewritten model (whose report keeps its rules) can be pickled.

    The stack is found by structure, not by attribute name: it is the root or the one
    ``Qwen3MoeModel`` inside it, wherever a head class keeps it (``model`` for causal LM,
    sequence and token classification, ``transformer`` for question answering).
    """

    rule_name: str
    class_name: str
    attr: str | None

    @property
    def __name__(self) -> str:
        return f"validate_{self.rule_name}_hierarchy"

    def __call__(self, root: nn.Module) -> None:
        expected = getattr(importlib.import_module(_QWEN3_MOE), self.class_name)
        layers_fqn = _decoder_stack_fqn(self.rule_name, root)
        try:
            layers = root.get_submodule(layers_fqn)
        except AttributeError:
            raise HierarchyError(
                f"{self.rule_name}: no module at {layers_fqn!r} in {qualified_name(type(root))}"
            ) from None
        # torch.fx keeps the FQNs of a traced model but rebuilds its containers as plain
        # nn.Module, so a GraphModule's layer list is checked by its children only.
        if not isinstance(layers, nn.ModuleList) and not isinstance(root, torch.fx.GraphModule):
            raise HierarchyError(
                f"{self.rule_name}: {layers_fqn!r} must be a torch.nn.ModuleList, "
                f"found {qualified_name(type(layers))}"
            )
        what = "layer" if self.attr is None else f"layer's {self.attr}"
        for name, layer in layers.named_children():
            fqn = (
                f"{layers_fqn}.{name}" if self.attr is None else f"{layers_fqn}.{name}.{self.attr}"
            )
            module = layer if self.attr is None else getattr(layer, self.attr, None)
            if type(module) is not expected:
                found = "nothing" if module is None else qualified_name(type(module))
                raise HierarchyError(
                    f"{self.rule_name}: {fqn!r} must be exactly {_QWEN3_MOE}.{self.class_name}, "
                    f"found {found}; every {what} is swapped or none is"
                )


validate_qwen3_moe_hierarchy = _HierarchyValidator(
    "qwen3_attn_swap", "Qwen3MoeAttention", "self_attn"
)
"""Every decoder layer's ``self_attn`` is exactly ``Qwen3MoeAttention``."""

validate_qwen3_moe_layers = _HierarchyValidator(
    "qwen3_moe_layer_swap", "Qwen3MoeDecoderLayer", None
)
"""Every decoder layer is exactly ``Qwen3MoeDecoderLayer``."""


def _decoder_stack_fqn(rule_name: str, root: nn.Module) -> str:
    """The FQN of the decoder layer list: ``layers`` of the one ``Qwen3MoeModel``."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeModel,
        Qwen3MoePreTrainedModel,
    )

    if isinstance(root, torch.fx.GraphModule):
        # Tracing erased the classes; the FQNs of a traced causal LM or bare model remain.
        return "model.layers" if isinstance(getattr(root, "model", None), nn.Module) else "layers"
    if not isinstance(root, Qwen3MoePreTrainedModel):
        raise HierarchyError(
            f"{rule_name} rewrites a Qwen3-MoE model (Qwen3MoeModel or a head class such "
            "as Qwen3MoeForCausalLM or Qwen3MoeForSequenceClassification), but the root "
            f"module ('') is {qualified_name(type(root))}; pass the Hugging Face model itself"
        )
    stacks = [fqn for fqn, module in root.named_modules() if isinstance(module, Qwen3MoeModel)]
    if len(stacks) != 1:
        found = ", ".join(repr(fqn or "<root>") for fqn in stacks) or "none"
        raise HierarchyError(
            f"{rule_name} needs exactly one Qwen3MoeModel (the decoder stack) in "
            f"{qualified_name(type(root))}, found {found}; rewrite each model separately"
        )
    return f"{stacks[0]}.layers" if stacks[0] else "layers"


def _swap_attention(module: nn.Module, ctx: RuleContext) -> nn.Module:
    return swap_wrapper(
        module, policy=qwen3_attention_swap_policy, manager=ctx.manager, name=ctx.fqn
    )


def _swap_layer(module: nn.Module, ctx: RuleContext) -> nn.Module:
    return swap_wrapper(module, policy=qwen3_layer_swap_policy, manager=ctx.manager, name=ctx.fqn)


QWEN3_ATTN_SWAP = register_rule(
    Rule(
        name="qwen3_attn_swap",
        description="swap the saved activations of every Qwen3-MoE attention to host memory",
        targets=(f"{_QWEN3_MOE}:Qwen3MoeAttention",),
        factory=_swap_attention,
        restore=unwrap_swap,
        fqn_pattern="*layers.*.self_attn",
        link="sequential",
        validate=validate_qwen3_moe_hierarchy,
    )
)

QWEN3_MOE_LAYER_SWAP = register_rule(
    Rule(
        name="qwen3_moe_layer_swap",
        description="swap the saved activations of every Qwen3-MoE decoder layer to host memory",
        targets=(f"{_QWEN3_MOE}:Qwen3MoeDecoderLayer",),
        factory=_swap_layer,
        restore=unwrap_swap,
        fqn_pattern="*layers.*",
        link="sequential",
        validate=validate_qwen3_moe_layers,
    )
)
