"""``rewrite(model, rules)``: apply declarative rules to a module tree, all or nothing.

The failure modes of rewrite libraries are the design input here: every match is
collected on the untouched tree before anything changes; a rule that matches nothing,
two rules that claim overlapping modules, and a model that an earlier transform
already changed (wrapped, sharded, compiled, checkpointed) are errors that name the
module and the fix. A failure half-way restores the model, and a successful rewrite
can be undone exactly.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import itertools
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch.fx
from torch import nn
from torch.utils.hooks import RemovableHandle

from graphswap import _compat
from graphswap.errors import (
    AlreadyTransformedError,
    GraphswapTypeError,
    HierarchyError,
    NoMatchError,
    RewriteError,
    RuleConflictError,
    UnknownRuleError,
)
from graphswap.hf.checkpoints import decoder_layers
from graphswap.hf.decoder import is_hybrid
from graphswap.rewriting.graph import PrefetchGraphError, build_prefetch_graph, graph_to_dict
from graphswap.rewriting.rules import (
    Rule,
    RuleContext,
    available_rules,
    get_rule,
    qualified_name,
)
from graphswap.rewriting.transforms import Transform, find_transforms
from graphswap.runtime import SwapManager

__all__ = [
    "AlreadyTransformedError",
    "HierarchyError",
    "ModuleChange",
    "NoMatchError",
    "RewriteError",
    "RewriteReport",
    "RuleConflictError",
    "RuleReport",
    "UnknownRuleError",
    "rewrite",
    "rewrite_report",
    "unrewrite",
]

_STATE_ATTR = "_graphswap_rewrite"
"""The attribute on a rewritten model that holds its report, for ``unrewrite``."""


@dataclass(frozen=True)
class ModuleChange:
    fqn: str
    old_type: str
    new_type: str
    in_place: bool
    """True when the module object was kept and its class changed (a wrapper)."""


@dataclass(frozen=True)
class RuleReport:
    rule: str
    changes: tuple[ModuleChange, ...]
    links: tuple[tuple[str, str], ...]
    """``(prev, next)`` in forward order, as linked into the prefetch graph."""

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(change.fqn for change in self.changes)

    def __str__(self) -> str:
        if not self.changes:
            return f"{self.rule}: matched nothing (strict=False)"
        verb = "wrapped" if all(c.in_place for c in self.changes) else "replaced"
        return (
            f"{self.rule}: {_plural(len(self.changes), 'module')} {verb}, "
            f"{_plural(len(self.links), 'prefetch link')}"
        )


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


@dataclass(frozen=True)
class _Applied:
    """One replacement, with what undoing it needs."""

    rule: Rule
    fqn: str
    original: nn.Module
    original_type: type
    replacement: nn.Module
    attributes: dict[str, Any] = field(default_factory=dict)
    """The rule's extra prefetch-graph node attributes for this match."""

    @property
    def change(self) -> ModuleChange:
        return ModuleChange(
            fqn=self.fqn,
            old_type=qualified_name(self.original_type),
            new_type=qualified_name(type(self.replacement)),
            in_place=self.replacement is self.original,
        )


def _dead() -> None:
    """A model reference that is gone."""


class _NoCacheInTraining:
    """A forward pre-hook on a Hugging Face decoder stack: in train mode it runs with
    ``use_cache=False``, as Hugging Face's gradient checkpointing does.

    The key/value cache a decoder returns with ``use_cache=True`` holds every layer's
    keys and values; where attention saves those very tensors, their copies to host
    would free nothing. On a stack of attention layers the cache changes no number, so
    it is turned off; an explicit ``use_cache=True`` is overridden with a warning
    (once); in eval mode nothing changes, so generation keeps its cache."""

    warned = False

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not module.training or kwargs.get("use_cache") is False:
            return None
        if kwargs.get("use_cache") and not self.warned:
            self.warned = True
            warnings.warn(
                f"graphswap: use_cache=True is overridden in train mode on a swap-rewritten"
                f" {type(module).__name__}: the returned cache would keep on device every"
                " key and value the swap copies to host; call model.eval() to generate",
                stacklevel=2,
            )
        return args, {**kwargs, "use_cache": False}


