"""The pass plan: which passes run, in which order, and whether that order is legal.

A pass plan is checked as data (a networkx graph of the declared constraints) before any
pass touches the model, and it is never re-sorted behind the user's back: a wrong
order is an error that says how to fix it (I5, I6).
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import networkx as nx

from graphswap.passes.errors import (
    PassConflictError,
    PassNotImplementedError,
    PassOrderError,
    PassPlanError,
    PassSettingError,
)
from graphswap.passes.specs import CANONICAL_ORDER, PassSpec, pass_specs

if TYPE_CHECKING:
    from graphswap.passes.settings import PassSettings


PASS_ORDER = "pass_order"
"""The config key of a user's own order; errors about that order start with it."""


def _recompute_hint(names: set[str], config: PassSettings) -> str:
    """Swap with checkpointing: the way to have both is the mode that owns recompute."""
    if names != {"swap", "activation_checkpointing"}:
        return ""
    if config.activation_swap == "budget":
        return (
            "; activation_swap: budget recomputes what it plans itself, so a second owner "
            "of recompute is refused: set activation_checkpointing: false"
        )
    return (
        "; to recompute and swap together, set activation_swap: budget with an "
        "activation_memory_budget (graphswap then plans and owns the recompute)"
    )


def pass_plan(config: PassSettings) -> PassPlan:
    """The passes ``config`` asks for (not yet checked): in ``config.pass_order`` when it
    sets one, taken as given so that :meth:`PassPlan.check` judges the user's own order,
    else in canonical order."""
    if config.pass_order is not None:
        return PassPlan.from_names(config.pass_order, config, order_from=PASS_ORDER)
    return PassPlan(
        tuple(spec for spec in pass_specs().values() if spec.enabled_by(config)), config
    )


def pass_plan_of(config: PassSettings, given: PassPlan | None) -> PassPlan:
    """``given`` when a caller built ``config``'s pass plan already (a run builds it once
    and passes it along as ``pass_plan=``), else ``config``'s pass plan. A pass plan of
    other settings is refused: its passes are not the ones ``config`` asks for (I2)."""
    if given is None:
        return pass_plan(config)
    if given.config != config:
        raise PassSettingError(
            "pass_plan= is the pass plan of other settings than the config it came with;"
            " pass graphswap.passes.pass_plan(config), or leave pass_plan= out"
        )
    return given


