"""``loss_head: chunked``: the chunked loss head (``graphswap.rewriting.loss_head``),
installed before the first pass and checked after.

Not a pass of the plan: it touches no module a pass rewrites (the decoder layers, their
attention), only the model's class and its ``lm_head``'s calls, so its place is fixed,
ahead of them all: FSDP2 and compile replace the root's class, which the install swaps.
A sharded head (tensor parallelism of the vocabulary, an ``lm_head`` fully_shard-ed on
its own) is refused where it is found; graphswap's own passes leave ``lm_head`` whole,
and FSDP2 on the root gathers it for the root's forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from graphswap.passes.errors import PassPostconditionError, PassSettingError
from graphswap.rewriting.loss_head import (
    chunk_loss_head,
    loss_head_chunk_size,
    unchunk_loss_head,
)

if TYPE_CHECKING:
    from graphswap.passes.settings import PassSettings


def apply_loss_head(model: nn.Module, config: PassSettings) -> int | None:
    """Install the head ``config.loss_head`` asks for; returns its tokens per chunk, or
    ``None`` for ``full`` (the model's own head, left as it is)."""
    if config.loss_head in ("full", "trl"):  # the model's own; TRL's, which SFTTrainer installs
        return None
    if config.loss_head != "chunked":
        raise PassSettingError(
            f"loss_head: {config.loss_head} names no loss head; set loss_head: full, chunked or trl"
        )
    chunk_loss_head(model, chunk_size=config.loss_head_chunk_size)
    installed = loss_head_chunk_size(model)
    if installed != config.loss_head_chunk_size:
        raise PassPostconditionError(
            f"after loss_head: chunked the model's head has {installed} tokens per chunk,"
            f" expected loss_head_chunk_size: {config.loss_head_chunk_size}"
        )
    return installed


def resize_loss_head(model: nn.Module, chunk_size: int | None) -> None:
    """The chunked head at ``chunk_size`` tokens a chunk, the size a ``budget`` plan chose
    (``None``: the plan has no chunked head); installed again, before any pass that
    replaces the model's class has run."""
    installed = loss_head_chunk_size(model)
    if chunk_size is None or installed is None or installed == chunk_size:
        return
    unchunk_loss_head(model)
    chunk_loss_head(model, chunk_size=chunk_size)