_CACHE_FIELDS = ("cache", "past_key_values")
"""The output field of a decoder's cache: ``cache`` in recent transformers,
``past_key_values`` before."""


class _CacheNotReturnedInTraining:
    """A forward hook on a hybrid decoder stack (Mamba or linear-attention layers beside
    attention): in train mode the stack runs with the cache the caller asked for, since
    those layers compute along another path without one (turning it off would change
    the numbers), and the cache is left out of what it returns, so that nothing keeps
    the keys and values the swap copies to host once the forward ends."""

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        if not module.training or not isinstance(output, Mapping):
            return None
        held = [name for name in _CACHE_FIELDS if output.get(name) is not None]
        if not held:
            return None
        return type(output)(**{k: v for k, v in output.items() if k not in held})


def _cache_off_in_training(model: nn.Module, hybrid: bool) -> RemovableHandle | None:
    """Install :class:`_NoCacheInTraining` on the decoder stack of a Hugging Face model
    whose config has ``use_cache`` (the module that holds the layer list), or
    :class:`_CacheNotReturnedInTraining` where the stack is ``hybrid`` (as the model was
    before the rewrite wrapped its attention)."""
    if not hasattr(getattr(model, "config", None), "use_cache"):
        return None
    try:
        layers_fqn, _ = decoder_layers(model)
    except HierarchyError:
        return None
    owner = model.get_submodule(layers_fqn.rpartition(".")[0])
    if hybrid:
        return owner.register_forward_hook(_CacheNotReturnedInTraining(), with_kwargs=True)
    return owner.register_forward_pre_hook(_NoCacheInTraining(), with_kwargs=True)


@dataclass(eq=False)
class RewriteReport:
    """What ``rewrite`` changed: per rule the modules and links, the prefetch graph,
    and the ``SwapManager`` the replacements are registered with."""

    rules: tuple[RuleReport, ...]
    graph: nx.DiGraph = field(repr=False)
    manager: SwapManager = field(repr=False)
    dry_run: bool
    _applied: tuple[_Applied, ...] = field(repr=False)
    _model: weakref.ref[nn.Module] = field(repr=False)
    _cache_hook: RemovableHandle | None = field(default=None, repr=False)
    """The hook that keeps the cache from holding swapped tensors in train mode
    (``_NoCacheInTraining``, ``_CacheNotReturnedInTraining``)."""
    _undone: bool = field(default=False, init=False, repr=False)

    def __str__(self) -> str:
        lines = [str(r) for r in self.rules]
        if self.dry_run:
            lines = [f"dry run, nothing changed: {line}" for line in lines]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "rules": [
                {
                    "rule": r.rule,
                    "changes": [
                        {
                            "fqn": c.fqn,
                            "old_type": c.old_type,
                            "new_type": c.new_type,
                            "in_place": c.in_place,
                        }
                        for c in r.changes
                    ],
                    "links": [list(link) for link in r.links],
                }
                for r in self.rules
            ],
            "prefetch_graph": graph_to_dict(self.graph),
        }

    def __getstate__(self) -> dict[str, Any]:
        """A copied or pickled model carries its own report: it refers to the copy."""
        state = dict(self.__dict__)
        state["_model"] = self._model()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        model = state.pop("_model")
        state["_applied"] = _compat.rules_of_today(state["_applied"], get_rule)  # 0.1.0's rules
        self.__dict__.update(state, _model=weakref.ref(model) if model is not None else _dead)

    def check(self) -> None:
        """Raise if the model ran otherwise than its rules were set up for: for
        ``activation_swap: auto``, a save of another shape or dtype than the plan's
        (``PlanMismatchError``, naming both shapes and the settings planned for).
        Call it after a step; ``graphswap train`` does."""
        checks = {record.rule.name: record.rule.check for record in self._applied}
        for check in checks.values():
            if check is not None:
                check()

    def undo(self) -> None:
        """Put the original modules back: same objects, same classes."""
        if self.dry_run:
            raise RewriteError("this report is from a dry run, which changed nothing to undo")
        if self._undone:
            raise RewriteError("this rewrite was already undone")
        model = self._model()
        if model is None:
            raise RewriteError("the rewritten model no longer exists; nothing to undo")
        _restore_all(model, self._applied)
        if self._cache_hook is not None:
            self._cache_hook.remove()
        if getattr(model, _STATE_ATTR, None) is self:
            delattr(model, _STATE_ATTR)
        _recompile(model)
        self._undone = True


