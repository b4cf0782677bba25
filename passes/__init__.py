"""The pass plan and the model-infrastructure passes of graphswap.

``plan(config)`` lists the passes a config asks for, ``Plan.check()`` refuses illegal
orders and combinations as data, and ``apply_model_infrastructure`` runs the checked
plan on a model, verifying each pass's effect.
"""

from passes.errors import (
    PassConflictError,
    PassNotImplementedError,
    PassOrderError,
    PassPostconditionError,
    PassRequirementError,
    PassSettingError,
    PlanError,
)
from passes.infrastructure import InfrastructureResult, apply_model_infrastructure
from passes.mesh import build_mesh
from passes.plan import Plan, plan
from passes.settings import PassSettings
from passes.specs import (
    CANONICAL_ORDER,
    SWAP_RULE,
    SWAP_RULES,
    PassSpec,
    get_spec,
    pass_specs,
)

__all__ = [
    "CANONICAL_ORDER",
    "SWAP_RULE",
    "SWAP_RULES",
    "InfrastructureResult",
    "PassConflictError",
    "PassNotImplementedError",
    "PassOrderError",
    "PassPostconditionError",
    "PassRequirementError",
    "PassSettingError",
    "PassSettings",
    "PassSpec",
    "Plan",
    "PlanError",
    "apply_model_infrastructure",
    "build_mesh",
    "get_spec",
    "pass_specs",
    "plan",
]
