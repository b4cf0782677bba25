"""The five memory strategies by the name a config holds (``activation_swap``): the one
place a name becomes a strategy, at the edges (the config, the CLI, ``plan_memory``, the
swap pass); past it, the planner asks the strategy."""

from __future__ import annotations

from graphswap.planning._budget import BudgetStrategy
from graphswap.planning._strategy import STEP_STRATEGIES, MemoryStrategy, from_name_refusal

STRATEGIES: dict[str, MemoryStrategy] = {**STEP_STRATEGIES, "budget": BudgetStrategy()}
"""Every strategy, by its ``activation_swap`` name, in :data:`SWAP_MODES` order."""


def memory_strategy(name: object) -> MemoryStrategy:
    """The strategy ``activation_swap: name`` selects; a name that selects none is
    refused with :class:`PlanSettingError`, listing those that do."""
    strategy = STRATEGIES.get(name) if isinstance(name, str) else None
    if strategy is None:
        from_name_refusal(name)
    return strategy
