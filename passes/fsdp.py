"""FSDP2: ``fully_shard`` each decoder layer, then the root, so that one layer's
parameters are gathered at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from graphswap.hf.checkpoints import decoder_layers
from graphswap.passes.errors import PassPostconditionError
from graphswap.passes.postconditions import layers_without
from graphswap.rewriting.transforms import Transform, shown_by

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    from torch.distributed.fsdp import fully_shard  # loads only when the pass runs

    _, layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    verify_fsdp(model)


def verify_fsdp(model: nn.Module) -> None:
    unsharded = [fqn for fqn, _ in layers_without(model, Transform.FSDP)]
    if Transform.FSDP not in shown_by(model):
        unsharded.append("<root>")
    if unsharded:
        raise PassPostconditionError(
            f"after fsdp these modules are not fully_shard-ed: {', '.join(unsharded)}"
        )
