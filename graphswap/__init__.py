"""graphswap: activation swap for transformer training.

Importing this package has no side effects: it does not touch CUDA, query the
platform, or import transformers model code.
"""

from graphswap.policy import MIN_SWAP_TENSOR_BYTES, CheckpointPolicy, qwen3_attention_swap_policy
from graphswap.runtime import (
    SwapIntegrityError,
    SwapManager,
    SwapStats,
    swap_wrapper,
    unwrap_swap,
)

__all__ = [
    "MIN_SWAP_TENSOR_BYTES",
    "CheckpointPolicy",
    "SwapIntegrityError",
    "SwapManager",
    "SwapStats",
    "qwen3_attention_swap_policy",
    "swap_wrapper",
    "unwrap_swap",
]
