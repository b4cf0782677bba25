"""0.1.0's import paths work until 0.3, each with a ``DeprecationWarning`` that names
its new place: what code and scripts written against 0.1.0 do (issue 31, item 6).

``RELEASE`` is 0.1.0's public surface, read from the history: every module without a
``_`` in its path and its public names, at the end of the first day (7c4d51b, the
state ``AutoSwap.format_report`` and ``plan-memory --policy`` were released in) and
just before the folders moved by layer (ba58bf6^). ``graphswap.errors`` and
``graphswap.runtime.profile`` are still where they were; the names 0.2 removed with no
successor are in ``graphswap._compat._table.REMOVED`` or listed in the CHANGELOG.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

import graphswap
from graphswap import _compat
from graphswap._compat._table import MODULES, NAMES, REMOVED

pytestmark = pytest.mark.compat

ROOT = Path(__file__).resolve().parents[3]

RELEASE: dict[str, str] = {
    "graphswap": "AlreadyTransformedError CheckpointPolicy MIN_SWAP_TENSOR_BYTES NoMatchError"
    " RewriteError RewriteReport Rule SwapExclusionError SwapIntegrityError SwapManager"
    " SwapStats available_rules get_rule qwen3_attention_swap_policy register_rule rewrite"
    " rewrite_report swap_wrapper unrewrite unwrap_swap",
    "graphswap.attention_kernels": "ATTN_IMPLEMENTATIONS AttentionKernel DEVICES"
    " EAGER_ASSUMPTION FusedAttentionMode KERNELS PlanSettingError default_kernel"
    " resolve_attention_kernel",
    "graphswap.auto_swap": "AUTO_RULE AutoSwap AutoSwapMismatchError AutoSwapMismatchWarning"
    " AutoSwapPolicy CopyBandwidth Mismatch check_measurable measure_copy_bandwidth",
    "graphswap.cli": "build_parser main",
    "graphswap.config": "AUTO_ONLY_SETTINGS ActivationSwap AttnImplementation ConfigError"
    " DEFAULT_SWAP_HIDE_MARGIN DEVICES DType SWAP_ONLY_SETTINGS SwapBandwidth TrainerConfig"
    " check_finite_positive parse_names resolve_config",
    "graphswap.decoder": "DecoderClasses HEAD_NORMS HEAD_PROJECTIONS decoder_classes"
    " head_sharding_problem",
    "graphswap.graph": "GraphvizNotFoundError PrefetchGraphError RENDER_FORMATS"
    " build_prefetch_graph check_prefetch_graph graph_to_dict layer_index render"
    " require_graphviz to_dot to_json",
    "graphswap.hf": "CheckpointError build_model decoder_layers load_hf_config load_weights"
    " model_config weight_files",
    "graphswap.measure": "ResidentActivationTracker output_tensors",
    "graphswap.models": "BuiltModel build from_config from_pretrained trainer_hf_config",
    "graphswap.planner": "DEFAULT_HIDE_MARGIN DEFAULT_PROFILE DEFAULT_SEQ_STEP FitResult"
    " GroupReplay GroupWindow LayerPlan MemoryPlan ModeFit PlanSettingError ProfileError"
    " Replay SWAP_MODES StepTimes StepTrace SwapCandidate SwapChoice SwapMode fit_sequence"
    " layer_candidates plan_memory plan_step replay step_times swap_choice trace_step",
    "graphswap.policy": "CheckpointPolicy MIN_SWAP_TENSOR_BYTES SwapPolicy"
    " attention_swap_policy is_parameter_like local_tensor owns_storage policy_name"
    " qwen3_attention_swap_policy size_threshold_policy swap_large_activations tensor_nbytes",
    "graphswap.preflight": "check_attention check_data check_inputs check_model"
    " check_output_dir check_swap_bandwidth check_world resolve_device",
    "graphswap.presets": "PRESETS Preset preset_config preset_names qwen3_moe_config",
    "graphswap.rewrite": "AlreadyTransformedError HierarchyError ModuleChange NoMatchError"
    " RewriteError RewriteReport RuleConflictError RuleReport UnknownRuleError rewrite"
    " rewrite_report unrewrite",
    "graphswap.rules": "ATTN_SWAP Factory LAYER_SWAP QWEN3_ATTN_SWAP QWEN3_MOE_LAYER_SWAP"
    " Rule RuleContext available_rules get_rule layer_swap_policy qualified_name"
    " qwen3_layer_swap_policy register_rule with_policy",
    "graphswap.runtime": "AcceleratorCopyEngine CopyEngine GroupInfo GroupStats HazardError"
    " SimulatedAccelerator SwapExclusionError SwapIntegrityError SwapManager SwapStats"
    " is_swap_wrapped swap_manager_of swap_wrapper unwrap_swap",
    "graphswap.runtime.engines": "AcceleratorCopyEngine Copy CopyEngine HazardError"
    " SimulatedAccelerator",
    "graphswap.runtime.manager": "GroupInfo SwapExclusionError SwapIntegrityError SwapManager",
    "graphswap.runtime.pool": "HOST_SHARE HostBuffer HostPool REUSE_SLACK Refusal"
    " check_host_bytes host_budget local_ranks node_memory size_class",
    "graphswap.runtime.stats": "GroupStats SwapStats",
    "graphswap.runtime.tape": "EMBED_LABEL HEAD_LABEL OPTIMIZER_LABEL OpTape StepTimeline"
    " TapeListener backward_label forward_label step_labels",
    "graphswap.runtime.wrapper": "SwapWrapped is_swap_wrapped swap_manager_of swap_wrapper"
    " unwrap_swap",
    "graphswap.saved_tensors": "ATTENTION_SCOPE EMBED HEAD LAYER_SCOPE LayerTrace MetaModel"
    " SavedTensor SavedTensorCollector SavedTensorTrace attention_swap build_meta_model"
    " bytes_by_scope head_dim in_attention per_rank_config trace_saved_tensors",
    "graphswap.train": "TrainResult data_parallel_rank format_summary token_batches train"
    " train_side_by_side write_summary",
    "graphswap.transforms": "Trace Transform find_transforms shown_by",
}
"""0.1.0's module paths -> their public names then."""

