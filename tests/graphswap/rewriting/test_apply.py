"""rewrite(): exact matches, all-or-nothing application, loud refusals, exact undo."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeAttention,
    Qwen3MoeDecoderLayer,
)

from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import qwen3_moe_config
from graphswap.rewriting.apply import (
    AlreadyTransformedError,
    HierarchyError,
    NoMatchError,
    RewriteError,
    RewriteReport,
    RuleConflictError,
    rewrite,
    rewrite_report,
    unrewrite,
)
from graphswap.rewriting.rules import Rule, RuleContext, available_rules
from graphswap.runtime import SwapManager, is_swap_wrapped, swap_wrapper, unwrap_swap
from graphswap.runtime.policy import size_threshold_policy

ATTN = "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeAttention"


def meta_model(layers: int = 48) -> nn.Module:
    return build_model(qwen3_moe_config("graph-default", num_hidden_layers=layers), device="meta")


def attn_fqns(layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn" for i in range(layers)]


def snapshot(model: nn.Module) -> dict[str, tuple[type, int]]:
    """Every module's exact type and identity, by FQN."""
    return {fqn: (type(m), id(m)) for fqn, m in model.named_modules()}


def assert_untouched(model: nn.Module, before: dict[str, tuple[type, int]]) -> None:
    assert snapshot(model) == before
    assert not any(is_swap_wrapped(m) for m in model.modules())
    assert not hasattr(model, "_graphswap_rewrite")


class SubAttention(Qwen3MoeAttention):
    """A user subclass: must not be matched by an exact-type rule."""


def swap_rule(name: str, **overrides: object) -> Rule:
    def factory(module: nn.Module, ctx: RuleContext) -> nn.Module:
        return swap_wrapper(module, manager=ctx.manager, name=ctx.fqn)

    fields: dict[str, object] = {
        "name": name,
        "description": f"test rule {name}",
        "targets": (ATTN,),
        "factory": factory,
        "restore": unwrap_swap,
        **overrides,
    }
    return Rule(**fields)  # type: ignore[arg-type]


def test_48_layers_wraps_attention_only_and_keeps_names() -> None:
    model = meta_model(48)
    before = snapshot(model)
    state_keys = list(model.state_dict())
    params = [(n, id(p)) for n, p in model.named_parameters()]

    report = rewrite(model, ["qwen3_attn_swap"])

    (rule_report,) = report.rules
    assert list(rule_report.fqns) == attn_fqns(48)
    assert len(rule_report.links) == 47
    assert rule_report.links[0] == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    assert {c.old_type for c in rule_report.changes} == {
        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention"
    }
    assert all(c.in_place and c.new_type != c.old_type for c in rule_report.changes)
    assert str(report) == "qwen3_attn_swap: 48 modules wrapped, 47 prefetch links"
    assert len(report.manager.groups()) == 48
    assert report.graph.number_of_nodes() == 48
    assert report.graph.number_of_edges() == 47

    after = snapshot(model)
    wrapped = set(attn_fqns(48))
    for fqn, (cls, ident) in before.items():
        assert after[fqn][1] == ident, fqn
        if fqn in wrapped:
            assert after[fqn][0] is not cls
            assert isinstance(model.get_submodule(fqn), Qwen3MoeAttention)
        else:
            assert after[fqn][0] is cls, f"{fqn} was touched"
    assert list(model.state_dict()) == state_keys
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    assert model.model.layers[3].self_attn.layer_idx == 3

    report.undo()
    assert_untouched(model, before)
    assert all(type(model.get_submodule(f)) is Qwen3MoeAttention for f in wrapped)


def test_report_to_dict_is_json_and_complete() -> None:
    report = rewrite(meta_model(3), "qwen3_attn_swap")
    data = json.loads(json.dumps(report.to_dict()))
    assert data["dry_run"] is False
    (rule,) = data["rules"]
    assert rule["rule"] == "qwen3_attn_swap"
    assert [c["fqn"] for c in rule["changes"]] == attn_fqns(3)
    assert rule["links"] == [list(pair) for pair in report.rules[0].links]
    assert len(data["prefetch_graph"]["nodes"]) == 3
    assert [(e["source"], e["target"]) for e in data["prefetch_graph"]["edges"]] == [
        ("model.layers.1.self_attn", "model.layers.0.self_attn"),
        ("model.layers.2.self_attn", "model.layers.1.self_attn"),
    ]