@dataclass(frozen=True)
class PassPlan:
    """An ordered tuple of passes for one config; :meth:`check` decides if it may run."""

    passes: tuple[PassSpec, ...]
    config: PassSettings
    order_from: str | None = None
    """The config key the order was taken from (``pass_order``): messages name it and
    the fix there; ``None`` for the canonical order or :meth:`from_names`."""

    def __post_init__(self) -> None:
        names = [spec.name for spec in self.passes]
        for name in names:
            if names.count(name) > 1:
                raise PassPlanError(
                    f"{_lead(self.order_from)}pass {name!r} appears {names.count(name)} times"
                    f" in {self._where}; list it once"
                )

    @classmethod
    def from_names(
        cls,
        names: Iterable[str],
        config: PassSettings,
        *,
        order_from: str | None = None,
    ) -> PassPlan:
        """A pass plan in exactly the given order, so that any order can be expressed
        and checked."""
        known = pass_specs()
        chosen = []
        for name in names:
            if name not in known:
                raise PassPlanError(
                    f"{_lead(order_from)}unknown pass {name!r}; declared passes: {', '.join(known)}"
                )
            chosen.append(known[name])
        return cls(tuple(chosen), config, order_from)

    @property
    def _where(self) -> str:
        return self.order_from or "the pass plan"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.passes)

    def position(self, name: str) -> int:
        """1-based position of a pass, as messages show it."""
        return self.names.index(name) + 1

    def label(self, name: str) -> str:
        return f"{name} (position {self.position(name)})"

    @functools.cached_property
    def graph(self) -> nx.DiGraph:
        """Nodes: the pass plan's passes; edge ``a -> b``: a must run before b."""
        graph = nx.DiGraph()
        for position, spec in enumerate(self.passes, start=1):
            graph.add_node(
                spec.name,
                position=position,
                setting=spec.setting_text(self.config),
                implemented=spec.implemented,
                summary=spec.summary,
            )
        for spec in self.passes:
            for later in spec.must_run_before:
                self._add_constraint(graph, spec.name, later, declared_by=spec.name)
            for earlier in spec.must_run_after:
                self._add_constraint(graph, earlier, spec.name, declared_by=spec.name)
        return graph

    def _add_constraint(self, graph: nx.DiGraph, first: str, then: str, declared_by: str) -> None:
        if first in graph and then in graph and not graph.has_edge(first, then):
            satisfied = self.position(first) < self.position(then)
            graph.add_edge(first, then, declared_by=declared_by, satisfied=satisfied)

    def check(self) -> PassPlan:
        """Raise a :class:`PassPlanError` subclass unless the plan may run; return ``self``."""
        self._check_settings()
        self._check_exclusions()
        self._check_cycles()
        self._check_order()
        return self

    def check_runnable(self) -> PassPlan:
        """:meth:`check`, and that graphswap can apply every pass of the plan: a pass it
        declares (so that the order and exclusions are checked) but cannot apply yet is
        refused here, before a model is built, naming the passes it can apply."""
        self.check()
        for spec in self.passes:
            if not spec.implemented:
                applied = ", ".join(s.name for s in pass_specs().values() if s.implemented)
                raise PassNotImplementedError(
                    f"{spec.setting_text(self.config)} asks for {spec.name}, which graphswap"
                    f" declares and checks but cannot apply yet (it applies {applied});"
                    f" set {spec.off_text()}"
                )
        return self

    def _check_settings(self) -> None:
        lead, where = _lead(self.order_from), self._where
        for spec in self.passes:
            if not spec.enabled_by(self.config):
                raise PassSettingError(
                    f"{lead}{self.label(spec.name)} is in {where} but"
                    f" {spec.setting_text(self.config)} does not enable it; remove {spec.name}"
                    f" from {where} or change {spec.setting}"
                )
        for spec in pass_specs().values():
            if spec.name not in self.names and spec.enabled_by(self.config):
                add = f"{spec.name} to {where}" if self.order_from else spec.name
                raise PassSettingError(
                    f"{lead}{spec.setting_text(self.config)} asks for the {spec.name} pass but"
                    f" {where} does not contain it; add {add} or set {spec.off_text()}"
                )

    def _check_exclusions(self) -> None:
        for a, b in itertools.combinations(self.passes, 2):
            if b.name in a.excludes or a.name in b.excludes:
                declaring, excluded = (a, b) if b.name in a.excludes else (b, a)
                raise PassConflictError(
                    f"{declaring.setting_text(self.config)} excludes"
                    f" {excluded.setting_text(self.config)}; set {declaring.off_text()} or"
                    f" {excluded.off_text()} ({self.label(declaring.name)} and"
                    f" {self.label(excluded.name)} cannot run together)"
                    + _recompute_hint({a.name, b.name}, self.config)
                )

    def _check_cycles(self) -> None:
        try:
            cycle = nx.find_cycle(self.graph)
        except nx.NetworkXNoCycle:
            return
        path = " -> ".join(self.label(first) for first, _ in cycle)
        settings = " or ".join(
            self.passes[self.position(first) - 1].off_text() for first, _ in cycle
        )
        raise PassOrderError(
            f"the constraints of {path} -> {cycle[0][0]} form a cycle, so no order satisfies"
            f" them; turn one of these passes off: set {settings}"
        )

    def _check_order(self) -> None:
        violations = [
            (first, then)
            for first, then, satisfied in self.graph.edges(data="satisfied")
            if not satisfied
        ]
        if not violations:
            return
        first, then = min(violations, key=lambda e: (self.position(e[1]), self.position(e[0])))
        first_spec = self.passes[self.position(first) - 1]
        then_spec = self.passes[self.position(then) - 1]
        if self.order_from:
            legal = nx.lexicographical_topological_sort(self.graph, key=self.position)
            works = f"an order that runs: {self.order_from}: [{', '.join(legal)}]"
        else:
            works = f"graphswap.passes.pass_plan orders them {_canonical(self.names)}"
        raise PassOrderError(
            f"{_lead(self.order_from)}{self.label(first)} must run before {self.label(then)}:"
            f" move {first} ahead of {then} ({works}) or turn one off: set"
            f" {first_spec.off_text()} or {then_spec.off_text()}"
        )

    def to_text(self) -> str:
        if not self.passes:
            return "pass plan: no passes (the config enables none)\n"
        width = max(len(name) for name in self.names)
        lines = ["pass plan:"]
        for spec in self.passes:
            note = "" if spec.implemented else "  [declared, not implemented]"
            lines.append(
                f"  {self.position(spec.name)}. {spec.name:<{width}}"
                f"  {spec.setting_text(self.config)}  {spec.summary}{note}"
            )
        edges = sorted(self.graph.edges, key=lambda e: (self.position(e[0]), self.position(e[1])))
        if edges:
            lines.append("constraints (must run before):")
            lines.extend(f"  {first} -> {then}" for first, then in edges)
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        data = {
            "passes": [
                {
                    "position": self.position(spec.name),
                    "name": spec.name,
                    "setting": spec.setting,
                    "value": getattr(self.config, spec.setting),
                    "implemented": spec.implemented,
                    "summary": spec.summary,
                }
                for spec in self.passes
            ],
            "constraints": [
                {"before": first, "after": then, "declared_by": attrs["declared_by"]}
                for first, then, attrs in sorted(
                    self.graph.edges(data=True),
                    key=lambda e: (self.position(e[0]), self.position(e[1])),
                )
            ],
        }
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def to_dot(self) -> str:
        """Solid edges: the plan's order; dashed edges: declared constraints."""
        lines = ["digraph pass_plan {", "  rankdir=LR;", "  node [shape=box];"]
        for spec in self.passes:
            label = f"{self.position(spec.name)}. {spec.name}\\n{spec.setting_text(self.config)}"
            style = "" if spec.implemented else ", style=dashed"
            lines.append(f'  "{spec.name}" [label="{label}"{style}];')
        for first, then in itertools.pairwise(self.names):
            lines.append(f'  "{first}" -> "{then}";')
        for first, then in sorted(
            self.graph.edges, key=lambda e: (self.position(e[0]), self.position(e[1]))
        ):
            lines.append(f'  "{first}" -> "{then}" [style=dashed, constraint=false];')
        lines.append("}")
        return "\n".join(lines) + "\n"


def _lead(order_from: str | None) -> str:
    """``"pass_order: "`` for an error in the user's own order, as config errors start."""
    return f"{order_from}: " if order_from else ""


def _canonical(names: tuple[str, ...]) -> str:
    return " -> ".join(name for name in CANONICAL_ORDER if name in names)
