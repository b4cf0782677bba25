"""The words ``graphswap train`` and ``plan-memory`` print about an ``auto`` plan, for
code that plans from Python (``PlanExecutor``, ``plan_memory(activation_swap="auto")``) and
wants the same report: each takes the plan's ``to_dict()``."""

from graphswap.train.cli._memory import auto_verdict, format_auto_report

__all__ = ["auto_verdict", "format_auto_report"]
