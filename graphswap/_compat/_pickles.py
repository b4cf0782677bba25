"""Reading what graphswap 0.1.0 (commit ``7c4d51b``) and 0.2.0 pickled: a swap-wrapped
model saved with ``torch.save`` or ``pickle.dump``. Its classes are at 0.1.0's module paths (the
finder serves them); what changed shape is converted here, on load."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from graphswap._compat._table import RENAMED_SWAP_OPTIONS
from graphswap._compat._warn import warn

Applied = TypeVar("Applied")


def manager_state(state: dict[str, Any]) -> dict[str, Any]:
    """A ``SwapManager``'s pickled state as this version writes it: 0.1.0's groups were
    ``"slots"`` and its options had ``trace``, the event log that tests read; 0.2.0's
    options were ``prefetch_depth`` and ``offload_lag``. Any other state is returned as
    is."""
    unpickled = ("graphswap", "torch", "pickle")
    old_options = [k for k in state["options"] if k in RENAMED_SWAP_OPTIONS]
    if "slots" in state:
        warn(
            "SwapManager(trace=) of graphswap 0.1.0 is gone, and with it the event log"
            " manager.events (manager.stats counts the offloads, reloads and prefetch hits);"
            " loading a SwapManager pickled by 0.1.0 is deprecated: save the loaded model"
            " again with torch.save or pickle.dump",
            inside=unpickled,
        )
        state = {**state, "groups": state["slots"]}
    elif old_options:
        renamed = ", ".join(f"{k} -> {RENAMED_SWAP_OPTIONS[k]}" for k in old_options)
        warn(
            f"loading a SwapManager pickled with its options' old names ({renamed}) is"
            " deprecated: save the loaded model again with torch.save or pickle.dump",
            inside=unpickled,
        )
    else:
        return state
    options = {
        RENAMED_SWAP_OPTIONS.get(k, k): v for k, v in state["options"].items() if k != "trace"
    }
    return {**state, "options": options}


class HierarchyValidator:
    """The validator of 0.1.0's ``qwen3_attn_swap`` and ``qwen3_moe_layer_swap``
    (``graphswap.rules._HierarchyValidator``), which the report of a model rewritten and
    pickled by 0.1.0 holds in its rules: the pickle finds it here, and
    :func:`rules_of_today` puts the rule registered under that name in its place."""

    rule_name: str
    class_name: str
    attr: str | None


def rules_of_today(
    applied: tuple[Applied, ...], get_rule: Callable[[str], Any]
) -> tuple[Applied, ...]:
    """A report's replacements (``RewriteReport._applied``), each made by a built-in rule
    of 0.1.0 given the rule registered under its name today: saved again, the report
    holds no class of 0.1.0's, and loads after 0.3."""
    return tuple(
        dataclasses.replace(record, rule=get_rule(record.rule.name))  # type: ignore[type-var, attr-defined]
        if isinstance(record.rule.validate, HierarchyValidator)  # type: ignore[attr-defined]
        else record
        for record in applied
    )
