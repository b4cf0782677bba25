"""What moved since graphswap 0.1.0, as data: old module paths, old names, old keywords.

Each row says where the thing is now; the finder (:mod:`._finder`) and the attribute
hooks (:mod:`._attrs`) read it. Targets are dotted strings, imported on use, so that
nothing of graphswap's is imported here.
"""

from __future__ import annotations

MODULES: dict[str, tuple[str, ...]] = {
    "graphswap.attention_kernels": ("graphswap.hf.attention_kernels",),
    "graphswap.auto_swap": ("graphswap.passes.plan_executor",),
    "graphswap.cli": ("graphswap.train.cli",),
    "graphswap.config": ("graphswap.train.config",),
    "graphswap.decoder": ("graphswap.hf.decoder",),
    "graphswap.graph": ("graphswap.rewriting.graph",),
    "graphswap.measure": ("graphswap.planning.measure",),
    "graphswap.models": ("graphswap.train.build",),
    "graphswap.planner": ("graphswap.planning",),
    "graphswap.policy": ("graphswap.runtime.policy",),
    "graphswap.preflight": ("graphswap.train.preflight",),
    "graphswap.planning.auto_swap": ("graphswap.passes.plan_executor",),
    "graphswap.presets": ("graphswap.hf.presets",),
    "graphswap.rewrite": ("graphswap.rewriting.apply",),
    "graphswap.rules": ("graphswap.rewriting.rules",),
    "graphswap.saved_tensors": ("graphswap.planning.saved_tensors",),
    "graphswap.transforms": ("graphswap.rewriting.transforms",),
    # The runtime's modules went private; their public names are graphswap.runtime's.
    "graphswap.runtime.engines": ("graphswap.runtime", "graphswap.runtime._engines"),
    "graphswap.runtime.manager": ("graphswap.runtime", "graphswap.errors"),
    "graphswap.runtime.pool": ("graphswap.runtime", "graphswap.runtime._pool"),
    "graphswap.runtime.stats": ("graphswap.runtime",),
    "graphswap.runtime.tape": ("graphswap.runtime.timeline",),
    "graphswap.runtime.wrapper": ("graphswap.runtime", "graphswap.runtime._wrapper"),
}
"""Old module path -> the modules its names are now in, the one to import from first."""

_SIZE_POLICY = "graphswap.runtime.policy:swap_large_activations"
NAMES: dict[str, str] = {
    "graphswap.MIN_SWAP_TENSOR_BYTES": "graphswap.runtime.policy:MIN_SWAP_TENSOR_BYTES",
    "graphswap.AlreadyTransformedError": "graphswap.errors:AlreadyTransformedError",
    "graphswap.NoMatchError": "graphswap.errors:NoMatchError",
    "graphswap.RewriteError": "graphswap.errors:RewriteError",
    "graphswap.SwapExclusionError": "graphswap.errors:SwapExclusionError",
    "graphswap.SwapIntegrityError": "graphswap.errors:SwapIntegrityError",
    "graphswap.get_rule": "graphswap.rewriting.rules:get_rule",
    "graphswap.qwen3_attention_swap_policy": _SIZE_POLICY,
    "graphswap.runtime.SimulatedAccelerator": "graphswap.runtime.sim:SimulatedAccelerator",
    "graphswap.runtime.engines.SimulatedAccelerator": "graphswap.runtime.sim:SimulatedAccelerator",
    "graphswap.runtime.SwapExclusionError": "graphswap.errors:SwapExclusionError",
    "graphswap.runtime.SwapIntegrityError": "graphswap.errors:SwapIntegrityError",
    # The host pool's default cap, named as the option it is the default of.
    "graphswap.runtime.host_budget": "graphswap.runtime:default_max_host_bytes",
    "graphswap.runtime.pool.host_budget": "graphswap.runtime:default_max_host_bytes",
    "graphswap.policy.qwen3_attention_swap_policy": _SIZE_POLICY,
    "graphswap.policy.attention_swap_policy": _SIZE_POLICY,
    "graphswap.rules.qwen3_layer_swap_policy": _SIZE_POLICY,
    "graphswap.rules.layer_swap_policy": _SIZE_POLICY,
    "graphswap.config.ActivationSwap": "graphswap.planning:SwapMode",
    # 0.1.0's passes.Plan and passes.plan: the pass plan, named apart from the memory plan.
    "graphswap.passes.Plan": "graphswap.passes:PassPlan",
    "graphswap.passes.plan": "graphswap.passes:pass_plan",
    "graphswap.passes.PlanError": "graphswap.passes.errors:PassPlanError",
    "graphswap.passes.errors.PlanError": "graphswap.passes.errors:PassPlanError",
    # The swap pass's planning call, named after one of the two modes whose plan it makes.
    "graphswap.passes.swap.plan_auto_swap": "graphswap.passes.swap:plan_swap",
    # The config group read by auto and budget, named after auto alone (0.2.0).
    **{
        f"{module}.{old}": f"graphswap.train.config:{new}"
        for module in ("graphswap.config", "graphswap.train.config")
        for old, new in (
            ("AutoSwapSettings", "SwapPlanSettings"),
            ("AUTO_ONLY_SETTINGS", "PLAN_ONLY_SETTINGS"),
        )
    },
    "graphswap.config.DEFAULT_SWAP_HIDE_MARGIN": "graphswap.planning._settings:DEFAULT_HIDE_MARGIN",
    # The executor of auto and budget plans, named after one of the two modes it runs; at
    # its module and at that module's 0.1.0 paths. Pickles of a model it rewrote name
    # AutoSwap and AutoSwapPolicy (its policies are the layers'): they load through here.
    **{
        f"{module}.{old}": f"graphswap.passes.plan_executor:{new}"
        for module in (
            "graphswap.passes.plan_executor",
            "graphswap.auto_swap",
            "graphswap.planning.auto_swap",
        )
        for old, new in (
            ("AutoSwap", "PlanExecutor"),
            ("AutoSwapPolicy", "PlanPolicy"),
            ("AutoSwapMismatchError", "PlanMismatchError"),
            ("AutoSwapMismatchWarning", "PlanMismatchWarning"),
        )
    },
    # graphswap.planning's names are what a user calls; the steps behind a plan are
    # graphswap.planning.trace's, the rest the planner's own.
    **{
        f"graphswap.planner.{name}": f"graphswap.planning.trace:{name}"
        for name in (
            "StepTrace",
            "SwapChoice",
            "layer_candidates",
            "plan_step",
            "replay",
            "swap_choice",
            "trace_step",
        )
    },
    "graphswap.planner.DEFAULT_HIDE_MARGIN": "graphswap.planning._settings:DEFAULT_HIDE_MARGIN",
    "graphswap.planner.SWAP_MODES": "graphswap.planning._plan:SWAP_MODES",
    "graphswap.planner.DEFAULT_SEQ_STEP": "graphswap.planning._fit:DEFAULT_SEQ_STEP",
    "graphswap.planner.Replay": "graphswap.planning._replay:Replay",
    "graphswap.planner.GroupReplay": "graphswap.planning._replay:GroupReplay",
    "graphswap.planner.StepTimes": "graphswap.planning._windows:StepTimes",
    "graphswap.planner.GroupWindow": "graphswap.planning._windows:GroupWindow",
    "graphswap.planner.step_times": "graphswap.planning._windows:step_times",
    "graphswap.planner.SwapCandidate": "graphswap.planning._auto:SwapCandidate",
    **{
        f"graphswap.hf.{name}": f"graphswap.hf.checkpoints:{name}"
        for name in (
            "CheckpointError",
            "build_model",
            "decoder_layers",
            "load_hf_config",
            "load_weights",
            "model_config",
            "weight_files",
        )
    },
    **{
        f"graphswap.train.{name}": f"graphswap.train.trainer:{name}"
        for name in (
            "TrainResult",
            "data_parallel_rank",
            "format_summary",
            "token_batches",
            "train",
            "train_side_by_side",
            "write_summary",
        )
    },
}
"""Old ``module.name`` -> ``new_module:name``, for names that moved out of their module
(or out of ``graphswap`` itself) or were renamed."""

