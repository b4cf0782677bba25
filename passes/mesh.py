"""The device mesh of the distributed passes: ``("dp_shard", "tp")`` as in torchtitan,
with only the dimensions the config turns on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphswap.passes.errors import PassRequirementError, PassSettingError
from graphswap.passes.pass_plan import PassPlan, pass_plan_of
from graphswap.passes.specs import DISTRIBUTED, PassSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from graphswap.passes.settings import PassSettings

TP = "tp"
DP_SHARD = "dp_shard"


@dataclass(frozen=True)
class Meshes:
    """The whole mesh and its named sub-meshes; ``None`` where no pass uses one."""

    world: DeviceMesh | None
    tp: DeviceMesh | None
    dp_shard: DeviceMesh | None


def build_mesh(
    config: PassSettings, *, device_type: str, pass_plan: PassPlan | None = None
) -> DeviceMesh | None:
    """The mesh the config's distributed passes need, from the initialized process
    group; ``None`` when the config enables no distributed pass. ``pass_plan``:
    ``config``'s pass plan when the caller built it already."""
    planned = pass_plan_of(config, pass_plan)
    return _build(planned, device_type) if _distributed_passes(planned) else None


def resolve_meshes(planned: PassPlan, device_type: str, mesh: DeviceMesh | None) -> Meshes:
    """Check ``mesh`` against the config, or build one from the initialized world."""
    config = planned.config
    if not _distributed_passes(planned):
        if mesh is not None:
            raise PassSettingError(
                "a device mesh was passed but the config enables no distributed pass"
                " (tp_size: 1, fsdp: false); drop mesh= or set tp_size or fsdp"
            )
        return Meshes(None, None, None)
    if mesh is None:
        mesh = _build(planned, device_type)
    else:
        _check_given(mesh, planned)
    return Meshes(
        world=mesh,
        tp=mesh[TP] if config.tp_size > 1 else None,
        dp_shard=mesh[DP_SHARD] if config.fsdp else None,
    )


def _distributed_passes(planned: PassPlan) -> list[PassSpec]:
    return [spec for spec in planned.passes if DISTRIBUTED in spec.requires]


def _build(planned: PassPlan, device_type: str) -> DeviceMesh:
    # torch.distributed loads only when a distributed pass runs.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    config = planned.config
    settings = ", ".join(spec.setting_text(config) for spec in _distributed_passes(planned))
    if not (dist.is_available() and dist.is_initialized()):
        raise PassRequirementError(
            f"{settings} needs a distributed world: launch with torchrun (or call"
            " torch.distributed.init_process_group) before apply_model_infrastructure, or"
            " turn the setting off"
        )
    world = dist.get_world_size()
    if world % config.tp_size:
        raise PassRequirementError(
            f"tp_size: {config.tp_size} does not divide the world size {world}; set tp_size to"
            f" a divisor of {world}"
        )
    replicas = world // config.tp_size
    if replicas > 1 and not config.fsdp:
        raise PassRequirementError(
            f"world size {world} with tp_size: {config.tp_size} leaves {replicas} data-parallel"
            f" replicas that no pass shards; set fsdp: true or tp_size: {world}"
        )
    dims = {DP_SHARD: replicas} if config.fsdp else {}
    if config.tp_size > 1:
        dims[TP] = config.tp_size
    return init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))


def _check_given(mesh: DeviceMesh, planned: PassPlan) -> None:
    config = planned.config
    names = mesh.mesh_dim_names or ()
    wanted = {DP_SHARD: None} if config.fsdp else {}
    if config.tp_size > 1:
        wanted[TP] = config.tp_size
    for name, size in wanted.items():
        if name not in names:
            raise PassRequirementError(
                f"the device mesh has dimensions {names}, but the config needs a {name!r}"
                f" dimension; name it {name!r} in init_device_mesh(mesh_dim_names=...)"
            )
        if size is not None and mesh[name].size() != size:
            raise PassRequirementError(
                f"tp_size: {size} but the mesh's {name!r} dimension has size"
                f" {mesh[name].size()}; make them equal"
            )
