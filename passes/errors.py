"""Typed errors of the pass plan; every message names the setting to change."""

from __future__ import annotations

from graphswap._compat import module_getattr
from graphswap.errors import GraphswapError


class PassPlanError(GraphswapError, ValueError):
    """A pass plan the trainer refuses to run (0.1.0's ``PlanError``: "plan" alone also
    named the planner's memory plan)."""


class PassOrderError(PassPlanError):
    """Two passes run in the wrong order (at plan time), or the model shows that an
    earlier transformation already happened (at apply time)."""


class PassConflictError(PassPlanError):
    """Two passes that exclude each other are both asked for."""


class PassSettingError(PassPlanError):
    """A plan and its config disagree: a pass the config does not enable, or a setting
    whose pass is missing from the plan (the origin's dropped setting, P1)."""


class PassRequirementError(PassPlanError):
    """A pass needs something the run does not have, such as a distributed world."""


class PassNotImplementedError(PassPlanError, NotImplementedError):
    """A declared pass that graphswap checks but cannot apply yet."""


class PassPostconditionError(GraphswapError, RuntimeError):
    """A pass ran but the model does not show its effect: never a silent no-op (I2)."""


__getattr__ = module_getattr(__name__)  # 0.1.0's PlanError, renamed, until 0.3
