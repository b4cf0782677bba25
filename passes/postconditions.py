"""The check after a per-layer pass: every decoder layer shows the pass's effect
(never a silent no-op, I2)."""

from __future__ import annotations

from torch import nn

from graphswap.hf.checkpoints import decoder_layers
from graphswap.passes.errors import PassPostconditionError
from graphswap.rewriting.transforms import Transform, shown_by


def layers_without(model: nn.Module, kind: Transform) -> list[tuple[str, nn.Module]]:
    """``(fqn, layer)`` of every decoder layer that does not show ``kind``."""
    fqn, layers = decoder_layers(model)
    return [
        (f"{fqn}.{name}", layer)
        for name, layer in layers.named_children()
        if kind not in shown_by(layer)
    ]


def require_every_layer(model: nn.Module, kind: Transform, pass_name: str, effect: str) -> None:
    """Raise naming the first decoder layer that ``pass_name`` left without ``effect``."""
    missing = layers_without(model, kind)
    if missing:
        fqn, layer = missing[0]
        raise PassPostconditionError(
            f"after {pass_name} {fqn} is {type(layer).__qualname__}, not {effect}"
        )
