"""graphswap: activation swap for transformer training.

Saved activations move to host memory after forward and come back one layer ahead of
the backward. By hand, one :class:`SwapManager` per model, :func:`swap_wrapper` per
module and :meth:`SwapManager.link` per pair of consecutive modules; by rule,
:func:`rewrite` does the same with checks, a report and an undo. The errors are in
:mod:`graphswap.errors`; the trainer and the ``graphswap`` command in
:mod:`graphswap.train`.

Importing this package has no side effects: it does not touch CUDA, query the
platform, or import transformers model code.
"""

import warnings
from typing import Any

from graphswap.rewriting.apply import RewriteReport, rewrite, rewrite_report, unrewrite
from graphswap.rewriting.rules import Rule, available_rules, register_rule
from graphswap.runtime import SwapManager, SwapStats, swap_wrapper, unwrap_swap
from graphswap.runtime.policy import CheckpointPolicy, swap_large_activations

__all__ = [
    "CheckpointPolicy",
    "RewriteReport",
    "Rule",
    "SwapManager",
    "SwapStats",
    "available_rules",
    "register_rule",
    "rewrite",
    "rewrite_report",
    "swap_wrapper",
    "unrewrite",
    "unwrap_swap",
]


def __getattr__(name: str) -> Any:
    """The origin's name of the default policy, kept for code written against it."""
    if name == "qwen3_attention_swap_policy":
        warnings.warn(
            "graphswap.qwen3_attention_swap_policy is the default policy under the origin's"
            " name: leave policy= out of swap_wrapper, or pass"
            " graphswap.runtime.policy.swap_large_activations",
            DeprecationWarning,
            stacklevel=2,
        )
        return swap_large_activations
    raise AttributeError(f"module 'graphswap' has no attribute {name!r}")