def rewrite(
    model: nn.Module,
    rules: str | Rule | Sequence[str | Rule],
    *,
    dry_run: bool = False,
    strict: bool = True,
    manager: SwapManager | None = None,
) -> RewriteReport:
    """Apply ``rules`` (registered names or ``Rule`` objects) to ``model``, all or nothing.

    ``strict``: a rule that matches nothing raises ``NoMatchError``. ``dry_run``: the
    rewrite is applied and undone, so the report is the one a real run returns (and a
    run that would fail fails), the model is left as it was and the report's manager
    holds no modules. ``manager``: the ``SwapManager`` to register with, a
    fresh one by default; it must be empty (one manager per model).
    A ``torch.fx.GraphModule`` is rewritten through its submodules and recompiled.
    On a Hugging Face model, the decoder stack then runs with ``use_cache=False`` in
    train mode (``_NoCacheInTraining``; a hybrid stack keeps its cache but does not return
    it, ``_CacheNotReturnedInTraining``; ``undo`` removes it). A rewrite that matched
    nothing (``strict=False``) leaves the model untouched: no hook, no report on it.
    """
    resolved = _resolve_rules(rules)
    _refuse_transformed(model, resolved)
    manager = SwapManager() if manager is None else manager
    if manager.groups():
        raise RewriteError(
            f"the SwapManager passed to rewrite() already has "
            f"{_plural(len(manager.groups()), 'registered module')}; use one SwapManager per "
            "model (omit manager= to get a fresh one)"
        )
    modules = list(model.named_modules())
    plan = [(rule, _collect(rule, model, modules, strict)) for rule in resolved]
    _check_conflicts(plan)
    hybrid = is_hybrid(model)
    for rule, matches in plan:
        if matches and rule.validate is not None:
            rule.validate(model)
    applied, links = _apply(model, plan, manager)
    try:
        graph = build_prefetch_graph(manager)
        _add_node_attributes(graph, applied)
    except PrefetchGraphError as exc:
        _restore_all(model, applied)
        raise RewriteError(f"{exc}; the model was restored") from exc
    report = RewriteReport(
        rules=tuple(
            RuleReport(
                rule=rule.name,
                changes=tuple(a.change for a in applied if a.rule is rule),
                links=links[rule.name],
            )
            for rule, _ in plan
        ),
        graph=graph,
        manager=manager,
        dry_run=dry_run,
        _applied=tuple(applied),
        _model=weakref.ref(model),
    )
    if dry_run:
        _restore_all(model, applied)
    elif applied:
        report._cache_hook = _cache_off_in_training(model, hybrid)
        setattr(model, _STATE_ATTR, report)
        _recompile(model)
    return report


def rewrite_report(model: nn.Module) -> RewriteReport | None:
    """The report of the ``rewrite`` applied to ``model`` (by hand, or by
    ``graphswap.train.build.from_config`` / ``from_pretrained``), or ``None``."""
    report = getattr(model, _STATE_ATTR, None)
    return report if isinstance(report, RewriteReport) else None


def unrewrite(model: nn.Module) -> RewriteReport:
    """Undo the ``rewrite`` applied to ``model``; returns its (now undone) report."""
    report = getattr(model, _STATE_ATTR, None)
    if not isinstance(report, RewriteReport):
        raise RewriteError(
            f"{qualified_name(type(model))} was not rewritten by graphswap.rewrite(); "
            "there is nothing to undo"
        )
    report.undo()
    return report