def test_qwen3_moe_model_root_is_accepted() -> None:
    inner = meta_model(2).model
    report = rewrite(inner, "qwen3_attn_swap")
    assert list(report.rules[0].fqns) == ["layers.0.self_attn", "layers.1.self_attn"]


def _qwen3_moe_model_classes() -> list[type]:
    """Every model class transformers ships for Qwen3-MoE: the bare model and each head."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as module

    base = module.Qwen3MoePreTrainedModel
    classes = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, base) and c is not base
    ]
    return sorted(classes, key=lambda c: c.__name__)


def test_the_model_classes_include_every_head() -> None:
    names = {c.__name__ for c in _qwen3_moe_model_classes()}
    assert names >= {
        "Qwen3MoeModel",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeForSequenceClassification",
        "Qwen3MoeForTokenClassification",
        "Qwen3MoeForQuestionAnswering",
    }


@pytest.mark.parametrize("cls", _qwen3_moe_model_classes(), ids=lambda c: c.__name__)
def test_every_qwen3_moe_model_class_is_rewritten_exactly(cls: type) -> None:
    config = qwen3_moe_config("tiny", num_hidden_layers=2, num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    plain = cls(config)
    swapped = cls(config)
    swapped.load_state_dict(plain.state_dict())
    # 256 tokens: each layer's attention probabilities (2 MiB) pass the swap policy.
    ids = torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(1))

    report = rewrite(swapped, "qwen3_attn_swap")
    stack = next(fqn for fqn, m in swapped.named_modules() if type(m).__name__ == "Qwen3MoeModel")
    prefix = f"{stack}." if stack else ""
    assert list(report.rules[0].fqns) == [f"{prefix}layers.{i}.self_attn" for i in range(2)]
    assert len(report.rules[0].links) == 1

    def grads(model: nn.Module) -> dict[str, torch.Tensor]:
        torch.manual_seed(2)  # the same dropout masks in both runs
        out = model(input_ids=ids).to_tuple()[0]
        out.float().pow(2).mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    expected, got = grads(plain), grads(swapped)
    assert report.manager.stats.offloaded_bytes > 0
    assert got.keys() == expected.keys() and got
    assert all(torch.equal(got[n], expected[n]) for n in got)


def test_a_head_class_keeps_the_exact_type_check() -> None:
    from transformers import Qwen3MoeForQuestionAnswering

    model = Qwen3MoeForQuestionAnswering(qwen3_moe_config("tiny", num_hidden_layers=2))
    model.transformer.layers[1].self_attn.__class__ = SubAttention
    with pytest.raises(
        HierarchyError, match=r"'transformer\.layers\.1\.self_attn'.*found .*SubAttention"
    ):
        rewrite(model, "qwen3_attn_swap")
    assert not any(is_swap_wrapped(m) for m in model.modules())


def test_unrewrite_restores_and_allows_a_second_rewrite() -> None:
    model = meta_model(4)
    before = snapshot(model)
    rewrite(model, "qwen3_attn_swap")
    report = unrewrite(model)
    assert isinstance(report, RewriteReport)
    assert_untouched(model, before)
    with pytest.raises(RewriteError, match="already undone"):
        report.undo()
    assert str(rewrite(model, "qwen3_attn_swap")) == (
        "qwen3_attn_swap: 4 modules wrapped, 3 prefetch links"
    )


def linear_swap_rule() -> Rule:
    """Every ``nn.Linear`` of a toy model wrapped and linked: the manager's counters move."""
    return Rule(
        name="linear_swap",
        description="swap what every Linear saves",
        targets=("torch.nn.modules.linear:Linear",),
        factory=lambda m, ctx: swap_wrapper(
            m, manager=ctx.manager, name=ctx.fqn, policy=size_threshold_policy(1024)
        ),
        restore=unwrap_swap,
    )


