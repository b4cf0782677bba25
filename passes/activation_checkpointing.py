"""Activation checkpointing: recompute each decoder layer in backward, with torch's own
``checkpoint_wrapper`` (non-reentrant), one wrapper per layer as in torchtitan.

The recomputation calls each layer twice per step; a Hugging Face KV cache would
append the keys twice, so the pass turns ``config.use_cache`` off, as HF's own
``gradient_checkpointing_enable`` does for training.
"""

from __future__ import annotations

from torch import nn

from graphswap.hf.checkpoints import decoder_layers
from graphswap.passes.postconditions import require_every_layer
from graphswap.rewriting.transforms import Transform


def apply_activation_checkpointing(model: nn.Module) -> None:
    # torch.distributed loads only when the pass runs.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    _, layers = decoder_layers(model)
    for name, layer in list(layers.named_children()):
        layers.register_module(name, checkpoint_wrapper(layer, preserve_rng_state=False))
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False
    verify_activation_checkpointing(model)


def verify_activation_checkpointing(model: nn.Module) -> None:
    require_every_layer(model, Transform.CHECKPOINT, "activation_checkpointing", "checkpointed")