def _resolve_rules(rules: str | Rule | Sequence[str | Rule]) -> list[Rule]:
    if isinstance(rules, (str, Rule)):
        items = [rules]
    elif isinstance(rules, Sequence):
        items = list(rules)
    else:
        raise GraphswapTypeError(
            _bad_rules("rules must be a rule name, a Rule or a list of them", rules)
        )
    if not items:
        raise RewriteError("rewrite() needs at least one rule; e.g. rules=['attn_swap']")
    for item in items:
        if not isinstance(item, (str, Rule)):
            raise GraphswapTypeError(_bad_rules("rules must list rule names or Rule objects", item))
    resolved = [item if isinstance(item, Rule) else get_rule(item) for item in items]
    names = [rule.name for rule in resolved]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise RuleConflictError(f"rules listed more than once: {', '.join(duplicates)}")
    return resolved


def _bad_rules(what: str, value: object) -> str:
    return (
        f"{what}, got {type(value).__name__} {value!r}; available rules:"
        f" {', '.join(available_rules())} (e.g. rules=['attn_swap'])"
    )


def _collect(
    rule: Rule, model: nn.Module, modules: list[tuple[str, nn.Module]], strict: bool
) -> list[tuple[str, nn.Module]]:
    """The rule's matches in forward (registration) order."""
    targets = rule.resolve_targets(model)
    matches = [(fqn, m) for fqn, m in modules if rule.matches(fqn, m, targets)]
    if not matches and strict:
        raise NoMatchError(_no_match_message(rule, targets, modules))
    return matches


def _no_match_message(
    rule: Rule, targets: tuple[type, ...], modules: list[tuple[str, nn.Module]]
) -> str:
    wanted = " or ".join(qualified_name(t) for t in targets)
    where = f" at FQNs matching {rule.fqn_pattern!r}" if rule.fqn_pattern else ""
    nearest = _nearest_types(rule, targets, modules)
    found = (
        "nearest types in the model:\n" + "\n".join(f"  - {line}" for line in nearest)
        if nearest
        else f"no module type in the model resembles it ({len(modules)} modules, root "
        f"{qualified_name(type(modules[0][1]))})"
    )
    return (
        f"rule {rule.name!r} matched no module: it wants exact type {wanted}{where}; {found}\n"
        "fix: pass a model that contains that type, or strict=False to skip rules "
        "that match nothing"
    )


def _nearest_types(
    rule: Rule, targets: tuple[type, ...], modules: list[tuple[str, nn.Module]], limit: int = 5
) -> list[str]:
    """Types that look like what the rule wanted: subclasses of it, types at the FQNs
    it names, and types with a similar class name."""
    by_type: dict[type, list[str]] = {}
    for fqn, module in modules:
        by_type.setdefault(type(module), []).append(fqn)
    target_names = [t.__name__ for t in targets]
    ranked: list[tuple[tuple[int, float, int], str]] = []
    for order, (cls, fqns) in enumerate(by_type.items()):
        similarity = max(
            difflib.SequenceMatcher(None, cls.__name__, name).ratio() for name in target_names
        )
        in_place = rule.fqn_pattern is not None and any(
            fnmatch.fnmatchcase(f, rule.fqn_pattern) for f in fqns
        )
        if cls in targets:
            rank, reason = 0, f"the type itself, at FQNs {rule.fqn_pattern!r} does not match"
        elif issubclass(cls, targets):
            rank, reason = 0, f"a subclass of {', '.join(target_names)}"
        elif in_place:
            rank, reason = 1, f"at an FQN matching {rule.fqn_pattern!r}"
        elif similarity >= 0.6:
            rank, reason = 2, "a similar name"
        else:
            continue
        more = f" (+{len(fqns) - 1} more)" if len(fqns) > 1 else ""
        line = f"{qualified_name(cls)} at {fqns[0]!r}{more}: {reason}"
        ranked.append(((rank, -similarity, order), line))
    return [line for _, line in sorted(ranked)[:limit]]


def _check_conflicts(plan: list[tuple[Rule, list[tuple[str, nn.Module]]]]) -> None:
    claimed: dict[str, str] = {}
    for rule, matches in plan:
        for fqn, _ in matches:
            if fqn in claimed:
                raise RuleConflictError(
                    f"{fqn!r} is claimed by rules {claimed[fqn]!r} and {rule.name!r}; "
                    "a module can be replaced by one rule only"
                )
            claimed[fqn] = rule.name
    for fqn, rule_name in claimed.items():
        if not fqn:
            continue
        parts = fqn.split(".")
        for depth in range(len(parts)):
            ancestor = ".".join(parts[:depth])
            if ancestor in claimed:
                raise RuleConflictError(
                    f"rule {claimed[ancestor]!r} replaces {ancestor or '<root>'!r} and rule "
                    f"{rule_name!r} replaces {fqn!r} inside it; nested replacements "
                    "cannot be undone reliably, narrow one rule's fqn_pattern"
                )


