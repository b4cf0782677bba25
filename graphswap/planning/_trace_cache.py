"""The steps the planner traced last, by what makes a trace.

A trace depends on the model's config, the step's shape, the recompute level, whether
the embeddings' output requires grad (a trainer's checkpointing), the device profile,
the swap policy and whether the step ends with AdamW; not on the swap mode, the
schedule (offload lag, prefetch depth, hide margin, host budget) nor the budget, which
only its replays read. Plans that differ there alone (each mode of one step; a sweep of
budgets or hide margins; the swap pass planning again the budget ``plan-memory`` chose)
replay the step traced before instead of tracing it again: on CPU a trace costs 0.1-2 s,
a replay milliseconds. A trace is frozen data, so one is shared safely.

The policy is told apart by identity: it is asked once per save and must answer from
the tensor alone, as the runtime's pack hook assumes too.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from graphswap.planning._trace import StepTrace, trace_step

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from graphswap.planning._settings import StepShape
    from graphswap.planning._units import RecomputeKind
    from graphswap.planning.saved_tensors import MetaModel
    from graphswap.runtime.policy import SwapPolicy
    from graphswap.runtime.profile import DeviceProfile

CAPACITY = 8
"""Traces kept: a budget plan traces one step per recompute level (six), so a plan made
again finds all of its own. A 48-layer Qwen3-30B-A3B trace holds about 7 MB."""

_traces: collections.OrderedDict[Hashable, StepTrace] = collections.OrderedDict()
"""The traces kept, least recently used first."""
_lock = threading.Lock()


def config_key(config: PretrainedConfig) -> tuple[str, tuple[tuple[str, str], ...]]:
    """What of a built model's ``config`` a trace reads: every value it saves, and the
    private settings it does not (the attention and experts implementations, as
    transformers resolved them when it built the model)."""
    hidden = tuple(
        sorted((name, repr(value)) for name, value in vars(config).items() if name[:1] == "_")
    )
    return config.to_json_string(use_diff=False), hidden


def trace_once(
    meta: MetaModel,
    shape: StepShape,
    recompute: Sequence[RecomputeKind],
    profile: DeviceProfile,
    policy: SwapPolicy,
    *,
    optimizer: bool = True,
) -> StepTrace:
    """``trace_step`` of ``meta``, built at ``shape`` with ``recompute``, or the same step
    traced before. A trace that raises is not kept: the same settings raise again."""
    key = (
        config_key(meta.rank_config),
        shape,
        tuple(recompute),
        meta.inputs_require_grad,
        profile,
        policy,
        optimizer,
    )
    with _lock:
        found = _traces.get(key)
        if found is not None:
            _traces.move_to_end(key)
            return found
    made = trace_step(meta, profile, policy, optimizer=optimizer)
    with _lock:
        _traces[key] = made
        _traces.move_to_end(key)
        while len(_traces) > CAPACITY:
            _traces.popitem(last=False)
    return made