@pytest.mark.parametrize("how", ["report.undo", "unrewrite"])
def test_undo_keeps_the_stats_of_what_ran_readable(how: str) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    report = rewrite(model, [linear_swap_rule()])
    model(torch.randn(32, 64, requires_grad=True)).sum().backward()
    ran = report.manager.stats
    assert ran.offloaded_tensors > 0 and ran.reloaded_tensors == ran.offloaded_tensors
    if how == "unrewrite":
        unrewrite(model)
    else:
        report.undo()
    assert report.manager.stats == ran
    assert set(report.manager.stats.per_group) == {"0", "2"}


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        (None, "rules must be a rule name, a Rule or a list of them, got NoneType None"),
        (42, "rules must be a rule name, a Rule or a list of them, got int 42"),
        (["qwen3_attn_swap", 42], "rules must list rule names or Rule objects, got int 42"),
    ],
)
def test_rules_of_the_wrong_type_name_the_argument_and_the_rules(
    rules: object, message: str
) -> None:
    model = meta_model(2)
    before = snapshot(model)
    with pytest.raises(TypeError) as info:
        rewrite(model, rules)  # type: ignore[arg-type]
    assert str(info.value) == (
        f"{message}; available rules: {', '.join(available_rules())} (e.g. rules=['attn_swap'])"
    )
    assert "qwen3_attn_swap, qwen3_moe_layer_swap" in str(info.value)
    assert_untouched(model, before)


def test_unrewrite_of_untouched_model_raises() -> None:
    with pytest.raises(RewriteError, match=r"was not rewritten by graphswap\.rewrite"):
        unrewrite(meta_model(2))


def test_dry_run_changes_nothing_and_reports_the_same() -> None:
    model = meta_model(6)
    before = snapshot(model)
    dry = rewrite(model, "qwen3_attn_swap", dry_run=True)
    assert_untouched(model, before)
    assert str(dry).startswith("dry run, nothing changed: qwen3_attn_swap: 6 modules wrapped")
    with pytest.raises(RewriteError, match="dry run"):
        dry.undo()
    real = rewrite(model, "qwen3_attn_swap")
    assert {**dry.to_dict(), "dry_run": False} == real.to_dict()


def test_subclass_does_not_match_and_the_error_says_what_was_found() -> None:
    model = meta_model(2)
    for layer in model.model.layers:
        layer.self_attn.__class__ = SubAttention
    before = snapshot(model)
    with pytest.raises(NoMatchError) as info:
        rewrite(model, "qwen3_attn_swap")
    message = str(info.value)
    assert "'qwen3_attn_swap' matched no module" in message
    assert (
        "exact type transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention" in message
    )
    assert f"{SubAttention.__module__}.SubAttention at 'model.layers.0.self_attn'" in message
    assert "a subclass of Qwen3MoeAttention" in message
    assert "(+1 more)" in message
    assert isinstance(info.value, ValueError)
    assert_untouched(model, before)


def test_no_match_in_an_unrelated_model() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(NoMatchError, match="no module type in the model resembles it"):
        rewrite(model, "qwen3_attn_swap")
    report = rewrite(model, "qwen3_attn_swap", strict=False)
    assert str(report) == "qwen3_attn_swap: matched nothing (strict=False)"
    assert report.graph.number_of_nodes() == 0


def test_a_rewrite_that_matched_nothing_leaves_the_model_untouched(one_thread: None) -> None:
    """strict=False on a model the rule does not fit: no cache hook turns use_cache off
    and no report is attached, so the outputs are the plain model's."""
    torch.manual_seed(0)
    model = build_model(qwen3_moe_config("tiny"))
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    rule = swap_rule("no_such_modules", targets=("torch.nn:Bilinear",))
    report = rewrite(model, [rule], strict=False)
    assert str(report) == "no_such_modules: matched nothing (strict=False)"
    assert rewrite_report(model) is None
    assert model(input_ids=ids, use_cache=True).past_key_values is not None
    rewrite(model, "qwen3_attn_swap")  # not "already rewritten"


def test_one_subclassed_layer_is_a_hierarchy_error_naming_it() -> None:
    model = meta_model(3)
    model.model.layers[1].self_attn.__class__ = SubAttention
    before = snapshot(model)
    with pytest.raises(HierarchyError, match=r"'model\.layers\.1\.self_attn'.*SubAttention"):
        rewrite(model, "qwen3_attn_swap")
    assert_untouched(model, before)


def test_missing_attention_is_a_hierarchy_error() -> None:
    model = meta_model(3)
    model.model.layers[2].self_attn = nn.Identity()
    with pytest.raises(HierarchyError, match=r"'model\.layers\.2\.self_attn'.*Identity"):
        rewrite(model, "qwen3_attn_swap")


def test_layers_must_be_a_module_list() -> None:
    model = meta_model(2)
    model.model.layers = nn.Sequential(*model.model.layers)
    with pytest.raises(
        HierarchyError,
        match=r"'model\.layers' is torch\.nn\..*Sequential; it must be a torch\.nn\.ModuleList",
    ):
        rewrite(model, "qwen3_attn_swap")


