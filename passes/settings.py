"""What the passes read from a run's settings, as a protocol.

The trainer's ``TrainerConfig`` (the application layer) satisfies it; the passes never
import it, so anyone composing their own infrastructure can hand them any object
with these attributes.
"""

from __future__ import annotations

from typing import Protocol


class PassSettings(Protocol):
    """The settings that turn passes on (each ``PassSpec.setting``) and configure them."""

    activation_swap: str
    loss_head: str
    loss_head_chunk_size: int
    swap_prefetch_depth: int
    swap_offload_lag: int | None
    activation_memory_budget: int | float | str | None
    device: str
    swap_bandwidth_gbps: float | str
    swap_tflops: float
    swap_hide_margin: float
    seq_len: int
    batch_size: int
    tp_size: int
    cp_size: int
    ep_size: int
    pp_size: int
    activation_checkpointing: bool
    compile: bool
    fsdp: bool
    pass_order: tuple[str, ...] | None
