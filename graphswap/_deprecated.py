"""The import paths of graphswap 0.1.0 that moved, kept working until 0.3.

Code written against 0.1.0 (``from graphswap.policy import ...``,
``except graphswap.SwapIntegrityError:``, ``python -m graphswap.cli``) keeps running
and is told the new name by a ``DeprecationWarning``. Each old module path is a
two-line file at its old place that calls :func:`moved`; each old name that is not
in its old module's successor is a row of :data:`NAMES`. Targets are imported by
their dotted names through :mod:`importlib`, so this module imports nothing of
graphswap's and the layer contract sees no import from a lower layer to a higher one.
Delete this module, the shims and the ``__getattr__`` hooks that call it in 0.3.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

REMOVED_IN = "0.3"

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
    "graphswap.config.DEFAULT_SWAP_HIDE_MARGIN": "graphswap.planning._settings:DEFAULT_HIDE_MARGIN",
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


_MISSING = object()


def _dotted(target: str) -> str:
    return target.replace(":", ".")


def resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def warn(message: str, inside: str | tuple[str, ...] | None = None) -> None:
    """A ``DeprecationWarning`` that points at the user's line: past this module, the
    shims, the import machinery and the packages ``inside`` (the one whose function was
    called; for an unpickled object, also torch and pickle, which called it), so
    Python's default filter shows it in scripts."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and (
        frame.f_globals.get("__name__") in (__name__, "importlib", *MODULES, *PACKAGES)
        or _bootstrap(frame)
        or (inside is not None and frame.f_globals.get("__name__", "").startswith(inside))
    ):
        # warnings.warn leaves the import system's own frames out of the count itself.
        level, frame = level + (not _bootstrap(frame)), frame.f_back
    warnings.warn(f"{message} (removed in {REMOVED_IN})", DeprecationWarning, stacklevel=level)


def renamed_keywords(caller: str, keywords: dict[str, Any], inside: str) -> dict[str, Any]:
    """``keywords`` with each name of :data:`RENAMED_KEYWORDS` replaced by its new one,
    warning once per old name used; an old name given beside its new one stays, for the
    caller to refuse as unknown."""
    renamed = {}
    for name, value in keywords.items():
        new = RENAMED_KEYWORDS.get(name)
        if new is not None and new not in keywords:
            warn(f"{caller}({name}=...) is deprecated: use {new}=", inside)
            name = new
        renamed[name] = value
    return renamed


def _bootstrap(frame: types.FrameType) -> bool:
    return "importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename


def _name(old: str, search: tuple[str, ...]) -> Any:
    if old in NAMES:
        warn(f"{old} is deprecated: use {_dotted(NAMES[old])}")
        return resolve(NAMES[old])
    if old in REMOVED:
        raise AttributeError(f"{old} is gone since graphswap 0.1.0: use {REMOVED[old]}")
    module, _, name = old.rpartition(".")
    if not name.startswith("__"):
        for new in search:
            value = vars(importlib.import_module(new)).get(name, _MISSING)
            if value is not _MISSING:
                return value
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def module_getattr(module: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of a live module whose 0.1.0 names or submodules moved:
    ``graphswap`` (its old names, its old modules as attributes), ``graphswap.runtime``,
    ``graphswap.hf`` and ``graphswap.train`` (which were modules in 0.1.0), and
    ``graphswap.passes`` (0.1.0's top-level ``passes``, whose ``Plan`` and ``plan`` were
    renamed)."""

    def __getattr__(name: str) -> Any:
        old = f"{module}.{name}"
        if old in MODULES:
            return importlib.import_module(old)  # the shim warns
        return _name(old, ())

    return __getattr__


class Renamed:
    """A class attribute under its 0.1.0 name (``seq = Renamed("seq_len")``): reading it
    warns, naming the new one, and reads that."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.message = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.message = f"{owner.__name__}.{name} is deprecated: use {owner.__name__}.{self.new}"

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        warn(self.message)
        return getattr(obj, self.new)


def moved(old: str) -> Callable[[str], Any]:
    """Called by the shim at ``old``'s place: warn once, on import, and return the
    shim's ``__getattr__``, which finds each old name in its new module."""
    new = MODULES[old]
    warn(f"{old} is deprecated: import from {new[0]}")
    return lambda name: _name(f"{old}.{name}", new)


def moved_package(old: str) -> None:
    """Called by the package's ``__init__`` when it runs under its old top-level name:
    warn, and make the old name and its submodules the new modules themselves. A second
    copy would have classes of its own, and ``except passes.PassPlanError`` would miss the
    errors graphswap raises."""
    new = PACKAGES[old]
    warn(f"{old} is deprecated: import from {new}")
    package = importlib.import_module(new)
    for info in pkgutil.iter_modules(package.__path__, f"{new}."):
        importlib.import_module(info.name)
    for name, module in list(sys.modules.items()):
        if name == new or name.startswith(f"{new}."):
            sys.modules[old + name.removeprefix(new)] = module


class Package(types.ModuleType):
    """``graphswap``'s module type: importing the old module path ``graphswap.rewrite``
    must not replace the function ``graphswap.rewrite`` with that module, as the import
    system would (it sets every imported submodule as an attribute of its package)."""

    def __setattr__(self, name: str, value: Any) -> None:
        old_module = f"{self.__name__}.{name}" in MODULES
        if old_module and isinstance(value, types.ModuleType) and callable(self.__dict__.get(name)):
            return
        super().__setattr__(name, value)
