"""Where the decoder layers of a Hugging Face causal LM live."""

from __future__ import annotations

from torch import nn

from passes.errors import PassRequirementError


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(fqn, layers)`` of the decoder layer list: ``model.layers`` of a
    ``*ForCausalLM`` or ``layers`` of a bare ``*Model``."""
    for fqn in ("model.layers", "layers"):
        try:
            layers = model.get_submodule(fqn)
        except AttributeError:
            continue
        if isinstance(layers, nn.ModuleList):
            return fqn, layers
    raise PassRequirementError(
        f"{type(model).__qualname__} has no decoder layer list at 'model.layers' or 'layers';"
        " the passes shard and wrap per decoder layer: pass the Hugging Face model itself"
    )
