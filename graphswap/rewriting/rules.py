"""Declarative rewrite rules, their registry, and the built-ins: ``attn_swap`` and
``layer_swap`` for any Hugging Face decoder, ``qwen3_attn_swap`` and
``qwen3_moe_layer_swap`` for Qwen3-MoE alone.

A rule is data: which exact types it replaces (named by import path, or taken from the
model being rewritten; resolved only when a rewrite runs, so that importing graphswap
never imports model code), where in the tree, with what, how the replacements join
the prefetch graph, and the ordering facts that ``passes/`` checks at plan time.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from graphswap.errors import HierarchyError, RewriteError, UnknownRuleError
from graphswap.hf import qwen3_moe
from graphswap.hf.checkpoints import decoder_layers
from graphswap.hf.decoder import attention_child, decoder_classes
from graphswap.runtime import swap_wrapper, unwrap_swap
from graphswap.runtime.policy import (
    SwapPolicy,
    swap_large_activations,
)

if TYPE_CHECKING:
    from graphswap.runtime import SwapManager


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
    an in-place factory needs ``restore`` so that the rewrite can be undone. The
    replacements are swap-wrapped modules of one manager, linked in forward order into
    the prefetch graph: when the backward of match ``i`` begins, match ``i - 1`` comes
    back. A module matches by its exact type only: a subclass may save other tensors.
    """

    name: str
    description: str
    targets: tuple[str, ...]
    """Import paths of the replaced classes: ``"pkg.mod:Class"`` or ``"pkg.mod.Class"``;
    empty when ``targets_from`` takes them from the model."""
    factory: Factory
    restore: Callable[[nn.Module], nn.Module] | None = None
    fqn_pattern: str | None = None
    """``fnmatch`` pattern over dotted FQNs (``*`` spans dots), e.g. ``*layers.*.self_attn``."""
    validate: Callable[[nn.Module], None] | None = None
    """Checks the layout around the matches; raises ``HierarchyError`` naming the FQN."""
    must_run_before: tuple[str, ...] = ()
    """Passes (by their name in ``passes/``) that must come after this rewrite; the pass
    plan checks them when it runs the rule."""
    excludes: tuple[str, ...] = ()
    """Passes that cannot run on a model this rule rewrote."""
    node_attributes: Callable[[RuleContext], Mapping[str, Any]] | None = None
    """Extra prefetch-graph attributes of one match's node (what a planned policy
    swaps there), added to the DOT and JSON exports."""
    check: Callable[[], None] | None = None
    """Raises when the rewritten model ran otherwise than the rule was set up for (an
    ``auto`` plan: saves of another shape); ``RewriteReport.check()`` calls it."""
    targets_from: Callable[[nn.Module], tuple[type, ...]] | None = None
    """The replaced classes, as the model being rewritten declares them (instead of
    ``targets``): one rule then serves every model family. Raises ``NoMatchError``
    naming what the model holds when it declares none."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise RewriteError(f"rule name must be an identifier, got {self.name!r}")
        if isinstance(self.targets, str) or (not self.targets) == (self.targets_from is None):
            raise RewriteError(
                f"rule {self.name!r}: give either targets, a non-empty tuple of import paths,"
                f" or targets_from, a function of the model; got targets={self.targets!r}"
                f" and targets_from={self.targets_from!r}"
            )

    def resolve_targets(self, model: nn.Module | None = None) -> tuple[type, ...]:
        """Import the target classes, or take them from ``model`` (``targets_from``); a
        wrong path or a model without them fails here, not as a silent no-match."""
        if self.targets_from is not None:
            if model is None:
                raise RewriteError(
                    f"rule {self.name!r} takes its targets from the model: pass the model"
                )
            return self.targets_from(model)
        return tuple(_import_class(self.name, p) for p in self.targets)

    def matches(self, fqn: str, module: nn.Module, targets: tuple[type, ...]) -> bool:
        if self.fqn_pattern is not None and not fnmatch.fnmatchcase(fqn, self.fqn_pattern):
            return False
        return type(module) in targets


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


def check_rule(model: nn.Module, name: str) -> None:
    """Raise what a rewrite of ``model`` by the registered rule ``name`` would raise for
    the model's layout (``NoMatchError``, ``HierarchyError``), changing nothing: the
    planner refuses what the rule refuses."""
    rule = get_rule(name)
    rule.resolve_targets(model)
    if rule.validate is not None:
        rule.validate(model)


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_REGISTRY: dict[str, Rule] = {}


def register_rule(rule: Rule) -> Rule:
    """Add ``rule`` to the registry; names are unique, a second one is rejected."""
    if rule.name in _REGISTRY:
        raise RewriteError(
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


_SWAP_MUST_RUN_BEFORE = (
    "tensor_parallel",
    "context_parallel",
    "expert_parallel",
    "compile",
    "fsdp",
)
"""The swap rules wrap exact, unsharded types, and their hooks must see eager autograd."""

_SWAP_EXCLUDES = ("compile", "activation_checkpointing", "pipeline_parallel")
"""Compile traces the hooks away, checkpointing recomputes what was swapped, and pipeline
stages reorder the backward the prefetch chain follows."""


def _swap(policy: SwapPolicy, module: nn.Module, ctx: RuleContext) -> nn.Module:
    return swap_wrapper(module, policy=policy, manager=ctx.manager, name=ctx.fqn)


def with_policy(rule: str | Rule, policy: SwapPolicy) -> Rule:
    """A built-in swap rule (by name or object) that wraps with ``policy`` instead of its
    own, e.g. ``size_threshold_policy(64 << 10)`` for a small model whose saves all stay
    under the default 1 MiB; everything else about the rule is kept."""
    base = get_rule(rule) if isinstance(rule, str) else rule
    if not _is_swap(base):
        raise RewriteError(
            f"rule {base.name!r} does not wrap with a swap policy, so it cannot take one;"
            f" swap rules: {', '.join(n for n in available_rules() if _is_swap(get_rule(n)))}"
        )
    return dataclasses.replace(base, factory=functools.partial(_swap, policy))


def _is_swap(rule: Rule) -> bool:
    factory = rule.factory
    return isinstance(factory, functools.partial) and factory.func is _swap


@dataclass(frozen=True)
class _DeclaredClasses:
    """The decoder classes the model being rewritten declares: its layers (``attr``
    ``None``) or its attentions. An object, not a closure, so that a rewritten model
    can be pickled."""

    rule_name: str
    attr: str | None
    family: str = "decoder"
    """The models it serves, as the rule's description says."""

    @property
    def targets(self) -> tuple[str, ...]:
        return ()

    @property
    def targets_from(self) -> _DeclaredClasses:
        return self

    def __call__(self, root: nn.Module) -> tuple[type, ...]:
        classes = decoder_classes(root, rule=self.rule_name)
        return classes.layers if self.attr is None else classes.attention

    def source(self, root: nn.Module) -> str:
        return f" (the class {qualified_name(type(root))} declares)"


