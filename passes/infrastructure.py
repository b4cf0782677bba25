"""``apply_model_infrastructure``: run the checked pass plan on a model, pass by pass.

Everything that can be refused is refused before the first pass changes the model:
the pass plan's order and exclusions, passes that are declared but not implemented, the
distributed world, the head counts, and traces on the model of passes that must come
later (P2: a model sharded before the swap). After each pass its effect is verified
(I2: never a silent no-op).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from graphswap._compat import Renamed
from graphswap.errors import AlreadyTransformedError
from graphswap.passes.activation_checkpointing import apply_activation_checkpointing
from graphswap.passes.compile import apply_compile
from graphswap.passes.fsdp import apply_fsdp
from graphswap.passes.loss_head import apply_loss_head, resize_loss_head
from graphswap.passes.mesh import Meshes, resolve_meshes
from graphswap.passes.pass_plan import PassPlan, pass_plan_of
from graphswap.passes.specs import pass_specs
from graphswap.passes.swap import apply_swap, plan_swap, swap_engine
from graphswap.passes.tensor_parallel import apply_tensor_parallel, check_heads_divisible
from graphswap.planning._registry import memory_strategy
from graphswap.rewriting.loss_head import loss_head_chunk_size
from graphswap.rewriting.transforms import find_transforms

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from graphswap.passes.plan_executor import PlanExecutor
    from graphswap.passes.settings import PassSettings
    from graphswap.rewriting.apply import RewriteReport


@dataclass(frozen=True)
class InfrastructureResult:
    """The transformed model and what was done to it."""

    model: nn.Module
    pass_plan: PassPlan
    """The checked pass plan that ran (0.1.0's ``plan``)."""
    report: RewriteReport | None
    """The swap rewrite's report (its ``manager`` runs the swap); ``None`` without swap."""
    applied: tuple[str, ...]
    mesh: DeviceMesh | None
    """The device mesh the distributed passes used; ``None`` when none ran."""
    plan_executor: PlanExecutor | None = None
    """``activation_swap: auto`` or ``budget``: the plan and the policies carrying it out."""
    loss_head_chunk_size: int | None = None
    """``loss_head: chunked``: the tokens per chunk of the head installed before the first
    pass; ``None``: the model computes its own loss."""

    plan = Renamed("pass_plan")  # 0.1.0's name: "plan" alone also named the memory plan
    auto_swap = Renamed("plan_executor")  # 0.2.0's name, after one of the two modes


@dataclass
class _Run:
    model: nn.Module
    config: PassSettings
    meshes: Meshes
    report: RewriteReport | None = None
    executor: PlanExecutor | None = None


def _swap(run: _Run) -> None:
    config = run.config
    if memory_strategy(config.activation_swap).executes_plan:
        shards = run.meshes.dp_shard
        run.executor = plan_swap(
            run.model, config, state_shards=1 if shards is None else shards.size()
        )
        resize_loss_head(run.model, run.executor.plan.loss_head_chunk_size)
    run.report = apply_swap(
        run.model,
        activation_swap=config.activation_swap,
        swap_prefetch_depth=config.swap_prefetch_depth,
        swap_offload_lag=config.swap_offload_lag,
        engine=swap_engine(config.device),
        executor=run.executor,
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
    model: nn.Module,
    config: PassSettings,
    *,
    mesh: DeviceMesh | None = None,
    pass_plan: PassPlan | None = None,
) -> InfrastructureResult:
    """Apply the passes ``config`` asks for, in pass plan order, to ``model`` in place.

    ``loss_head: chunked`` installs the chunked loss head first, before every pass:
    it swaps the model's class, which FSDP2 and compile would have replaced, and it
    changes no module a pass rewrites.

    ``mesh``: a device mesh with a ``"tp"`` and/or ``"dp_shard"`` dimension; by default
    one is built from the initialized process group when a distributed pass runs.
    ``pass_plan``: ``config``'s pass plan when the caller built it already (``graphswap train``
    builds one per run, for its checks, the mesh and this); checked again here.
    """
    checked = pass_plan_of(config, pass_plan).check_runnable()
    if config.tp_size > 1:
        check_heads_divisible(getattr(model, "config", None), config.tp_size)
    _refuse_traces(checked, model, config)
    meshes = resolve_meshes(checked, _device_type(model), mesh)
    chunk_size = apply_loss_head(model, config)
    run = _Run(model, config, meshes)
    applied: list[str] = []
    for spec in checked.passes:
        _APPLY[spec.name](run)
        applied.append(spec.name)
    if chunk_size is not None:
        chunk_size = loss_head_chunk_size(model)  # the budget's choice, when it made one
    return InfrastructureResult(
        model, checked, run.report, tuple(applied), meshes.world, run.executor, chunk_size
    )


def _device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return "cpu" if param is None else param.device.type


def _refuse_traces(checked: PassPlan, model: nn.Module, config: PassSettings) -> None:
    """Refuse a model on which a pass that must follow one of the plan's passes (or that
    one of them excludes) already ran outside the plan. The check runs before the first
    pass: whatever it finds was there from the start, so nothing is half-applied."""
    traces = find_transforms(model)
    specs = pass_specs()
    for spec in checked.passes:
        for name, other in specs.items():
            trace = next((t for t in traces if t.kind is other.leaves), None)
            if trace is None:
                continue
            if name in spec.must_run_before or spec.name in other.must_run_after:
                raise AlreadyTransformedError(
                    f"{spec.name} ({spec.setting_text(config)}) must run before {name}, but"
                    f" {trace}; pass the model as built and let apply_model_infrastructure"
                    f" apply {name} ({other.setting}) after {spec.name}"
                )
            if name in spec.excludes or spec.name in other.excludes:
                raise AlreadyTransformedError(
                    f"{spec.setting_text(config)} excludes {name}, but {trace}; pass the model"
                    f" without {name} or set {spec.off_text()}"
                )