def _apply(
    model: nn.Module, plan: list[tuple[Rule, list[tuple[str, nn.Module]]]], manager: SwapManager
) -> tuple[list[_Applied], dict[str, tuple[tuple[str, str], ...]]]:
    applied: list[_Applied] = []
    links: dict[str, tuple[tuple[str, str], ...]] = {}
    where = ""
    try:
        for rule, matches in plan:
            done: list[_Applied] = []
            for index, (fqn, module) in enumerate(matches):
                where = f"rule {rule.name!r} on {fqn!r}"
                ctx = RuleContext(rule, fqn, index, manager)
                record = _replace(model, rule, fqn, module, ctx)
                applied.append(record)
                done.append(record)
                if rule.node_attributes is not None:
                    record.attributes.update(rule.node_attributes(ctx))
            where = f"rule {rule.name!r} while linking"
            links[rule.name] = _link(rule, done, manager)
    except Exception as exc:
        _restore_all(model, applied)
        if isinstance(exc, RewriteError):
            raise
        raise RewriteError(
            f"{where} failed ({type(exc).__name__}: {exc}); the model was restored"
        ) from exc
    return applied, links


def _replace(
    model: nn.Module, rule: Rule, fqn: str, module: nn.Module, ctx: RuleContext
) -> _Applied:
    original_type = type(module)
    before = _ModuleState.capture(module, ctx.manager)
    try:
        replacement = rule.factory(module, ctx)
    except Exception:
        before.put_back(module, ctx.manager)
        raise
    if not isinstance(replacement, nn.Module):
        before.put_back(module, ctx.manager)
        raise RewriteError(
            f"rule {rule.name!r}: the factory returned {type(replacement).__name__} for "
            f"{fqn!r}; it must return an nn.Module"
        )
    record = _Applied(rule, fqn, module, original_type, replacement)
    if replacement is module:
        if rule.restore is None:
            before.put_back(module, ctx.manager)
            raise RewriteError(
                f"rule {rule.name!r} changed {fqn!r} in place but has no restore, so its "
                "rewrites could not be undone; the model was restored: give the rule a "
                "restore function (or a factory that returns a new module)"
            )
    else:
        _set_submodule(model, fqn, replacement)
    return record


@dataclass(frozen=True)
class _ModuleState:
    """A module's class and attributes before a factory ran, to put back when the
    factory fails or changed it in place with no ``restore`` (all or nothing)."""

    cls: type
    attrs: dict[str, Any]
    containers: dict[str, dict[Any, Any]]
    """Copies of the dict-valued attributes (parameters, submodules, hooks), which a
    factory may change in place."""
    registered: int

    @classmethod
    def capture(cls, module: nn.Module, manager: SwapManager) -> _ModuleState:
        attrs = dict(module.__dict__)
        containers = {k: dict(v) for k, v in attrs.items() if isinstance(v, dict)}
        return cls(type(module), attrs, containers, len(manager.groups()))

    def put_back(self, module: nn.Module, manager: SwapManager) -> None:
        if len(manager.groups()) > self.registered:
            with contextlib.suppress(KeyError):
                manager.unregister(module)
        module.__class__ = self.cls
        module.__dict__.clear()
        module.__dict__.update(self.attrs)
        for key, items in self.containers.items():
            container = module.__dict__[key]
            container.clear()
            container.update(items)


def _add_node_attributes(graph: nx.DiGraph, applied: Sequence[_Applied]) -> None:
    for record in applied:
        if not record.attributes:
            continue
        if record.fqn not in graph:
            raise PrefetchGraphError(
                f"rule {record.rule.name!r} gives node attributes for {record.fqn!r}, which is "
                "not a swap group; name the groups by FQN (swap_wrapper(..., name=ctx.fqn))"
            )
        node = graph.nodes[record.fqn]
        taken = sorted(set(record.attributes) & set(node))
        if taken:
            raise PrefetchGraphError(
                f"rule {record.rule.name!r} would overwrite the prefetch-graph attributes "
                f"{taken} of {record.fqn!r}; give its node_attributes other names"
            )
        node.update(record.attributes)