RELEASED_PATHS = sorted(
    old
    for old in {*MODULES, *(f"{m}.{n}" for m, names in RELEASE.items() for n in names.split())}
    if old in MODULES or old in NAMES or old.rpartition(".")[0] in MODULES
)
"""Every old path that is gone from its place now: a module, or a name in a module."""


def _forget(module: str) -> None:
    """Unimport an old module path, so that importing it makes the module (and warns) again."""
    sys.modules.pop(module, None)
    parent, _, child = module.rpartition(".")
    if isinstance(vars(sys.modules[parent]).get(child), types.ModuleType):
        delattr(sys.modules[parent], child)


def _new_place(old: str) -> tuple[str, Any]:
    """Where the test expects ``old`` now: a row of NAMES, else the same name in the first
    successor module that has it (a module's own path: its first successor)."""
    if old in MODULES:
        return MODULES[old][0], importlib.import_module(MODULES[old][0])
    if old in NAMES:
        return NAMES[old].replace(":", "."), _compat.resolve(NAMES[old])
    module, _, name = old.rpartition(".")
    for new in MODULES[module]:
        value = vars(importlib.import_module(new)).get(name)
        if value is not None:
            return f"{new}.{name}", value
    raise AssertionError(f"{old}: in none of {MODULES[module]}")


@pytest.mark.parametrize("old", RELEASED_PATHS)
def test_an_old_path_warns_naming_the_new_one_and_is_the_same_object(old: str) -> None:
    new, expected = _new_place(old)
    module, _, name = old.rpartition(".")
    if old in MODULES:
        _forget(old)
        with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} .*{re.escape(new)}"):
            if old == "graphswap.rewrite":  # the attribute is the function, as in 0.1.0
                old_module = importlib.import_module(old)
            else:  # `graphswap.policy` imports the module; `import graphswap.policy` too
                old_module = getattr(importlib.import_module(module), name)
        assert old_module is sys.modules[old]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            for released in RELEASE.get(old, "").split():
                assert getattr(old_module, released) is _new_place(f"{old}.{released}")[1], released
        assert callable(graphswap.rewrite), "the old module path hid graphswap.rewrite"
        return
    if old in NAMES:
        with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} .*{re.escape(new)}"):
            value = getattr(importlib.import_module(module), name)
    else:  # a name of a moved module: the module's import warns, its names are plain
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            parent = importlib.import_module(module)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            value = getattr(parent, name)
    assert value is expected


def test_a_removed_path_names_what_replaced_it() -> None:
    for old, instead in REMOVED.items():
        module, _, name = old.rpartition(".")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            parent = importlib.import_module(module)
        with pytest.raises(AttributeError, match=re.escape(instead)):
            getattr(parent, name)


