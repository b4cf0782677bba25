"""graphswap: activation swap for transformer training.

Importing this package has no side effects: it does not touch CUDA, query the
platform, or import transformers model code. The application layer (``config``,
``models``, ``preflight``, ``train``, ``cli``) and the pass plan (``passes``) are
imported by name.
"""

from graphswap.rewriting.apply import (
    AlreadyTransformedError,
    NoMatchError,
    RewriteError,
    RewriteReport,
    rewrite,
    rewrite_report,
    unrewrite,
)
from graphswap.rewriting.rules import Rule, available_rules, get_rule, register_rule
from graphswap.runtime import (
    SwapExclusionError,
    SwapIntegrityError,
    SwapManager,
    SwapStats,
    swap_wrapper,
    unwrap_swap,
)
from graphswap.runtime.policy import (
    MIN_SWAP_TENSOR_BYTES,
    CheckpointPolicy,
    qwen3_attention_swap_policy,
)

__all__ = [
    "MIN_SWAP_TENSOR_BYTES",
    "AlreadyTransformedError",
    "CheckpointPolicy",
    "NoMatchError",
    "RewriteError",
    "RewriteReport",
    "Rule",
    "SwapExclusionError",
    "SwapIntegrityError",
    "SwapManager",
    "SwapStats",
    "available_rules",
    "get_rule",
    "qwen3_attention_swap_policy",
    "register_rule",
    "rewrite",
    "rewrite_report",
    "swap_wrapper",
    "unrewrite",
    "unwrap_swap",
]
