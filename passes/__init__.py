"""The pass plan and the model-infrastructure passes of graphswap: ``graphswap.passes``.

``pass_plan(config)`` lists the passes a config asks for, ``PassPlan.check()`` refuses
illegal orders and combinations as data, and ``apply_model_infrastructure`` runs the
checked pass plan on a model, verifying each pass's effect. (The planner's answer, what
to keep, swap and recompute per layer, is the memory plan: ``graphswap.planning``.)

The folder is the repository's top-level ``passes/`` (a layer of its own);
``graphswap/passes`` links to it, so it installs under graphswap and nowhere else.
"""

from graphswap._compat import module_getattr
from graphswap.passes.errors import (
    PassConflictError,
    PassNotImplementedError,
    PassOrderError,
    PassPlanError,
    PassPostconditionError,
    PassRequirementError,
    PassSettingError,
)
from graphswap.passes.infrastructure import InfrastructureResult, apply_model_infrastructure
from graphswap.passes.mesh import build_mesh
from graphswap.passes.pass_plan import PassPlan, pass_plan
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
    "PassPlan",
    "PassPlanError",
    "PassPostconditionError",
    "PassRequirementError",
    "PassSettingError",
    "PassSettings",
    "PassSpec",
    "apply_model_infrastructure",
    "build_mesh",
    "get_spec",
    "pass_plan",
    "pass_specs",
]

__getattr__ = module_getattr(__name__)  # 0.1.0's Plan and plan, renamed, until 0.3

if __name__ == "passes":  # 0.1.0's top-level name, found in a source checkout: until 0.3
    from graphswap._compat import moved_package

    moved_package(__name__)