@dataclass(frozen=True)
class _Qwen3MoeClasses:
    """Qwen3-MoE's own class ``class_name``, named by its import path, for a model that
    is a Qwen3-MoE model (:mod:`graphswap.hf.qwen3_moe`)."""

    rule_name: str
    class_name: str
    family: str = "Qwen3-MoE"
    """The models it serves, as the rule's description says."""

    @property
    def targets(self) -> tuple[str, ...]:
        return (f"{qwen3_moe.MODELING}:{self.class_name}",)

    @property
    def targets_from(self) -> None:
        return None

    def __call__(self, root: nn.Module) -> tuple[type, ...]:
        return (qwen3_moe.qwen3_moe_class(root, self.class_name, rule=self.rule_name),)

    def source(self, root: nn.Module) -> str:
        return ""


@dataclass(frozen=True)
class _StackValidator:
    """Every decoder layer (``attr`` ``None``) or every layer's attention is exactly one
    of ``classes``: one that is not (a subclass, a wrapper, a layer with another token
    mixer) would leave a hole in the prefetch chain. The attention is the layer's child
    of a declared class, whatever its name (``self_attn``, ``attention``, ``mixer``);
    ``attr`` names it where none is. The stack is found by structure
    (:func:`graphswap.hf.checkpoints.decoder_layers`), wherever a head class keeps it."""

    rule_name: str
    attr: str | None
    classes: _DeclaredClasses | _Qwen3MoeClasses

    @property
    def __name__(self) -> str:
        return f"validate_{self.rule_name}_hierarchy"

    def __call__(self, root: nn.Module) -> None:
        expected = self.classes(root)
        wanted = " or ".join(qualified_name(cls) for cls in expected)
        layers_fqn, layers = decoder_layers(root)
        what = "layer" if self.attr is None else "layer's attention"
        for name, layer in layers.named_children():
            fqn = f"{layers_fqn}.{name}"
            if self.attr is None:
                child, found = "", layer
            elif attention_child(layer, expected) is not None:
                continue
            else:
                child, found = f".{self.attr}", getattr(layer, self.attr, None)
            if type(found) in expected:
                continue
            if found is None:
                children = ", ".join(
                    f"{held} ({type(module).__name__})" for held, module in layer.named_children()
                )
                raise HierarchyError(
                    f"{self.rule_name}: {fqn!r} holds no {wanted} (it holds {children}), so"
                    f" its attention cannot be swapped and the prefetch chain would skip it;"
                    f" this stack mixes attention with other layers: use layer_swap, which"
                    f" wraps every layer whatever it holds"
                )
            raise HierarchyError(
                f"{self.rule_name}: {fqn + child!r} must be"
                f" exactly {wanted}{self.classes.source(root)}, found"
                f" {qualified_name(type(found))}; every {what} is swapped or none is: rewrite"
                " the model as Hugging Face builds it, before any subclass or wrapper"
            )