def test_root_must_be_a_qwen3_moe_model() -> None:
    with pytest.raises(HierarchyError, match=r"root module.*Sequential"):
        rewrite(nn.Sequential(meta_model(2)), "qwen3_attn_swap")


def test_rewriting_twice_is_refused() -> None:
    model = meta_model(2)
    rewrite(model, "qwen3_attn_swap")
    after = snapshot(model)
    with pytest.raises(AlreadyTransformedError, match=r"already rewritten.*unrewrite\(model\)"):
        rewrite(model, "qwen3_attn_swap")
    assert snapshot(model) == after


def test_a_hand_wrapped_module_is_refused() -> None:
    model = meta_model(2)
    swap_wrapper(model.model.layers[1].self_attn, manager=SwapManager())
    with pytest.raises(
        AlreadyTransformedError, match=r"'model\.layers\.1\.self_attn' is already swap-wrapped"
    ):
        rewrite(model, "qwen3_attn_swap")
    assert type(model.model.layers[0].self_attn) is Qwen3MoeAttention


@pytest.fixture(scope="module")
def cpu_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A gloo world of one CPU process, for real FSDP2 / tensor parallel calls."""
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        store = Path(tmp_path_factory.mktemp("gloo")) / "store"
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{store}")
    if dist.get_world_size() != 1:
        pytest.skip("needs a world of one process")
    yield init_device_mesh("cpu", (1,))
    if owned:
        dist.destroy_process_group()


def tiny_cpu(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return build_model(qwen3_moe_config("tiny", num_hidden_layers=layers))


def test_fully_sharded_model_is_refused(cpu_mesh: object) -> None:
    from torch.distributed.fsdp import fully_shard

    model = tiny_cpu()
    for layer in model.model.layers:
        fully_shard(layer, mesh=cpu_mesh)
    fully_shard(model, mesh=cpu_mesh)
    before = snapshot(model)
    with pytest.raises(
        AlreadyTransformedError, match=r"fully_shard-ed.*must run before fully_shard"
    ):
        rewrite(model, "qwen3_attn_swap")
    assert snapshot(model) == before


def test_tensor_parallel_model_is_refused(cpu_mesh: object) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = tiny_cpu()
    parallelize_module(model, cpu_mesh, {"model.layers.0.self_attn.q_proj": ColwiseParallel()})
    before = snapshot(model)
    with pytest.raises(
        AlreadyTransformedError,
        match=r"parameter 'model\.layers\.0\.self_attn\.q_proj\.weight' is a DTensor",
    ):
        rewrite(model, "qwen3_attn_swap")
    assert snapshot(model) == before


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_compiled_model_is_refused(how: str) -> None:
    model = tiny_cpu()
    if how == "torch.compile":
        model = torch.compile(model)
    else:
        model.compile()
    before = snapshot(model)
    with pytest.raises(
        AlreadyTransformedError, match=r"is compiled.*cannot be combined with compile"
    ):
        rewrite(model, "qwen3_attn_swap")
    assert snapshot(model) == before


def test_activation_checkpointed_model_is_refused() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_cpu()
    model.model.layers[1] = checkpoint_wrapper(model.model.layers[1])
    with pytest.raises(
        AlreadyTransformedError,
        match=r"'model\.layers\.1' is activation-checkpoint-wrapped.*activation_checkpointing",
    ):
        rewrite(model, "qwen3_attn_swap")

    model = tiny_cpu()
    # transformers 5.23 renamed gradient_checkpointing_enable to activation_checkpointing_enable.
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    with pytest.raises(AlreadyTransformedError, match="activation_checkpointing_disable"):
        rewrite(model, "qwen3_attn_swap")


def test_factory_failing_half_way_restores_the_model() -> None:
    def flaky(module: nn.Module, ctx: RuleContext) -> nn.Module:
        if ctx.index == 2:
            raise RuntimeError("out of host memory")
        return swap_wrapper(module, manager=ctx.manager, name=ctx.fqn)

    model = meta_model(4)
    before = snapshot(model)
    manager = SwapManager()
    with pytest.raises(RewriteError, match=r"'flaky' on 'model\.layers\.2\.self_attn'") as info:
        rewrite(model, [swap_rule("flaky", factory=flaky)], manager=manager)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "restored" in str(info.value)
    assert_untouched(model, before)
    assert manager.groups() == []


class Tagged(nn.Module):
    """An out-of-place replacement that keeps the original as a child."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def tag_rule(name: str, *, wrap: bool = True) -> Rule:
    """Decoder layers replaced by a new object, swap-wrapped (or not: it cannot be linked)."""

    def factory(module: nn.Module, ctx: RuleContext) -> nn.Module:
        tagged = Tagged(module)
        return swap_wrapper(tagged, manager=ctx.manager, name=ctx.fqn) if wrap else tagged

    return Rule(
        name=name,
        description="replace decoder layers by a new object",
        targets=("transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeDecoderLayer",),
        factory=factory,
    )


