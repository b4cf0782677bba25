"""Every model-infrastructure pass, declared as data.

Ordering and exclusions live here, not in code paths, so that a plan can be checked
before anything touches the model. The swap pass takes its constraints from the
rewrite rule's own metadata (``graphswap.rewriting.rules``): one source of truth.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphswap.passes.errors import PassPlanError
from graphswap.rewriting.rules import SWAP_MODE_RULES, Rule, get_rule
from graphswap.rewriting.transforms import Transform

if TYPE_CHECKING:
    from graphswap.passes.settings import PassSettings

SWAP_RULE = SWAP_MODE_RULES["attention"]
"""The rewrite rule the swap pass applies for ``activation_swap: attention``: any Hugging
Face decoder family, by the classes the model declares."""

SWAP_RULES: Mapping[str, str] = SWAP_MODE_RULES
"""The registered rule behind each ``activation_swap`` mode (``auto`` runs the layer
rule with a planned policy per layer, see ``graphswap.passes.plan_executor``)."""

CANONICAL_ORDER: tuple[str, ...] = (
    "pipeline_parallel",
    "swap",
    "tensor_parallel",
    "context_parallel",
    "expert_parallel",
    "activation_checkpointing",
    "compile",
    "fsdp",
)
"""The order ``graphswap.passes.pass_plan`` emits. Pipeline parallel splits the model into stages
first (as in torchtitan); every other pass then runs per stage."""

DISTRIBUTED = "distributed"
"""Requirement: an initialized process group (or a device mesh) whose world the
pass's size divides."""


@dataclass(frozen=True)
class PassSpec:
    """One pass: its constraints and the config setting that turns it on.

    ``off_value`` is the setting's value that disables the pass; any other value
    enables it. Constraints name other passes; those absent from a plan are ignored.
    """

    name: str
    setting: str
    off_value: Any
    summary: str
    must_run_before: tuple[str, ...] = ()
    must_run_after: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    implemented: bool = True
    leaves: Transform | None = None
    """What the pass leaves on a model (``graphswap.rewriting.transforms``): a model that shows it
    before the plan runs had the pass applied outside the plan."""

    def enabled_by(self, config: PassSettings) -> bool:
        return getattr(config, self.setting) != self.off_value

    def setting_text(self, config: PassSettings) -> str:
        """``key: value`` as the user wrote it in YAML."""
        return f"{self.setting}: {yaml_value(getattr(config, self.setting))}"

    def off_text(self) -> str:
        return f"{self.setting}: {yaml_value(self.off_value)}"


def yaml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


_AFTER_SHARDING = ("activation_checkpointing", "compile", "fsdp")


def _sharding(name: str, setting: str, summary: str, **more: Any) -> PassSpec:
    """A pass that shards parameters over a mesh of ``setting`` ranks (DTensors): it
    needs a distributed world and runs before everything that wraps whole layers."""
    return PassSpec(
        name=name,
        setting=setting,
        off_value=1,
        summary=summary,
        must_run_before=_AFTER_SHARDING,
        requires=(DISTRIBUTED,),
        leaves=Transform.SHARDED,
        **more,
    )


def _switched(name: str, summary: str, leaves: Transform, **more: Any) -> PassSpec:
    """A pass turned on by the boolean setting of its own name."""
    return PassSpec(
        name=name, setting=name, off_value=False, summary=summary, leaves=leaves, **more
    )


def _static_specs() -> tuple[PassSpec, ...]:
    return (
        PassSpec(
            name="pipeline_parallel",
            setting="pp_size",
            off_value=1,
            summary="split the decoder layers into pipeline stages",
            must_run_before=(
                "tensor_parallel",
                "context_parallel",
                "expert_parallel",
                *_AFTER_SHARDING,
            ),
            requires=(DISTRIBUTED,),
            implemented=False,
        ),
        _sharding(
            "tensor_parallel",
            "tp_size",
            "shard attention heads over the tp mesh (q/k/v colwise, o rowwise)",
        ),
        _sharding(
            "context_parallel",
            "cp_size",
            "shard the sequence dimension of attention over the cp mesh",
            implemented=False,
        ),
        _sharding(
            "expert_parallel",
            "ep_size",
            "place MoE experts on different ranks of the ep mesh",
            must_run_after=("tensor_parallel",),
            implemented=False,
        ),
        _switched(
            "activation_checkpointing",
            "recompute each decoder layer in backward (torch checkpoint_wrapper)",
            Transform.CHECKPOINT,
            must_run_before=("compile", "fsdp"),
        ),
        _switched(
            "compile",
            "torch.compile each decoder layer",
            Transform.COMPILE,
            must_run_before=("fsdp",),
        ),
        _switched(
            "fsdp",
            "FSDP2 fully_shard each decoder layer and the root",
            Transform.FSDP,
            requires=(DISTRIBUTED,),
        ),
    )


def _swap_spec() -> PassSpec:
    """One spec for every mode: the union of the constraints their rules declare, so
    each mode but ``none`` has the same order and exclusions."""
    rules = [get_rule(name) for name in dict.fromkeys(SWAP_RULES.values())]
    return PassSpec(
        name="swap",
        setting="activation_swap",
        off_value="none",
        summary="swap saved activations to host: attention, layer (whole decoder layers), "
        "auto (per layer what the link hides) or budget (per layer keep, swap or recompute "
        "within activation_memory_budget); rules " + ", ".join(repr(rule.name) for rule in rules),
        must_run_before=_rule_passes(rules, "must_run_before"),
        excludes=_rule_passes(rules, "excludes"),
        leaves=Transform.SWAP,
    )


def _rule_passes(rules: Iterable[Rule], field: str) -> tuple[str, ...]:
    """The union of the passes that ``rules`` name in ``field``; a rule naming a pass
    that is not declared here is refused (the rule's author misspelt it)."""
    names = tuple(dict.fromkeys(name for rule in rules for name in getattr(rule, field)))
    for rule in rules:
        unknown = [name for name in getattr(rule, field) if name not in CANONICAL_ORDER]
        if unknown:
            raise PassPlanError(
                f"rule {rule.name!r}: {field} names unknown passes {unknown}; declared"
                f" passes: {', '.join(CANONICAL_ORDER)}"
            )
    return names


@functools.cache
def pass_specs() -> Mapping[str, PassSpec]:
    """All declared passes by name, in canonical order."""
    specs = {spec.name: spec for spec in (*_static_specs(), _swap_spec())}
    return {name: specs[name] for name in CANONICAL_ORDER}


def get_spec(name: str) -> PassSpec:
    specs = pass_specs()
    if name not in specs:
        raise PassPlanError(f"unknown pass {name!r}; declared passes: {', '.join(specs)}")
    return specs[name]
