"""The pass plan as data: orders, exclusions and config consistency (I5, I6, P1, P2)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphswap import passes
from graphswap.passes import (
    PassConflictError,
    PassOrderError,
    PassPlan,
    PassPlanError,
    PassSettingError,
    PassSpec,
)
from graphswap.train.config import TrainerConfig

ON: dict[str, dict[str, Any]] = {
    "swap": {"activation_swap": "attention"},
    "tensor_parallel": {"tp_size": 2},
    "context_parallel": {"cp_size": 2},
    "expert_parallel": {"ep_size": 2},
    "activation_checkpointing": {"activation_checkpointing": True},
    "compile": {"compile": True},
    "fsdp": {"fsdp": True},
    "pipeline_parallel": {"pp_size": 2},
}
"""The setting that asks for each pass."""

SHARDING = ("tensor_parallel", "context_parallel", "expert_parallel")
MUST_PRECEDE: frozenset[tuple[str, str]] = frozenset(
    {(("swap", later)) for later in (*SHARDING, "compile", "fsdp")}
    | {("pipeline_parallel", later) for later in (*SHARDING, "activation_checkpointing")}
    | {("pipeline_parallel", later) for later in ("compile", "fsdp")}
    | {(first, later) for first in SHARDING for later in ("activation_checkpointing",)}
    | {(first, later) for first in SHARDING for later in ("compile", "fsdp")}
    | {("tensor_parallel", "expert_parallel")}
    | {("activation_checkpointing", "compile"), ("activation_checkpointing", "fsdp")}
    | {("compile", "fsdp")}
)
"""The reference constraints, written out by hand: (a, b) means a must run before b."""

EXCLUDED: frozenset[frozenset[str]] = frozenset(
    frozenset(pair)
    for pair in (
        ("swap", "compile"),
        ("swap", "activation_checkpointing"),
        ("swap", "pipeline_parallel"),
    )
)


def config_for(names: tuple[str, ...] | list[str]) -> TrainerConfig:
    values: dict[str, Any] = {}
    for name in names:
        values.update(ON[name])
    return TrainerConfig(**values)


def reference(order: tuple[str, ...]) -> type[PassPlanError] | None:
    """What a plan in this order must do: the error type it raises, or None."""
    if any(frozenset(pair) in EXCLUDED for pair in itertools.combinations(order, 2)):
        return PassConflictError
    position = {name: i for i, name in enumerate(order)}
    for first, then in MUST_PRECEDE:
        if first in position and then in position and position[first] > position[then]:
            return PassOrderError
    return None


def assert_matches_reference(order: tuple[str, ...]) -> None:
    expected = reference(order)
    plan = PassPlan.from_names(order, config_for(order))
    assert_pass_order_matches(order, expected)
    if expected is None:
        assert plan.check() is plan
        assert plan.names == order
        return
    with pytest.raises(expected) as info:
        plan.check()
    message = str(info.value)
    if expected is PassOrderError:
        found = re.match(
            r"^(\w+) \(position (\d)\) must run before (\w+) \(position (\d)\)", message
        )
        assert found, message
        first, first_pos, then, then_pos = found.groups()
        assert (first, then) in MUST_PRECEDE
        assert (int(first_pos), int(then_pos)) == (order.index(first) + 1, order.index(then) + 1)
        assert int(first_pos) > int(then_pos)
    else:
        named = set(re.findall(r"(\w+) \(position \d\)", message))
        assert len(named) == 2 and frozenset(named) in EXCLUDED, message
    assert plan.names == order, "a plan is never re-sorted"


def assert_pass_order_matches(order: tuple[str, ...], expected: type[PassPlanError] | None) -> None:
    """The same order given as the config's ``pass_order``: the same verdict, a message
    that starts with the key, and for a wrong order a suggested order that runs."""
    config = dataclasses.replace(config_for(order), pass_order=order)
    plan = passes.pass_plan(config)
    assert plan.names == order, "pass_order is taken as given, never re-sorted"
    if expected is None:
        assert plan.check() is plan
        return
    with pytest.raises(expected) as info:
        plan.check()
    message = str(info.value)
    if expected is PassOrderError:
        found = re.search(r"\(an order that runs: pass_order: \[([\w, ]*)\]\)", message)
        assert message.startswith("pass_order: ") and found, message
        suggested = tuple(found.group(1).split(", "))
        assert sorted(suggested) == sorted(order) and reference(suggested) is None
        passes.pass_plan(dataclasses.replace(config, pass_order=suggested)).check()


def test_every_declared_pass_has_a_setting_that_turns_it_on() -> None:
    assert set(passes.CANONICAL_ORDER) == set(ON)


@pytest.mark.parametrize("field", ["must_run_before", "excludes"])
def test_a_swap_rule_naming_an_unknown_pass_is_refused(
    field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass names live in passes/ only; a rule's constraints are checked where the
    plan reads them, so a misspelt pass is an error, never an ignored constraint."""
    from graphswap.passes import specs
    from graphswap.rewriting import rules
    from graphswap.rewriting.rules import Rule

    base = rules.get_rule("qwen3_attn_swap")
    misspelt = Rule(
        name="misspelt_swap",
        description="a swap rule with a typo",
        targets=base.targets,
        factory=base.factory,
        **{field: ("fdsp",)},
    )
    monkeypatch.setattr(rules, "_REGISTRY", {**rules._REGISTRY, "misspelt_swap": misspelt})
    monkeypatch.setattr(specs, "SWAP_RULES", {"attention": "misspelt_swap"})
    specs.pass_specs.cache_clear()
    try:
        with pytest.raises(
            PassPlanError,
            match=rf"rule 'misspelt_swap': {field} names unknown"
            r" passes \['fdsp'\]; declared passes: pipeline_parallel, swap",
        ):
            passes.pass_plan(config_for(["swap"]))
    finally:
        specs.pass_specs.cache_clear()


