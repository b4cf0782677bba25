"""Compile: ``torch.compile`` each decoder layer separately, as torchtitan does; the
layers repeat, so one compiled graph serves them all and compile time stays flat in
depth."""

from __future__ import annotations

from torch import nn

from passes.errors import PassPostconditionError
from passes.layout import decoder_layers


def apply_compile(model: nn.Module, *, backend: str = "inductor") -> None:
    import torch

    _, layers = decoder_layers(model)
    for name, layer in list(layers.named_children()):
        layers.register_module(name, torch.compile(layer, backend=backend))
    verify_compile(model)


def verify_compile(model: nn.Module) -> None:
    from torch._dynamo.eval_frame import OptimizedModule

    fqn, layers = decoder_layers(model)
    for name, layer in layers.named_children():
        if not isinstance(layer, OptimizedModule):
            raise PassPostconditionError(
                f"after compile {fqn}.{name} is {type(layer).__qualname__}, not compiled"
            )
