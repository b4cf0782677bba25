"""A Hugging Face decoder layer's cache as its forward found it, for the recompute.

A layer recomputed whole in backward runs its forward twice. Where the stack passes a
cache (``use_cache`` defaults to true in eval mode, and a hybrid stack keeps it in
train mode too), the forward appends its keys and values to the cache, or moves a
linear attention's states on: run again on that cache, the recompute would see twice
the keys (a shape error) or take the decoding path (another save, a ``CheckpointError``).
:func:`cache_as_before` keeps a detached copy of the layer's own entries of the cache as
the forward found them, and gives the recompute a cache whose entries are that copy;
the cache the caller holds is written once, by the forward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from graphswap.errors import SwapSetupError

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "cache_params")
"""The keyword a decoder layer takes its cache by, across transformers versions."""


def cache_as_before(
    layer: nn.Module, kwargs: dict[str, Any]
) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
    """Called before ``layer``'s forward with its keyword arguments: ``None`` without a
    cache, else what puts a cache holding the entries as they are now in the recompute's
    keyword arguments (``swap_wrapper(recompute_kwargs=cache_as_before)``).

    Only the layer's own entries (those of the ``layer_idx`` its submodules carry) are
    copied: at the first forward of a step they are empty, so the copy costs nothing.
    """
    name = next((key for key in _CACHE_KWARGS if kwargs.get(key) is not None), None)
    if name is None:
        return None
    cache = kwargs[name]
    entries = getattr(cache, "layers", None)
    indices = {
        m.layer_idx for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)
    }
    if not isinstance(entries, list) or not indices:
        raise SwapSetupError(
            f"{type(layer).__name__} is recomputed whole in backward and writes a"
            f" {type(cache).__name__} in forward, which graphswap cannot restore for the"
            " recompute (it restores the entries of a transformers Cache's layers by the"
            " layer's layer_idx): pass use_cache=False"
        )
    found = {i: _detached(entries[i]) for i in sorted(indices) if i < len(entries)}
    length = len(entries)

    def restore(recompute_kwargs: dict[str, Any]) -> dict[str, Any]:
        fork = copy.copy(cache)
        fork.layers = list(cache.layers[:length])
        for i in indices:
            if i < length:
                fork.layers[i] = _detached(found[i])
        return {**recompute_kwargs, name: fork}

    return restore


def _detached(entry: Any) -> Any:
    """A copy of a cache entry whose tensors are detached clones: the recompute may
    write the copy in place (a linear attention's states) and reads only its values."""
    copied = copy.copy(entry)
    copied.__dict__.update({key: _values(value) for key, value in vars(entry).items()})
    return copied


def _values(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _values(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_values(item) for item in value]
    return value
