"""The typed errors graphswap raises, at the bottom of the core so that every module
raises the same type for the same fact, and users import them from one place."""

from __future__ import annotations


class GraphswapError(Exception):
    """Base of every error graphswap defines: ``except GraphswapError`` catches what
    graphswap refuses, and not a bug elsewhere. Each error also keeps the built-in type
    it had (``ValueError`` for a bad input, ``RuntimeError`` for a failure at run time),
    so code that caught that still does."""


class RewriteError(GraphswapError, ValueError):
    """Base of every error a rewrite raises; the model is unchanged when it is raised."""


class NoMatchError(RewriteError):
    """A rule matched no module (``strict=True``)."""


class HierarchyError(RewriteError):
    """The model does not have the module layout a rule or a pass requires."""


class AlreadyTransformedError(RewriteError):
    """The model was already rewritten, sharded, compiled or checkpoint-wrapped, so a
    transform that must come first cannot run on it any more."""


class RuleConflictError(RewriteError):
    """Two matches claim the same module, or one lies inside the other."""


class UnknownRuleError(RewriteError, KeyError):
    """No rule is registered under the requested name."""

    def __str__(self) -> str:
        # KeyError would print the repr of the message, quotes included.
        return str(self.args[0])


class SwapExclusionError(GraphswapError, RuntimeError):
    """A swap-wrapped module ran under a transform that activation swap excludes."""


class SwapIntegrityError(GraphswapError, RuntimeError):
    """A tensor saved for backward changed after it was saved: its gradient would be wrong."""
