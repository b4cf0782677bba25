"""The typed errors graphswap raises, and the class of its deprecation warnings, at the
bottom of the core so that every module raises the same type for the same fact, and users
import them from one place."""

from __future__ import annotations


class GraphswapError(Exception):
    """Base of every error graphswap defines: ``except GraphswapError`` catches what
    graphswap refuses, and not a bug elsewhere. Each error also keeps the built-in type
    it had (``ValueError`` for a bad input, ``RuntimeError`` for a failure at run time),
    so code that caught that still does."""


class GraphswapTypeError(GraphswapError, TypeError):
    """An argument, or a callback's answer, of a type graphswap cannot use (a module that
    is not an ``nn.Module``, a policy that is not callable or answers something other
    than a ``CheckpointPolicy``, rules that are neither names nor ``Rule`` objects); the
    message names it, what it got and what it takes."""


class RewriteError(GraphswapError, ValueError):
    """Base of every error a rewrite raises, and of a rule that cannot be defined or
    registered; the model is unchanged when it is raised."""


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


class SwapSetupError(GraphswapError, ValueError):
    """The swap runtime was set up in a way that cannot work: a setting out of range
    (``swap_prefetch_depth``, ``swap_offload_lag``, ``max_host_bytes``, a policy's ``min_bytes``, a
    simulated device's ``lag``), a module wrapped or registered twice or not wrapped, a
    prefetch link that repeats or closes a cycle. Raised when the call is made, before
    anything runs; the message names the argument and the fix."""


class SwapStateError(GraphswapError, RuntimeError):
    """The swap runtime was asked, while it runs, for what its state cannot give: a
    clock started while one is running, or a recompute region's backward that finds no
    matmul output its forward saved (it ran other matmuls, or backward ran twice)."""


class SwapExclusionError(GraphswapError, RuntimeError):
    """A swap-wrapped module ran under a transform that activation swap excludes."""


class SwapIntegrityError(GraphswapError, RuntimeError):
    """A tensor saved for backward, swapped, kept or saved by a recompute region, changed
    after it was saved: its gradient would be wrong."""


class GraphswapDeprecationWarning(DeprecationWarning):
    """What graphswap warns when code uses a name, keyword or pickle of an earlier release
    that still works until its removal (0.1.0's until 0.3), naming what to use instead.
    Its own class, so that a test suite can turn graphswap's deprecations into errors
    without failing on other libraries' (pytest: ``filterwarnings =
    ["error::graphswap.errors.GraphswapDeprecationWarning"]``); a ``DeprecationWarning``,
    so that every filter of that class still applies to it."""


class LossHeadError(GraphswapError, ValueError):
    """The chunked loss head cannot be installed on, or run for, this model: no
    ``lm_head``, a forward that computes its loss otherwise than Hugging Face's
    ``ForCausalLMLoss``, logits changed in a way the head does not reproduce, a head
    sharded across ranks, a chunk size below 1, or a head installed twice. The message
    names the setting (``loss_head``, ``loss_head_chunk_size``) and the fix; a refused
    install leaves the model as it was."""