def test_out_of_place_replacement_and_undo() -> None:
    model = meta_model(3)
    before = snapshot(model)
    report = rewrite(model, [tag_rule("tag_layers")])
    assert str(report) == "tag_layers: 3 modules replaced, 2 prefetch links"
    assert all(isinstance(layer, Tagged) for layer in model.model.layers)
    change = report.rules[0].changes[0]
    assert (change.in_place, change.new_type) == (False, "graphswap.runtime._wrapper.SwapTagged")
    report.undo()
    assert_untouched(model, before)


def test_linking_failure_restores_out_of_place_replacements() -> None:
    model = meta_model(3)
    before = snapshot(model)
    with pytest.raises(RewriteError, match=r"while linking.*not swap-wrapped"):
        rewrite(model, [tag_rule("tag_linked", wrap=False)])
    assert_untouched(model, before)
    assert all(type(layer) is Qwen3MoeDecoderLayer for layer in model.model.layers)


def test_two_rules_claiming_one_module_conflict() -> None:
    model = meta_model(2)
    before = snapshot(model)
    with pytest.raises(
        RuleConflictError, match=r"'model\.layers\.0\.self_attn' is claimed by rules"
    ):
        rewrite(model, ["qwen3_attn_swap", swap_rule("second_swap")])
    assert_untouched(model, before)


def test_ancestor_and_descendant_conflict() -> None:
    model = meta_model(2)
    with pytest.raises(RuleConflictError, match=r"replaces 'model\.layers\.0'.*inside it"):
        rewrite(model, [tag_rule("tag_layers"), "qwen3_attn_swap"])


class SubLayer(Qwen3MoeDecoderLayer):
    """A user subclass of the decoder layer: the layer rule must not match it."""


def test_layer_rule_wraps_every_decoder_layer_and_links_them() -> None:
    model = meta_model(6)
    before = snapshot(model)
    state_keys = list(model.state_dict())
    report = rewrite(model, "qwen3_moe_layer_swap")
    assert str(report) == "qwen3_moe_layer_swap: 6 modules wrapped, 5 prefetch links"
    layers = list(model.model.layers)
    assert all(is_swap_wrapped(layer) for layer in layers)
    assert all(isinstance(layer, Qwen3MoeDecoderLayer) for layer in layers)
    assert not any(is_swap_wrapped(layer.self_attn) for layer in layers)
    assert report.manager.links == [
        (f"model.layers.{i}", f"model.layers.{i + 1}") for i in range(5)
    ]
    assert {report.graph.nodes[n]["policy"] for n in report.graph} == {"swap_large_activations"}
    assert list(model.state_dict()) == state_keys
    report.undo()
    assert_untouched(model, before)


def test_layer_rule_refuses_a_subclassed_layer_by_name() -> None:
    model = meta_model(3)
    model.model.layers[1].__class__ = SubLayer
    before = snapshot(model)
    with pytest.raises(
        HierarchyError,
        match=r"^qwen3_moe_layer_swap: 'model\.layers\.1' must be exactly "
        r"transformers\.models\.qwen3_moe\.modeling_qwen3_moe\.Qwen3MoeDecoderLayer, "
        r"found .*SubLayer; every layer is swapped or none is",
    ):
        rewrite(model, "qwen3_moe_layer_swap")
    assert_untouched(model, before)


@pytest.mark.parametrize("layer_first", [True, False])
def test_layer_and_attention_rules_conflict_naming_both(layer_first: bool) -> None:
    model = meta_model(2)
    before = snapshot(model)
    rules = ["qwen3_moe_layer_swap", "qwen3_attn_swap"]
    with pytest.raises(RuleConflictError) as info:
        rewrite(model, rules if layer_first else rules[::-1])
    assert str(info.value).startswith(
        "rule 'qwen3_moe_layer_swap' replaces 'model.layers.0' and rule 'qwen3_attn_swap' "
        "replaces 'model.layers.0.self_attn' inside it"
    )
    assert_untouched(model, before)


