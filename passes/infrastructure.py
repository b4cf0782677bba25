"""``apply_model_infrastructure``: run the checked plan on a model, pass by pass.

Everything that can be refused is refused before the first pass changes the model:
the plan's order and exclusions, passes that are declared but not implemented, the
distributed world, the head counts. Before each pass the model is searched for traces
of passes that must come later (P2: a model sharded before the swap); after each
pass its effect is verified (I2: never a silent no-op).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from passes.activation_checkpointing import apply_activation_checkpointing
from passes.compile import apply_compile
from passes.errors import PassConflictError, PassNotImplementedError, PassOrderError
from passes.fsdp import apply_fsdp
from passes.mesh import Meshes, resolve_meshes
from passes.plan import Plan, plan
from passes.specs import PassSpec, pass_specs
from passes.swap import apply_swap, plan_auto_swap
from passes.tensor_parallel import apply_tensor_parallel, check_heads_divisible
from passes.traces import find_trace

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from graphswap.auto_swap import AutoSwap
    from graphswap.config import TrainerConfig
    from graphswap.rewrite import RewriteReport


@dataclass(frozen=True)
class InfrastructureResult:
    """The transformed model and what was done to it."""

    model: nn.Module
    plan: Plan
    report: RewriteReport | None
    """The swap rewrite's report (its ``manager`` runs the swap); ``None`` without swap."""
    applied: tuple[str, ...]
    mesh: DeviceMesh | None
    """The device mesh the distributed passes used; ``None`` when none ran."""
    auto_swap: AutoSwap | None = None
    """``activation_swap: auto``: the plan and the policies carrying it out."""


@dataclass
class _Run:
    model: nn.Module
    config: TrainerConfig
    meshes: Meshes
    report: RewriteReport | None = None
    auto_swap: AutoSwap | None = None


def _swap(run: _Run) -> None:
    config = run.config
    if config.activation_swap == "auto":
        run.auto_swap = plan_auto_swap(run.model, config)
    run.report = apply_swap(
        run.model,
        mode=config.activation_swap,
        prefetch_depth=config.swap_prefetch_depth,
        auto=run.auto_swap,
    )


def _tensor_parallel(run: _Run) -> None:
    assert run.meshes.tp is not None, "resolve_meshes builds a tp mesh when tp_size > 1"
    apply_tensor_parallel(run.model, run.meshes.tp)


def _fsdp(run: _Run) -> None:
    assert run.meshes.dp_shard is not None, "resolve_meshes builds a dp_shard mesh for fsdp"
    apply_fsdp(run.model, run.meshes.dp_shard)


_APPLY: dict[str, Callable[[_Run], None]] = {
    "swap": _swap,
    "tensor_parallel": _tensor_parallel,
    "activation_checkpointing": lambda run: apply_activation_checkpointing(run.model),
    "compile": lambda run: apply_compile(run.model),
    "fsdp": _fsdp,
}


def apply_model_infrastructure(
    model: nn.Module, config: TrainerConfig, *, mesh: DeviceMesh | None = None
) -> InfrastructureResult:
    """Apply the passes ``config`` asks for, in plan order, to ``model`` in place.

    ``mesh``: a device mesh with a ``"tp"`` and/or ``"dp_shard"`` dimension; by default
    one is built from the initialized process group when a distributed pass runs.
    """
    checked = plan(config).check()
    for spec in checked.passes:
        if not spec.implemented or spec.name not in _APPLY:
            raise PassNotImplementedError(
                f"{spec.setting_text(config)} asks for {spec.name}, which graphswap declares"
                f" and checks but cannot apply yet; set {spec.off_text()}"
            )
    if config.tp_size > 1:
        check_heads_divisible(getattr(model, "config", None), config.tp_size)
    meshes = resolve_meshes(checked, _device_type(model), mesh)
    run = _Run(model, config, meshes)
    applied: list[str] = []
    for spec in checked.passes:
        _refuse_traces(spec, model, config)
        _APPLY[spec.name](run)
        applied.append(spec.name)
    return InfrastructureResult(
        model, checked, run.report, tuple(applied), meshes.world, run.auto_swap
    )


def _device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return "cpu" if param is None else param.device.type


def _refuse_traces(spec: PassSpec, model: nn.Module, config: TrainerConfig) -> None:
    """Refuse a model on which a pass that must follow ``spec`` (or that ``spec``
    excludes) already ran outside the plan."""
    specs = pass_specs()
    for name, other in specs.items():
        if name in spec.must_run_before or spec.name in other.must_run_after:
            trace = find_trace(model, name)
            if trace is not None:
                raise PassOrderError(
                    f"{spec.name} ({spec.setting_text(config)}) must run before {name}, but"
                    f" {trace}; pass the model as built and let apply_model_infrastructure"
                    f" apply {name} ({other.setting}) after {spec.name}"
                )
        if name in spec.excludes or spec.name in other.excludes:
            trace = find_trace(model, name)
            if trace is not None:
                raise PassConflictError(
                    f"{spec.setting_text(config)} excludes {name}, but {trace}; pass the model"
                    f" without {name} or set {spec.off_text()}"
                )