RENAMED_KEYWORDS: dict[str, str] = {
    "seq": "seq_len",
    "batch": "batch_size",
    "tp": "tp_size",
    "hide_margin": "swap_hide_margin",
    "offload_lag": "swap_offload_lag",
    "prefetch_depth": "swap_prefetch_depth",
    "bandwidth_gbps": "swap_bandwidth_gbps",
    "tflops": "swap_tflops",
}
"""The keywords of ``plan_memory`` and ``fit_sequence`` in 0.1.0 -> their names now, the
trainer config's keys (one spelling per setting)."""

RENAMED_SWAP_OPTIONS: dict[str, str] = {
    "prefetch_depth": "swap_prefetch_depth",
    "offload_lag": "swap_offload_lag",
}
"""The keywords of ``SwapManager`` and ``apply_swap`` (and the keys of a pickled
``SwapManager``'s options) in 0.2.0 -> their names now, the config's keys."""

PACKAGES: dict[str, str] = {"passes": "graphswap.passes"}
"""0.1.0's top-level packages -> their place under graphswap. An installed graphswap has
no top-level ``passes``; a source checkout still finds the folder on ``sys.path``."""

_PROFILE = "the device profile's figures (graphswap.runtime.profile.device_profile)"
REMOVED: dict[str, str] = {
    "graphswap.config.DEFAULT_SWAP_BANDWIDTH_GBPS": _PROFILE,
    "graphswap.config.DEFAULT_SWAP_TFLOPS": _PROFILE,
    "graphswap.planner.DEFAULT_BANDWIDTH_GBPS": _PROFILE,
    "graphswap.planner.DEFAULT_TFLOPS": _PROFILE,
    "graphswap.planner.choose_hidden": "graphswap.planning.trace.swap_choice",
    "graphswap.runtime.original_type": "the module graphswap.unwrap_swap returns",
    "graphswap.runtime.wrapper.original_type": "the module graphswap.unwrap_swap returns",
}
"""Old paths with nothing at the same place: what to use instead, for the error."""

PICKLED: dict[str, str] = {
    "graphswap.rules._HierarchyValidator": "graphswap._compat._pickles:HierarchyValidator",
}
"""Private classes that 0.1.0's pickles name at their old paths -> where the loader
that reads them keeps them; found without a warning (the loader gives one where the
object needs converting)."""