@pytest.mark.parametrize("mode", ["attention", "layer", "auto"])
def test_swap_constraints_come_from_the_rule(mode: str) -> None:
    from graphswap.rewriting.rules import get_rule

    rule = get_rule(passes.SWAP_RULES[mode])
    spec = passes.get_spec("swap")
    assert spec.must_run_before == tuple(rule.must_run_before)
    assert spec.excludes == tuple(rule.excludes)


def test_declared_constraints_equal_the_reference() -> None:
    declared = set()
    for spec in passes.pass_specs().values():
        declared |= {(spec.name, later) for later in spec.must_run_before}
        declared |= {(earlier, spec.name) for earlier in spec.must_run_after}
    assert declared == MUST_PRECEDE
    excluded = {
        frozenset((spec.name, other))
        for spec in passes.pass_specs().values()
        for other in spec.excludes
    }
    assert excluded == EXCLUDED


def test_specs_are_declared_with_settings_and_requirements() -> None:
    specs = passes.pass_specs()
    assert tuple(specs) == passes.CANONICAL_ORDER
    for name, spec in specs.items():
        assert spec.enabled_by(config_for([name]))
        assert not spec.enabled_by(TrainerConfig())
    distributed = {name for name, spec in specs.items() if "distributed" in spec.requires}
    assert distributed == {*SHARDING, "pipeline_parallel", "fsdp"}
    not_implemented = {name for name, spec in specs.items() if not spec.implemented}
    assert not_implemented == {"context_parallel", "expert_parallel", "pipeline_parallel"}


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        ((), ()),
        (("fsdp", "swap"), ("swap", "fsdp")),
        (("fsdp", "tensor_parallel", "swap"), ("swap", "tensor_parallel", "fsdp")),
        (
            ("compile", "fsdp", "activation_checkpointing", "expert_parallel", "tensor_parallel"),
            ("tensor_parallel", "expert_parallel", "activation_checkpointing", "compile", "fsdp"),
        ),
        (
            tuple(ON),
            (
                "pipeline_parallel",
                "swap",
                "tensor_parallel",
                "context_parallel",
                "expert_parallel",
                "activation_checkpointing",
                "compile",
                "fsdp",
            ),
        ),
    ],
)
def test_plan_is_the_canonical_order(names: tuple[str, ...], expected: tuple[str, ...]) -> None:
    assert passes.pass_plan(config_for(names)).names == expected


def test_default_config_plans_nothing() -> None:
    plan = passes.pass_plan(TrainerConfig())
    assert plan.names == () and plan.check() is plan
    assert "no passes" in plan.to_text()


def test_every_permutation_of_small_plans_matches_the_reference() -> None:
    """Brute force: every subset of up to four passes, in every order."""
    for size in range(5):
        for subset in itertools.combinations(passes.CANONICAL_ORDER, size):
            for order in itertools.permutations(subset):
                assert_matches_reference(order)


def test_every_permutation_without_swap_matches_the_reference() -> None:
    """The six passes that do not exclude each other: all 720 orders."""
    names = [name for name in passes.CANONICAL_ORDER if name not in ("swap", "pipeline_parallel")]
    for order in itertools.permutations(names):
        assert_matches_reference(order)


def test_swap_with_all_sharding_passes_in_every_order() -> None:
    for order in itertools.permutations(("swap", *SHARDING, "fsdp")):
        assert_matches_reference(order)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.permutations(passes.CANONICAL_ORDER), st.integers(min_value=0, max_value=8))
