"""What the budget mode may recompute in a decoder layer, by kind, found by structure.

Recompute runs a whole submodule again in backward (:mod:`graphswap.runtime._recompute`),
so a unit is a submodule, and a good one saves many bytes for little compute:

- ``norms``: every normalization module of the layer (RMSNorm, LayerNorm, the q/k norms
  inside attention, a gated norm): memory-bound elementwise work whose fp32 upcasts and
  products are among the largest saves of a layer and recompute in a fraction of a
  millisecond;
- ``mlp_memory_bound``: what lies between the feed-forward block's matmuls (the
  activation and its product, the experts' gathers, the router's softmax): about half
  of the block's bytes at a few percent of its time; the matmul outputs are saved like
  any tensor, for the swap to keep or move;
- ``mlp_down``: with ``mlp_memory_bound``, also the block's matmuls back to the
  hidden width (its down projections): their outputs are not saved, and run again
  where a later operator saved them (a mixture of experts' routing-weight product
  does: the widest save the block keeps otherwise), at the price of those matmuls,
  about a third of the block's; a dense block's down projection feeds the residual
  add only, so this drops a save the level before kept for nothing;
- ``mlp``: the layer's feed-forward block (a dense MLP, or a mixture of experts with its
  router): most of what a layer saves besides attention, at the price of its matmuls;
- ``layer``: the whole decoder layer, as the trainers' activation checkpointing runs
  it: only its inputs are saved (and swapped), every operator runs again, attention's
  included. The last resort, where the budget is met by nothing cheaper.

Attention is never recomputed: its saves are its output and log-sum-exp, the most
expensive bytes to make again, which swap moves instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

from torch import nn

RecomputeKind = Literal["norms", "mlp_memory_bound", "mlp_down", "mlp", "layer"]
"""A kind of submodule the budget mode may recompute."""
RECOMPUTE_KINDS: tuple[RecomputeKind, ...] = get_args(RecomputeKind)

RECOMPUTE_LEVELS: tuple[tuple[RecomputeKind, ...], ...] = (
    (),
    ("norms",),
    ("norms", "mlp_memory_bound"),
    ("norms", "mlp_memory_bound", "mlp_down"),
    ("norms", "mlp"),
    ("layer",),
)
"""What the budget mode recomputes in each layer, cheapest first: nothing, the norms,
the norms and the feed-forward block's memory-bound work, that and the block's down
projections, the norms and the whole feed-forward block, the whole layer."""

_MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")
"""What the families call a layer's feed-forward block."""


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and not any(True for _ in module.children())


def recompute_units(layer: nn.Module, kinds: Sequence[RecomputeKind]) -> tuple[str, ...]:
    """The paths (in ``layer``) of the submodules of ``kinds``, in module order; a norm
    inside a recomputed feed-forward block is recomputed with it, not on its own; the
    layer itself is ``""``."""
    if "layer" in kinds:
        return ("",)
    units: list[str] = []
    if "mlp" in kinds or "mlp_memory_bound" in kinds:
        units.extend(n for n, _ in layer.named_children() if n in _MLP_NAMES)
    if "norms" in kinds:
        units.extend(
            name
            for name, module in layer.named_modules()
            if name and _is_norm(module) and not any(name.startswith(f"{u}.") for u in units)
        )
    order = {name: i for i, (name, _) in enumerate(layer.named_modules())}
    return tuple(sorted(units, key=order.__getitem__))


def saves_matmuls(kinds: Sequence[str], unit: str) -> bool:
    """The unit at path ``unit`` recomputes only what lies between its matmuls
    (``recompute_wrapper(save_matmuls=True)``)."""
    return "mlp_memory_bound" in kinds and "mlp" not in kinds and unit in _MLP_NAMES


def reruns_down_projections(kinds: Sequence[str], unit: str) -> bool:
    """The unit at path ``unit`` saves its matmul outputs but its down projections'
    (``recompute_wrapper(save_matmuls=True, rerun_to_input_width=True)``)."""
    return saves_matmuls(kinds, unit) and "mlp_down" in kinds