def _link(rule: Rule, done: list[_Applied], manager: SwapManager) -> tuple[tuple[str, str], ...]:
    pairs = list(itertools.pairwise(done))
    for prev, nxt in pairs:
        manager.link(prev.replacement, nxt.replacement)
    return tuple((prev.fqn, nxt.fqn) for prev, nxt in pairs)


def _set_submodule(model: nn.Module, fqn: str, module: nn.Module) -> None:
    if not fqn:
        raise RewriteError(
            "a rule matched the root module and returned a new object; the root can only "
            "be changed in place"
        )
    parent_fqn, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent_fqn), name, module)


def _restore_all(model: nn.Module, applied: Sequence[_Applied]) -> None:
    """Undo ``applied`` in reverse order, then check every original is back."""
    failures: list[str] = []
    for record in reversed(applied):
        try:
            if record.rule.restore is not None:
                record.rule.restore(record.replacement)
            if record.replacement is not record.original:
                _set_submodule(model, record.fqn, record.original)
        except Exception as exc:
            failures.append(f"{record.fqn!r} ({type(exc).__name__}: {exc})")
    for record in applied:
        current = model.get_submodule(record.fqn)
        if current is not record.original or type(current) is not record.original_type:
            failures.append(
                f"{record.fqn!r} is {qualified_name(type(current))}, expected the original "
                f"{qualified_name(record.original_type)}"
            )
    if failures:
        raise RewriteError(
            f"could not restore {len(failures)} module(s): {'; '.join(failures[:3])}"
        )


def _recompile(model: nn.Module) -> None:
    if isinstance(model, torch.fx.GraphModule):
        model.recompile()


def _refuse_transformed(model: nn.Module, rules: list[Rule]) -> None:
    """Exact-type rules need the untouched model: refuse one that an earlier
    transform changed, naming the first changed module and the fix."""
    previous = getattr(model, _STATE_ATTR, None)
    if isinstance(previous, RewriteReport):
        raise AlreadyTransformedError(
            f"the model was already rewritten ({'; '.join(str(r) for r in previous.rules)}); "
            "rewriting twice would wrap wrappers: call graphswap.unrewrite(model) first"
        )
    traces = find_transforms(model)
    if traces:
        first = traces[0]
        count = sum(trace.kind is first.kind for trace in traces)
        more = f" (and {count - 1} more)" if count > 1 else ""
        raise AlreadyTransformedError(f"{first}{more}; {_fix(first.kind, rules)}")


def _fix(kind: Transform, rules: list[Rule]) -> str:
    names = ", ".join(repr(r.name) for r in rules)
    if kind is Transform.SWAP:
        return (
            "rewriting twice would wrap wrappers: call graphswap.unrewrite(model) or "
            "graphswap.runtime.unwrap_swap(module) first"
        )
    if kind in (Transform.COMPILE, Transform.CHECKPOINT):
        excluding = [repr(r.name) for r in rules if kind.value in r.excludes]
        if excluding:
            undo = (
                "rewrite the model before torch.compile (the original of torch.compile(m) "
                "is its ._orig_mod) and do not compile it"
                if kind is Transform.COMPILE
                else "turn checkpointing off (for Hugging Face models "
                "model.gradient_checkpointing_disable(), activation_checkpointing_disable() "
                "from transformers 5.23 on; or build without checkpoint_wrapper); to "
                "recompute and swap together, let graphswap own the recompute: "
                "activation_swap: budget with an activation_memory_budget"
            )
            return f"{', '.join(excluding)} cannot be combined with {kind.value}: {undo}"
        return f"rewrite the model first ({names}), then apply {kind.value}"
    passes = "fully_shard" if kind is Transform.FSDP else "tensor/expert/context parallel and FSDP"
    return f"{names} must run before {passes}: rewrite the unsharded model, then shard it"
