"""FSDP2: ``fully_shard`` each decoder layer, then the root, so that one layer's
parameters are gathered at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from passes.errors import PassPostconditionError
from passes.layout import decoder_layers

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    from torch.distributed.fsdp import fully_shard

    _, layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    verify_fsdp(model)


def verify_fsdp(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    fqn, layers = decoder_layers(model)
    unsharded = [
        f"{fqn}.{name}"
        for name, layer in layers.named_children()
        if not isinstance(layer, FSDPModule)
    ]
    if not isinstance(model, FSDPModule):
        unsharded.append("<root>")
    if unsharded:
        raise PassPostconditionError(
            f"after fsdp these modules are not fully_shard-ed: {', '.join(unsharded)}"
        )
