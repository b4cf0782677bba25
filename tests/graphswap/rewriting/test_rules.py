"""Rule (declarative data), the registry, the built-in qwen3_attn_swap, and the family-generic
attn_swap and layer_swap."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from graphswap import rewrite
from graphswap.errors import HierarchyError, NoMatchError
from graphswap.rewriting import rules as rules_module
from graphswap.rewriting.rules import (
    RewriteError,
    Rule,
    RuleContext,
    UnknownRuleError,
    available_rules,
    get_rule,
    register_rule,
)
from graphswap.runtime import is_swap_wrapped


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
    assert (layer.must_run_before, layer.excludes) == (
        attention.must_run_before,
        attention.excludes,
    )


def test_builtin_rule_is_registered_with_its_plan_metadata() -> None:
    assert "qwen3_attn_swap" in available_rules()
    rule = get_rule("qwen3_attn_swap")
    assert rule.targets == ("transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeAttention",)
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
    assert "available rules: attn_swap, layer_swap, qwen3_attn_swap" in message
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


def test_matching_is_by_exact_type() -> None:
    rule = make_rule()
    targets = rule.resolve_targets()
    assert rule.matches("a", nn.Linear(1, 1), targets)
    assert not rule.matches("a", MyLinear(1, 1), targets)


def test_fqn_pattern_spans_dots() -> None:
    rule = make_rule(fqn_pattern="*layers.*.proj")
    targets = rule.resolve_targets()
    linear = nn.Linear(1, 1)
    assert rule.matches("model.layers.11.proj", linear, targets)
    assert not rule.matches("model.layers.11.proj.inner", linear, targets)
    assert not rule.matches("model.head", linear, targets)


# The family-generic rules: targets declared by the model, matched by exact type.


def _llama(num_layers: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize(("name", "attr"), [("attn_swap", "self_attn"), ("layer_swap", None)])
def test_generic_rules_wrap_the_classes_the_model_declares(name: str, attr: str | None) -> None:
    from transformers.models.llama import modeling_llama

    model = _llama()
    declared = get_rule(name).resolve_targets(model)
    assert declared == (
        (modeling_llama.LlamaAttention,) if attr else (modeling_llama.LlamaDecoderLayer,)
    )
    report = rewrite(model, rules=[name])
    suffix = f".{attr}" if attr else ""
    assert report.rules[0].fqns == (f"model.layers.0{suffix}", f"model.layers.1{suffix}")
    assert report.rules[0].links == ((f"model.layers.0{suffix}", f"model.layers.1{suffix}"),)
    assert get_rule(name).must_run_before == get_rule("qwen3_attn_swap").must_run_before
    assert get_rule(name).excludes == get_rule("qwen3_attn_swap").excludes


def test_a_layer_whose_attention_is_not_the_declared_class_is_refused_and_the_model_kept() -> None:
    from transformers.models.llama import modeling_llama

    model = _llama()

    class MyAttention(modeling_llama.LlamaAttention):
        pass

    model.model.layers[1].self_attn.__class__ = MyAttention
    before = [type(m) for m in model.modules()]
    with pytest.raises(HierarchyError) as info:
        rewrite(model, rules=["attn_swap"])
    message = str(info.value)
    assert "'model.layers.1.self_attn' must be exactly" in message
    assert "modeling_llama.LlamaAttention" in message and "MyAttention" in message
    assert [type(m) for m in model.modules()] == before
    assert not any(is_swap_wrapped(m) for m in model.modules())


def test_every_attention_subclassed_matches_nothing_and_names_the_subclass() -> None:
    from transformers.models.llama import modeling_llama

    model = _llama()

    class MyAttention(modeling_llama.LlamaAttention):
        pass

    for layer in model.model.layers:
        layer.self_attn.__class__ = MyAttention
    with pytest.raises(NoMatchError) as info:
        rewrite(model, rules=["attn_swap"])
    assert "exact type transformers.models.llama.modeling_llama.LlamaAttention" in str(info.value)
    assert "MyAttention at 'model.layers.0.self_attn' (+1 more): a subclass" in str(info.value)


def test_a_model_without_decoder_attention_lists_the_module_types_found() -> None:
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))
    for name in ("attn_swap", "layer_swap"):
        with pytest.raises(NoMatchError) as info:
            rewrite(model, rules=[name])
        message = str(info.value)
        assert message.startswith(f"rule {name!r} found no decoder attention to match")
        assert (
            "module types found: torch.nn.modules.container.Sequential,"
            " torch.nn.modules.sparse.Embedding, torch.nn.modules.linear.Linear" in message
        )


def test_a_stack_with_layers_but_no_declared_classes_lists_what_it_holds() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(4, 4)])
    with pytest.raises(NoMatchError, match="declares no decoder layer and attention classes"):
        rewrite(model, rules=["attn_swap"])


def test_a_hybrid_stack_refuses_attn_swap_by_name_and_takes_layer_swap() -> None:
    """Qwen3-Next mixes linear-attention layers with full attention: attention swap
    would leave holes in the prefetch chain, whole layers are all one declared class."""
    pytest.importorskip("transformers.models.qwen3_next")
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=2,
        num_experts_per_tok=1,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    model = Qwen3NextForCausalLM(config)
    with pytest.raises(HierarchyError) as info:
        rewrite(model, rules=["attn_swap"])
    message = str(info.value)
    assert "'model.layers.0' holds no transformers.models.qwen3_next" in message
    assert "(it holds linear_attn (Qwen3NextGatedDeltaNet)" in message
    assert message.endswith("use layer_swap, which wraps every layer whatever it holds")
    assert len(rewrite(model, rules=["layer_swap"]).rules[0].fqns) == 2


def test_a_rule_takes_targets_or_targets_from_not_both() -> None:
    with pytest.raises(ValueError, match="give either targets"):
        make_rule(targets_from=get_rule("attn_swap").targets_from)
    with pytest.raises(RewriteError, match="takes its targets from the model: pass the model"):
        get_rule("attn_swap").resolve_targets()


def test_with_policy_keeps_the_rule_but_its_policy_and_refuses_a_rule_without_one() -> None:
    from graphswap.rewriting.rules import with_policy
    from graphswap.runtime.policy import size_threshold_policy

    policy = size_threshold_policy(1 << 10, name="one_kib")
    rule = with_policy("attn_swap", policy)
    model = _llama()
    report = rewrite(model, rules=[rule])
    assert report.rules[0].rule == "attn_swap"
    assert {group.policy for group in report.manager.groups()} == {"one_kib"}
    with pytest.raises(RewriteError, match="does not wrap with a swap policy") as info:
        with_policy(make_rule(), policy)
    assert "swap rules: attn_swap, layer_swap, qwen3_attn_swap, qwen3_moe_layer_swap" in str(
        info.value
    )


def test_a_stack_of_two_declared_layer_classes_is_swapped_per_class(one_thread: None) -> None:
    """Jamba alternates Mamba and attention layers, two classes it declares: layer_swap
    wraps and links every layer by its own exact class and changes no number;
    attn_swap refuses the Mamba layers, which hold no attention."""
    pytest.importorskip("transformers.models.jamba")
    import torch
    from transformers import JambaConfig, JambaForCausalLM

    from graphswap.rewriting.rules import with_policy
    from graphswap.runtime.policy import size_threshold_policy

    config = JambaConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        num_experts=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=4,
    )
    torch.manual_seed(0)
    model = JambaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters() if p.grad is not None]

    plain_loss, plain_grads = step()
    report = rewrite(model, rules=[with_policy("layer_swap", size_threshold_policy(4 << 10))])
    kinds = [change.old_type.rpartition(".")[2] for change in report.rules[0].changes]
    assert kinds == ["JambaMambaDecoderLayer", "JambaAttentionDecoderLayer"] * 2
    assert len(report.rules[0].links) == 3
    loss, grads = step()
    stats = report.manager.stats
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    assert stats.offloaded_bytes == stats.reloaded_bytes > 0 and stats.prefetch_misses == 0
    report.undo()
    with pytest.raises(HierarchyError, match=r"'model\.layers\.0' holds no .*JambaAttention \(it"):
        rewrite(model, rules=["attn_swap"])


@pytest.mark.parametrize(
    ("family", "overrides", "child"),
    [
        ("gpt_neox", {}, "attention"),
        ("jetmoe", {}, "self_attention"),
        ("nemotron_h", {"hybrid_override_pattern": "**"}, "mixer"),
    ],
)
def test_attn_swap_finds_the_declared_attention_whatever_its_name(
    family: str, overrides: dict[str, object], child: str, tour_config: Any, one_thread: None
) -> None:
    """GPT-NeoX, JetMoe and NemotronH hold exactly the attention class they declare, under
    another name than self_attn: it is swapped at its own FQN, and no number changes."""
    import torch

    from graphswap.hf.checkpoints import build_model, decoder_layers
    from graphswap.rewriting.rules import with_policy
    from graphswap.runtime.policy import size_threshold_policy

    config = tour_config(family, num_hidden_layers=2, **overrides)
    torch.manual_seed(0)
    model = build_model(config)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters() if p.grad is not None]

    plain_loss, plain_grads = step()
    report = rewrite(model, rules=[with_policy("attn_swap", size_threshold_policy(4 << 10))])
    layers_fqn, _ = decoder_layers(model)
    assert report.rules[0].fqns == (f"{layers_fqn}.0.{child}", f"{layers_fqn}.1.{child}")
    loss, grads = step()
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    stats = report.manager.stats
    assert stats.offloaded_bytes == stats.reloaded_bytes > 0


def test_attn_swap_on_a_hybrid_stack_names_the_layer_without_attention(
    tour_config: Any,
) -> None:
    """NemotronH's Mamba blocks hold a mixer of another class: the error says so and
    names layer_swap, not "a subclass of" the class the model holds."""
    import torch

    from graphswap.hf.checkpoints import build_model

    model = build_model(tour_config("nemotron_h"), device=torch.device("meta"))
    with pytest.raises(HierarchyError) as info:
        rewrite(model, rules=["attn_swap"])
    message = str(info.value)
    assert "'model.layers.0' holds no" in message and "NemotronHAttention" in message
    assert "mixer (NemotronHMamba2Mixer)" in message and "use layer_swap" in message
    assert "subclass" not in message
