"""graphswap: activation swap for transformer training.

Saved activations move to host memory after forward and come back one layer ahead of
the backward. By hand, one :class:`SwapManager` per model, :func:`swap_wrapper` per
module and :meth:`SwapManager.link` per pair of consecutive modules; by rule,
:func:`rewrite` does the same with checks, a report and an undo. Every error graphswap
raises derives from :class:`GraphswapError`; the errors are in :mod:`graphswap.errors`,
the trainer and the ``graphswap`` command in :mod:`graphswap.train`.

Importing this package has no side effects: it does not touch CUDA, query the
platform, or import transformers model code. The names and module paths of 0.1.0
that moved still work until 0.3, with a ``DeprecationWarning`` naming the new one
(:mod:`graphswap._compat`, whose finder on ``sys.meta_path`` answers for those paths
only).
"""

import sys

from graphswap import _compat
from graphswap.errors import GraphswapError
from graphswap.rewriting.apply import RewriteReport, rewrite, rewrite_report, unrewrite
from graphswap.rewriting.rules import Rule, available_rules, register_rule
from graphswap.runtime import SwapManager, SwapStats, swap_wrapper, unwrap_swap
from graphswap.runtime.policy import CheckpointPolicy

__all__ = [
    "CheckpointPolicy",
    "GraphswapError",
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


__getattr__ = _compat.module_getattr(__name__)
sys.modules[__name__].__class__ = _compat.Package
_compat.install()