def test_node_attributes_of_a_rule_land_in_the_graph_exports() -> None:
    rule = swap_rule("noted", node_attributes=lambda ctx: {"note": f"match {ctx.index}"})
    report = rewrite(meta_model(2), [rule])
    nodes = report.to_dict()["prefetch_graph"]["nodes"]
    assert [node["note"] for node in nodes] == ["match 0", "match 1"]


def test_node_attributes_may_not_overwrite_the_graphs_own() -> None:
    model = meta_model(2)
    before = snapshot(model)
    rule = swap_rule("clobber", node_attributes=lambda ctx: {"policy": "mine"})
    with pytest.raises(RewriteError, match=r"would overwrite the prefetch-graph attributes"):
        rewrite(model, [rule])
    assert_untouched(model, before)


def test_rule_lists_are_checked() -> None:
    model = meta_model(2)
    with pytest.raises(RewriteError, match="at least one rule"):
        rewrite(model, [])
    with pytest.raises(RuleConflictError, match="more than once: qwen3_attn_swap"):
        rewrite(model, ["qwen3_attn_swap", "qwen3_attn_swap"])
    with pytest.raises(KeyError, match="did you mean 'qwen3_attn_swap'"):
        rewrite(model, ["qwen3_attn"])


def test_a_used_manager_is_refused() -> None:
    manager = SwapManager()
    swap_wrapper(nn.Linear(2, 2), manager=manager, name="elsewhere")
    with pytest.raises(RewriteError, match="already has 1 registered module;"):
        rewrite(meta_model(2), "qwen3_attn_swap", manager=manager)


def test_in_place_factory_without_restore_leaves_the_model_untouched() -> None:
    model = meta_model(2)
    before = snapshot(model)
    manager = SwapManager()
    with pytest.raises(RewriteError, match=r"in place but has no restore.*the model was restored"):
        rewrite(model, [swap_rule("no_restore", restore=None)], manager=manager)
    assert_untouched(model, before)
    assert manager.groups() == []
    assert "_graphswap_swap_state" not in model.model.layers[0].self_attn.__dict__
    report = rewrite(model, "qwen3_attn_swap", manager=manager)
    assert len(report.rules[0].changes) == 2


class AttentionStack(nn.Module):
    """Runs each layer's attention: traceable by torch.fx with attention as a leaf."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.model = hf_model.model

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            h = h + layer.self_attn(h, (cos, sin), None)[0]
        return h


class AttentionLeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return type(m) is Qwen3MoeAttention or super().is_leaf_module(m, module_qualified_name)


def test_graph_module_is_rewritten_and_recompiled() -> None:
    hf_model = tiny_cpu()
    stack = AttentionStack(hf_model)
    gm = torch.fx.GraphModule(stack, AttentionLeafTracer().trace(stack))
    before = snapshot(gm)
    h = torch.randn(1, 5, hf_model.config.hidden_size, requires_grad=True)
    cos, sin = hf_model.model.rotary_emb(h, torch.arange(5)[None])
    expected = gm(h, cos, sin)

    report = rewrite(gm, "qwen3_attn_swap")
    assert str(report) == "qwen3_attn_swap: 2 modules wrapped, 1 prefetch link"
    assert all(is_swap_wrapped(gm.get_submodule(f)) for f in attn_fqns(2))
    got = gm(h, cos, sin)
    assert torch.equal(got, expected)
    got.sum().backward()

    report.undo()
    assert snapshot(gm) == before


@pytest.mark.parametrize(
    ("attn_implementation", "seq"),
    [("sdpa", 512), ("eager", 256)],
)
def test_swapped_training_step_is_bitwise_identical(tiny_model, attn_implementation, seq) -> None:  # type: ignore[no-untyped-def]
    # The shortest sequence at which each attention saves tensors of the 1 MiB swap threshold.
    ids = torch.randint(0, 512, (2, seq), generator=torch.Generator().manual_seed(1))

    def step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain_loss, plain_grads = step(
        tiny_model(num_hidden_layers=2, attn_implementation=attn_implementation)
    )
    swapped = tiny_model(num_hidden_layers=2, attn_implementation=attn_implementation)
    manager = rewrite(swapped, "qwen3_attn_swap").manager
    loss, grads = step(swapped)
    assert manager.stats.offloaded_bytes > 0, "the swap moved nothing"
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)
