"""The swap pass: rewrite every decoder layer's attention into a swap-wrapped module
linked layer to layer, through the ``qwen3_attn_swap`` rule."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from passes.errors import PassOrderError, PassPostconditionError
from passes.layout import decoder_layers
from passes.specs import SWAP_RULE

if TYPE_CHECKING:
    from graphswap.rewrite import RewriteReport


def apply_swap(model: nn.Module, *, prefetch_depth: int = 1) -> RewriteReport:
    """Wrap the attentions in place; the returned report owns the ``SwapManager``."""
    from graphswap.rewrite import AlreadyTransformedError, rewrite
    from graphswap.runtime import SwapManager

    try:
        report = rewrite(model, [SWAP_RULE], manager=SwapManager(prefetch_depth=prefetch_depth))
    except AlreadyTransformedError as error:
        raise PassOrderError(
            f"the swap pass (activation_swap: attention) needs the model as built: {error}"
        ) from error
    verify_swap(model, report, prefetch_depth=prefetch_depth)
    return report


def verify_swap(model: nn.Module, report: RewriteReport, *, prefetch_depth: int) -> None:
    """Every layer's attention is wrapped by the report's manager, and the L layers
    form one prefetch chain of L - 1 links."""
    from graphswap.runtime import is_swap_wrapped, swap_manager_of

    fqn, layers = decoder_layers(model)
    manager = report.manager
    for index, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not is_swap_wrapped(attn) or swap_manager_of(attn) is not manager:
            raise PassPostconditionError(
                f"after the swap pass {fqn}.{index}.self_attn is not swap-wrapped by the"
                f" rewrite's manager ({report}); activation_swap: attention would do nothing"
                " for this layer"
            )
    if len(manager.links) != len(layers) - 1:
        raise PassPostconditionError(
            f"after the swap pass the prefetch chain has {len(manager.links)} links for"
            f" {len(layers)} layers; expected {len(layers) - 1}"
        )
    if manager.prefetch_depth != prefetch_depth:
        raise PassPostconditionError(
            f"the swap manager prefetches {manager.prefetch_depth} layers ahead, but"
            f" swap_prefetch_depth: {prefetch_depth}"
        )