def test_random_orders_match_the_reference(order: list[str], size: int) -> None:
    assert_matches_reference(tuple(order[:size]))


@pytest.mark.parametrize("other", ["compile", "activation_checkpointing", "pipeline_parallel"])
@pytest.mark.parametrize("swap_first", [True, False])
def test_each_exclusion_is_rejected(other: str, swap_first: bool) -> None:
    order = ("swap", other) if swap_first else (other, "swap")
    config = config_for(order)
    other_setting = passes.get_spec(other).setting_text(config)
    off = passes.get_spec(other).off_text()
    with pytest.raises(PassConflictError) as info:
        PassPlan.from_names(order, config).check()
    assert str(info.value) == (
        f"activation_swap: attention excludes {other_setting}; set activation_swap: none or"
        f" {off} (swap (position {order.index('swap') + 1}) and {other} (position"
        f" {order.index(other) + 1}) cannot run together)"
        + (
            "; to recompute and swap together, set activation_swap: budget with an"
            " activation_memory_budget (graphswap then plans and owns the recompute)"
            if other == "activation_checkpointing"
            else ""
        )
    )
    with pytest.raises(PassConflictError):
        passes.pass_plan(config).check()


@pytest.mark.parametrize("mode", ["attention", "layer", "auto"])
@pytest.mark.parametrize(
    "other", [{"compile": True}, {"activation_checkpointing": True}, {"pp_size": 2}], ids=str
)
def test_every_swap_mode_has_the_same_exclusions(mode: str, other: dict[str, object]) -> None:
    config = TrainerConfig(activation_swap=mode, **other)  # type: ignore[arg-type]
    with pytest.raises(PassConflictError, match=rf"^activation_swap: {mode} excludes "):
        passes.pass_plan(config).check()


def test_compile_exclusion_message() -> None:
    config = TrainerConfig(activation_swap="attention", compile=True)
    with pytest.raises(PassConflictError) as info:
        passes.pass_plan(config).check()
    assert str(info.value).startswith(
        "activation_swap: attention excludes compile: true; set activation_swap: none or"
        " compile: false"
    )


def test_sharding_first_is_rejected_at_plan_time() -> None:
    """P2: the swap rewrite needs the unsharded exact type."""
    config = TrainerConfig(activation_swap="attention", tp_size=2)
    with pytest.raises(PassOrderError) as info:
        PassPlan.from_names(["tensor_parallel", "swap"], config).check()
    assert str(info.value) == (
        "swap (position 2) must run before tensor_parallel (position 1): move swap ahead of"
        " tensor_parallel (graphswap.passes.pass_plan orders them swap -> tensor_parallel) or turn"
        " one off: set activation_swap: none or tp_size: 1"
    )
    config = TrainerConfig(activation_swap="attention", fsdp=True)
    with pytest.raises(PassOrderError, match=r"^swap \(position 2\) must run before fsdp"):
        PassPlan.from_names(["fsdp", "swap"], config).check()


def test_plan_and_config_must_agree() -> None:
    config = TrainerConfig(activation_swap="attention", tp_size=2)
    with pytest.raises(PassSettingError) as info:
        PassPlan.from_names(["swap"], config).check()
    assert str(info.value) == (
        "tp_size: 2 asks for the tensor_parallel pass but the pass plan does not contain it;"
        " add tensor_parallel or set tp_size: 1"
    )
    with pytest.raises(PassSettingError) as info:
        PassPlan.from_names(["swap", "tensor_parallel", "fsdp"], config).check()
    assert str(info.value) == (
        "fsdp (position 3) is in the pass plan but fsdp: false does not enable it; remove fsdp"
        " from the pass plan or change fsdp"
    )


def test_unknown_and_duplicate_pass_names() -> None:
    with pytest.raises(PassPlanError, match=r"^unknown pass 'swapp'; declared passes: "):
        PassPlan.from_names(["swapp"], TrainerConfig())
    with pytest.raises(
        PassPlanError, match=r"^pass 'swap' appears 2 times in the pass plan; list it once"
    ):
        PassPlan.from_names(["swap", "swap"], TrainerConfig(activation_swap="attention"))
    with pytest.raises(PassPlanError, match=r"^unknown pass 'x'"):
        passes.get_spec("x")


def test_cycles_are_rejected() -> None:
    specs = {
        "compile": PassSpec("compile", "compile", False, "a", must_run_before=("fsdp",)),
        "fsdp": PassSpec("fsdp", "fsdp", False, "b", must_run_before=("compile",)),
    }
    config = TrainerConfig(compile=True, fsdp=True)
    with pytest.raises(PassOrderError) as info:
        PassPlan((specs["compile"], specs["fsdp"]), config).check()
    assert str(info.value) == (
        "the constraints of compile (position 1) -> fsdp (position 2) -> compile form a cycle,"
        " so no order satisfies them; turn one of these passes off: set compile: false or"
        " fsdp: false"
    )


