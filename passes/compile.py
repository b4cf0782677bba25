"""Compile: ``torch.compile`` each decoder layer separately, as torchtitan does; the
layers repeat, so one compiled graph serves them all and compile time stays flat in
depth."""

from __future__ import annotations

import torch
from torch import nn

from graphswap.hf.checkpoints import decoder_layers
from graphswap.passes.postconditions import require_every_layer
from graphswap.rewriting.transforms import Transform


def apply_compile(model: nn.Module, *, backend: str = "inductor") -> None:
    _, layers = decoder_layers(model)
    for name, layer in list(layers.named_children()):
        layers.register_module(name, torch.compile(layer, backend=backend))
    verify_compile(model)


def verify_compile(model: nn.Module) -> None:
    require_every_layer(model, Transform.COMPILE, "compile", "compiled")
