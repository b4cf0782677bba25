"""Rule (declarative data), the registry, and the built-in qwen3_attn_swap."""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch import nn

from graphswap import rules as rules_module
from graphswap.rules import (
    RewriteError,
    Rule,
    RuleContext,
    UnknownRuleError,
    available_rules,
    get_rule,
    register_rule,
)


def _new_module(module: nn.Module, ctx: RuleContext) -> nn.Module:
    return nn.Identity()


def make_rule(**overrides: object) -> Rule:
    fields: dict[str, object] = {
        "name": "linear_to_identity",
        "description": "test rule",
        "targets": ("torch.nn:Linear",),
        "factory": _new_module,
        **overrides,
    }
    return Rule(**fields)  # type: ignore[arg-type]


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Rule]:
    """A private copy of the registry, so that test rules do not leak."""
    private = dict(rules_module._REGISTRY)
    monkeypatch.setattr(rules_module, "_REGISTRY", private)
    return private


def test_layer_rule_has_the_attention_rules_plan_metadata() -> None:
    layer, attention = get_rule("qwen3_moe_layer_swap"), get_rule("qwen3_attn_swap")
    assert layer.targets == (
        "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeDecoderLayer",
    )
    assert (layer.match_subclasses, layer.link) == (False, "sequential")
    assert (layer.must_run_before, layer.excludes) == (
        attention.must_run_before,
        attention.excludes,
    )


def test_builtin_rule_is_registered_with_its_plan_metadata() -> None:
    assert "qwen3_attn_swap" in available_rules()
    rule = get_rule("qwen3_attn_swap")
    assert rule.targets == ("transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeAttention",)
    assert rule.target_names == (
        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention",
    )
    assert rule.match_subclasses is False
    assert rule.link == "sequential"
    assert set(rule.must_run_before) == {
        "tensor_parallel",
        "context_parallel",
        "expert_parallel",
        "compile",
        "fsdp",
    }
    assert set(rule.excludes) == {"compile", "activation_checkpointing", "pipeline_parallel"}


def test_a_user_rule_constrains_no_pass_unless_it_says_so() -> None:
    """Only the swap rules exclude compile; a rule of one's own starts with no constraints."""
    rule = make_rule()
    assert (rule.must_run_before, rule.excludes) == ((), ())


def test_rules_are_frozen() -> None:
    rule = get_rule("qwen3_attn_swap")
    with pytest.raises(AttributeError):
        rule.name = "other"  # type: ignore[misc]


def test_register_and_duplicate(registry: dict[str, Rule]) -> None:
    rule = make_rule()
    assert register_rule(rule) is rule
    assert get_rule("linear_to_identity") is rule
    assert available_rules() == sorted(registry)
    with pytest.raises(ValueError, match="'linear_to_identity' is already registered"):
        register_rule(make_rule(description="another"))


def test_unknown_rule_lists_available_and_suggests_the_closest() -> None:
    with pytest.raises(UnknownRuleError) as info:
        get_rule("qwen3_attention_swap")
    message = str(info.value)
    assert message.startswith(
        "unknown rule 'qwen3_attention_swap' (did you mean 'qwen3_attn_swap'?)"
    )
    assert "available rules: qwen3_attn_swap" in message
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, RewriteError)


def test_unknown_rule_without_a_close_name() -> None:
    with pytest.raises(UnknownRuleError, match=r"^unknown rule 'zzz'; available rules: "):
        get_rule("zzz")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"name": "not an identifier"}, "must be an identifier"),
        ({"targets": ()}, "non-empty tuple"),
        ({"targets": "torch.nn:Linear"}, "non-empty tuple"),
        ({"link": "ring"}, "link must be one of"),
    ],
)
def test_invalid_rules_are_rejected(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_rule(**overrides)


def test_targets_resolve_lazily_and_a_bad_path_fails_loudly() -> None:
    rule = make_rule(targets=("no_such_package.mod:Thing",))
    with pytest.raises(RewriteError, match=r"cannot import target 'no_such_package\.mod:Thing'"):
        rule.resolve_targets()
    with pytest.raises(RewriteError, match="is not a class"):
        make_rule(targets=("torch.nn.functional:relu",)).resolve_targets()
    assert make_rule(targets=("torch.nn.Linear",)).resolve_targets() == (nn.Linear,)


class MyLinear(nn.Linear):
    pass


def test_matching_is_exact_unless_subclasses_are_asked_for() -> None:
    exact = make_rule()
    loose = make_rule(match_subclasses=True)
    targets = exact.resolve_targets()
    sub = MyLinear(1, 1)
    assert exact.matches("a", nn.Linear(1, 1), targets)
    assert not exact.matches("a", sub, targets)
    assert loose.matches("a", sub, targets)


def test_fqn_pattern_spans_dots() -> None:
    rule = make_rule(fqn_pattern="*layers.*.proj")
    targets = rule.resolve_targets()
    linear = nn.Linear(1, 1)
    assert rule.matches("model.layers.11.proj", linear, targets)
    assert not rule.matches("model.layers.11.proj.inner", linear, targets)
    assert not rule.matches("model.head", linear, targets)


def test_importing_graphswap_does_not_import_model_code() -> None:
    code = (
        "import sys, graphswap, graphswap.rules, graphswap.rewrite, graphswap.graph\n"
        "bad = [m for m in sys.modules if m.startswith(('transformers', 'torch._dynamo'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