def test_graph_holds_the_constraints_among_planned_passes() -> None:
    order = ("tensor_parallel", "swap", "fsdp")
    plan = PassPlan.from_names(order, config_for(order))
    graph = plan.graph
    assert list(graph.nodes) == list(order)
    assert graph.nodes["swap"]["position"] == 2
    assert graph.nodes["swap"]["setting"] == "activation_swap: attention"
    assert set(graph.edges) == {
        ("swap", "tensor_parallel"),
        ("swap", "fsdp"),
        ("tensor_parallel", "fsdp"),
    }
    assert graph.edges["swap", "tensor_parallel"]["satisfied"] is False
    assert graph.edges["swap", "fsdp"]["satisfied"] is True


@pytest.mark.filterwarnings("ignore::DeprecationWarning:pydot.*")
def test_renderings_are_deterministic_and_parse() -> None:
    import pydot

    config = config_for(("swap", "tensor_parallel", "fsdp"))
    first, second = passes.pass_plan(config), passes.pass_plan(config)
    assert first.to_dot() == second.to_dot()
    assert first.to_json() == second.to_json()
    data = json.loads(first.to_json())
    assert [p["name"] for p in data["passes"]] == ["swap", "tensor_parallel", "fsdp"]
    assert data["passes"][1]["value"] == 2
    assert {"before": "swap", "after": "fsdp", "declared_by": "swap"} in data["constraints"]
    (graph,) = pydot.graph_from_dot_data(first.to_dot())
    assert {node.get_name().strip('"') for node in graph.get_nodes()} >= {"swap", "fsdp"}
    text = first.to_text()
    assert "1. swap" in text and "tp_size: 2" in text and "swap -> tensor_parallel" in text
    not_implemented = passes.pass_plan(config_for(("context_parallel",))).to_text()
    assert "[declared, not implemented]" in not_implemented


def test_pass_order_runs_as_given_when_legal() -> None:
    config = TrainerConfig(
        activation_swap="attention",
        tp_size=2,
        fsdp=True,
        pass_order=("swap", "tensor_parallel", "fsdp"),
    )
    assert passes.pass_plan(config).check().names == ("swap", "tensor_parallel", "fsdp")
    assert passes.pass_plan(TrainerConfig(pass_order=())).check().names == ()


@pytest.mark.parametrize(
    ("settings", "order", "error", "message"),
    [
        (
            {"activation_swap": "attention", "tp_size": 2},
            ("tensor_parallel", "swap"),
            PassOrderError,
            "pass_order: swap (position 2) must run before tensor_parallel (position 1): move"
            " swap ahead of tensor_parallel (an order that runs: pass_order: [swap,"
            " tensor_parallel]) or turn one off: set activation_swap: none or tp_size: 1",
        ),
        (
            {"activation_swap": "attention", "tp_size": 2},
            ("swap",),
            PassSettingError,
            "pass_order: tp_size: 2 asks for the tensor_parallel pass but pass_order does not"
            " contain it; add tensor_parallel to pass_order or set tp_size: 1",
        ),
        (
            {"activation_swap": "attention"},
            ("swap", "fsdp"),
            PassSettingError,
            "pass_order: fsdp (position 2) is in pass_order but fsdp: false does not enable it;"
            " remove fsdp from pass_order or change fsdp",
        ),
        (
            {"activation_swap": "attention"},
            ("swap", "swap"),
            PassPlanError,
            "pass_order: pass 'swap' appears 2 times in pass_order; list it once",
        ),
        (
            {},
            ("swapp",),
            PassPlanError,
            "pass_order: unknown pass 'swapp'; declared passes: pipeline_parallel, swap,"
            " tensor_parallel, context_parallel, expert_parallel, activation_checkpointing,"
            " compile, fsdp",
        ),
    ],
    ids=["order", "missing", "not-enabled", "duplicate", "unknown"],
)
def test_bad_pass_order_names_the_key_and_the_fix(
    settings: dict[str, Any], order: tuple[str, ...], error: type[PassPlanError], message: str
) -> None:
    config = TrainerConfig(**settings, pass_order=order)
    with pytest.raises(error) as info:
        passes.pass_plan(config).check()
    assert type(info.value) is error
    assert str(info.value) == message


def test_pass_order_keeps_the_exclusion_and_cycle_checks() -> None:
    config = TrainerConfig(
        activation_swap="attention", compile=True, pass_order=("swap", "compile")
    )
    with pytest.raises(PassConflictError, match=r"^activation_swap: attention excludes compile"):
        passes.pass_plan(config).check()