def test_python_m_graphswap_cli_runs_the_command() -> None:
    """What torchrun users type (``torchrun ... -m graphswap.cli train``); Python's default
    filter shows the warning, since it points at ``__main__``."""
    done = subprocess.run(
        [sys.executable, "-m", "graphswap.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: graphswap")
    assert "python -m graphswap.cli is deprecated" in done.stderr
    assert "python -m graphswap.train.cli" in done.stderr


def _run_in_checkout(code: str) -> str:
    """``code`` in a fresh interpreter at the checkout's root (where the folder ``passes``
    is importable as a top-level package); its standard output."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_top_level_passes_of_a_checkout_warns_and_is_graphswap_passes() -> None:
    """0.1.0 installed a top-level ``passes``; an installed graphswap no longer has one
    (``tests/test_packaging.py``), but a checkout's root still finds the folder. There it
    warns and is the same package, so ``except passes.PassPlanError`` catches graphswap's,
    and its 0.1.0 names ``passes.Plan`` and ``passes.plan`` warn naming the new ones."""
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import passes\n"
        "    from passes.errors import PassPlanError\n"
        "    from passes import Plan, plan\n"
        "import graphswap.passes, graphswap.passes.errors\n"
        "assert passes is graphswap.passes\n"
        "assert PassPlanError is graphswap.passes.errors.PassPlanError\n"
        "assert Plan is graphswap.passes.PassPlan and plan is graphswap.passes.pass_plan\n"
        "deprecations = {str(w.message) for w in caught"
        " if issubclass(w.category, DeprecationWarning)}\n"
        "print(*sorted(deprecations), sep='\\n')\n"
    )
    stdout = _run_in_checkout(code)
    assert stdout.splitlines() == [
        "graphswap.passes.Plan is deprecated: use graphswap.passes.PassPlan (removed in 0.3)",
        "graphswap.passes.plan is deprecated: use graphswap.passes.pass_plan (removed in 0.3)",
        "passes is deprecated: import from graphswap.passes (removed in 0.3)",
    ]


@pytest.mark.parametrize(("old", "new"), [("Plan", "PassPlan"), ("plan", "pass_plan")])
def test_the_pass_plans_0_1_names_warn_naming_their_new_ones(old: str, new: str) -> None:
    """0.1.0's ``passes.Plan`` and ``passes.plan``: the pass plan is named apart from the
    memory plan (``graphswap.planning.MemoryPlan``) now; the old names stay out of
    ``__all__``, so that ``from graphswap.passes import *`` brings the new ones only."""
    from graphswap import passes

    message = rf"^graphswap\.passes\.{old} is deprecated: use graphswap\.passes\.{new} "
    with pytest.warns(DeprecationWarning, match=message):
        assert getattr(passes, old) is getattr(passes, new)
    assert old not in passes.__all__ and new in passes.__all__


@pytest.mark.parametrize("module", ["graphswap.passes", "graphswap.passes.errors"])
def test_the_pass_plans_0_1_error_base_warns_and_is_pass_plan_error(module: str) -> None:
    """0.1.0's ``PlanError`` is ``PassPlanError``: an ``except PlanError`` written then
    still catches every refusal of the pass plan."""
    import importlib

    from graphswap.passes.errors import PassOrderError, PassPlanError

    with pytest.warns(DeprecationWarning, match=rf"^{module}\.PlanError is deprecated: use "):
        old = importlib.import_module(module).PlanError
    assert old is PassPlanError and issubclass(PassOrderError, old)


def test_the_deprecated_plan_builds_the_pass_plan() -> None:
    """``passes.plan(config)`` is still the function (not a module of that name)."""
    from graphswap import passes
    from graphswap.train.config import TrainerConfig

    config = TrainerConfig(activation_swap="attention")
    with pytest.warns(DeprecationWarning, match=r"graphswap\.passes\.pass_plan"):
        built = passes.plan(config)
    assert isinstance(built, passes.PassPlan) and built.names == ("swap",)


def test_no_file_stands_at_an_old_path_and_each_is_served_by_the_finder() -> None:
    """The package folders hold real modules only: 0.1.0's paths are made on import by
    ``graphswap._compat``'s finder, which 0.3 deletes with the package."""
    package = Path(graphswap.__file__).parent
    for old in MODULES:
        relative = Path(*old.split(".")[1:])
        assert not (package / relative.with_suffix(".py")).exists(), old
        assert not (package / relative).is_dir(), old
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = importlib.import_module(old)
        assert module.__spec__ is not None and module.__spec__.origin == "graphswap._compat"


def test_a_module_that_never_existed_is_still_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("graphswap.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("graphswap.cli.no_such_module")


def test_renamed_kwargs_passes_the_new_name_and_warns_naming_it() -> None:
    """The decorator a renamed keyword goes through (``_compat.renamed_kwargs``): the old
    name warns at the caller's line and arrives under the new one; both at once is the
    function's own refusal of an unexpected keyword."""

    @_compat.renamed_kwargs(lag="offload_lag")
    def plan(*, offload_lag: int = 1) -> int:
        return offload_lag

    with pytest.warns(
        DeprecationWarning, match=r"plan\(lag=\.\.\.\) is deprecated: use offload_lag="
    ) as caught:
        assert plan(lag=3) == 3
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert plan(offload_lag=2) == 2
    with pytest.raises(TypeError, match="lag"):
        plan(lag=3, offload_lag=2)
