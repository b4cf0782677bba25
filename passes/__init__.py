"""The pass plan and the model-infrastructure passes of graphswap: ``graphswap.passes``.

``plan(config)`` lists the passes a config asks for, ``Plan.check()`` refuses illegal
orders and combinations as data, and ``apply_model_infrastructure`` runs the checked
plan on a model, verifying each pass's effect.

The folder is the repository's top-level ``passes/`` (a layer of its own);
``graphswap/passes`` links to it, so it installs under graphswap and nowhere else.
"""

from graphswap.passes.errors import (
    PassConflictError,
    PassNotImplementedError,
    PassOrderError,
    PassPostconditionError,
    PassRequirementError,
    PassSettingError,
    PlanError,
)
from graphswap.passes.infrastructure import InfrastructureResult, apply_model_infrastructure
from graphswap.passes.mesh import build_mesh
from graphswap.passes.plan import Plan, plan
from graphswap.passes.settings import PassSettings
from graphswap.passes.specs import (
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

if __name__ == "passes":  # 0.1.0's top-level name, found in a source checkout: until 0.3
    from graphswap._deprecated import moved_package

    moved_package(__name__)