def _register_swap(
    what: str,
    attr: str | None,
    classes: _DeclaredClasses | _Qwen3MoeClasses,
    fqn_pattern: str,
) -> Rule:
    """A built-in swap rule, named as ``classes`` names it: every decoder layer (``attr``
    ``None``) or every layer's attention (at ``fqn_pattern``), of exactly one of
    ``classes``, wrapped with the size policy and linked layer to layer."""
    name = classes.rule_name
    return register_rule(
        Rule(
            name=name,
            description=f"swap the saved activations of every {classes.family} {what} to host"
            " memory",
            targets=classes.targets,
            targets_from=classes.targets_from,
            factory=functools.partial(_swap, swap_large_activations),
            restore=unwrap_swap,
            fqn_pattern=fqn_pattern,
            validate=_StackValidator(name, attr, classes),
            must_run_before=_SWAP_MUST_RUN_BEFORE,
            excludes=_SWAP_EXCLUDES,
        )
    )


QWEN3_ATTN_SWAP = _register_swap(
    "attention",
    "self_attn",
    _Qwen3MoeClasses("qwen3_attn_swap", "Qwen3MoeAttention"),
    "*layers.*.self_attn",
)
QWEN3_MOE_LAYER_SWAP = _register_swap(
    "decoder layer",
    None,
    _Qwen3MoeClasses("qwen3_moe_layer_swap", "Qwen3MoeDecoderLayer"),
    "*layers.*",
)
ATTN_SWAP = _register_swap(
    "attention", "self_attn", _DeclaredClasses("attn_swap", "self_attn"), "*layers.*.*"
)
"""Each layer's child of a declared attention class, whatever the family names it."""
LAYER_SWAP = _register_swap("layer", None, _DeclaredClasses("layer_swap", None), "*layers.*")

SWAP_MODE_RULES: Mapping[str, str] = {
    "attention": ATTN_SWAP.name,
    "layer": LAYER_SWAP.name,
    "auto": LAYER_SWAP.name,
    "budget": LAYER_SWAP.name,
}
"""The rule behind each ``activation_swap`` mode (``auto`` and ``budget`` run the layer
rule with a planned policy per layer, ``budget`` with planned recompute inside): the
swap pass rewrites with it and the planner refuses what it refuses."""
