"""The executor of ``auto`` and ``budget`` plans: a plan's per-layer choice, carried out.

It sits with the swap pass, above the planner: it installs what a
:class:`~graphswap.planning.MemoryPlan` decided (the saves swapped, the recompute level)
through the rewrite's rules and the runtime's wrappers, and checks every step against it.

The plan (:func:`graphswap.planning.plan_memory` with ``activation_swap="auto"`` or
``"budget"``) lists, per decoder layer, every save of its forward with its shape and
dtype, and names the saves to swap by their index. The swap runtime counts the pack
calls of each forward the way the trace numbers saves (every call, parameters and
repeated saves of one storage too) and tells the policy the index (``decide(t,
index)``). A planned index whose tensor has the planned shape and dtype is swapped.

Every step is checked against the plan it runs under: a save the policy is asked
about with another shape or dtype than the plan's (another sequence length or batch,
autocast's dtype around weights of another) stays on device; and each layer's
recomputed and offloaded bytes per forward are compared with the plan's at the start
of the next step (and by :meth:`PlanExecutor.check`), since a plan that swaps nothing asks
the policy about few saves. Either is counted (the manager's ``stats.plan_mismatches``)
and warned about once per model, naming what differs and the settings the plan was
made for; :meth:`PlanExecutor.check`, which the rewrite report's ``check()`` calls, turns
the count into an error. A model built at one shape and run at another is thus never
silently unswapped, nor a budget silently exceeded.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphswap import _compat
from graphswap.errors import GraphswapError, GraphswapTypeError, HierarchyError
from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.hf.cache import cache_as_before
from graphswap.hf.checkpoints import decoder_layers
from graphswap.planning._registry import STRATEGIES
from graphswap.planning._units import reruns_down_projections, saves_matmuls
from graphswap.rewriting.rules import Rule, RuleContext, get_rule
from graphswap.runtime import (
    is_recompute_wrapped,
    recompute_wrapper,
    swap_wrapper,
    unwrap_recompute,
    unwrap_swap,
)
from graphswap.runtime.policy import CheckpointPolicy

if TYPE_CHECKING:
    from graphswap.planning import LayerPlan, MemoryPlan
    from graphswap.runtime import SwapManager

AUTO_RULE = "auto_swap"
"""The name of the rule :meth:`PlanExecutor.rule` builds from ``layer_swap``."""

_BASE_RULE = "layer_swap"
"""Whole decoder layers of any Hugging Face decoder, by the classes the model declares."""


class PlanMismatchError(GraphswapError, ValueError):
    """The model saved, recomputed or offloaded other tensors than the ``auto`` or
    ``budget`` plan it runs was made for."""


class PlanMismatchWarning(UserWarning):
    """A step is not the one planned: a planned save came with another shape or dtype (it
    stays on device), or a layer recomputed or offloaded other bytes."""


@dataclass(frozen=True)
class Mismatch:
    """A save that the model made with another shape or dtype than planned."""

    layer: str
    index: int
    planned: tuple[tuple[int, ...], torch.dtype] | None
    """``None``: the plan's forward made fewer saves."""
    found: tuple[tuple[int, ...], torch.dtype]

    def describe(self) -> str:
        """What differs, in the words of the settings a user changes."""
        said = f"{self.layer} save #{self.index} is {_describe(*self.found)}"
        if self.planned is None:
            return f"{said}, a save the plan's forward does not make"
        said = f"{said}, but the plan expects {_describe(*self.planned)}"
        found, planned = self.found[1], self.planned[1]
        if found != planned and found.is_floating_point and found.itemsize < planned.itemsize:
            # Autocast is off inside saved-tensor hooks, where this is found: it cannot be
            # asked, only named as what computes in a narrower dtype than the weights.
            said += f" (the step computes in {_dtype_name(found)}: autocast's dtype, under it)"
        return said


@dataclass(frozen=True)
class BytesMismatch:
    """A layer's forward recomputed or offloaded other bytes than planned."""

    layer: str
    what: str
    """``recomputed`` or ``offloaded``."""
    planned: int
    found: int

    def describe(self) -> str:
        return (
            f"{self.layer} {self.what} {self.found} bytes in one forward where the plan"
            f" {self.what} {self.planned}"
        )


@dataclass(frozen=True)
class CopyBandwidth:
    """A pinned host<->device copy timed each way at start-up, in GB/s."""

    device_to_host_gbps: float
    host_to_device_gbps: float

    @property
    def gbps(self) -> float:
        """The slower direction: offloads and prefetches both have to hide."""
        return min(self.device_to_host_gbps, self.host_to_device_gbps)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"{shape} {_dtype_name(dtype)}"


def _met_and_planned(mismatch: Mismatch | BytesMismatch, made_for: str) -> str:
    return f"{mismatch.describe()} (plan made for {made_for})"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what one rank holds and the plan traced); else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


_NEVER = 1 << 62
"""The index a policy asked about nothing yet is taken to have been asked about last."""


class PlanPolicy:
    """Swaps exactly the saves one layer's plan chose; every save it is asked about is
    checked by shape and dtype against the plan's save at that index."""

    def __init__(
        self, layer: LayerPlan, on_mismatch: Callable[[Mismatch], None] | None = None
    ) -> None:
        self.__name__ = "auto_swap_policy"
        self.layer = layer.name
        self.planned: dict[int, tuple[tuple[int, ...], torch.dtype]] = {
            save.index: (save.shape, save.dtype) for save in layer.swapped_saves
        }
        """The saves to swap, by index: their shape and dtype."""
        self.expected: tuple[tuple[tuple[int, ...], torch.dtype], ...] = tuple(
            (save.shape, save.dtype) for save in layer.saved_tensors
        )
        """Every save of the planned forward, by index: its shape and dtype."""
        self.mismatched_tensors = 0
        self.first_mismatch: Mismatch | None = None
        self.on_mismatch = on_mismatch
        """Told of every mismatch (:class:`PlanExecutor`: the warning and the stats)."""
        self.on_forward: Callable[[], None] | None = None
        """Told when a forward of the layer begins (its first save asked about):
        :class:`PlanExecutor` checks the step before it there."""
        self._last = _NEVER  # the index asked about last: one no greater begins a forward

    def decide(self, t: torch.Tensor, index: int) -> CheckpointPolicy:
        if index <= self._last and self.on_forward is not None:
            self.on_forward()
        self._last = index
        shape = t.shape if type(t) is torch.Tensor else _local(t).shape
        expected = self.expected
        if index < len(expected):
            planned = expected[index]
            if shape == planned[0] and t.dtype == planned[1]:
                return _MUST_SWAP if index in self.planned else _MUST_SAVE
        else:
            planned = None
        self.mismatched_tensors += 1
        mismatch = Mismatch(self.layer, index, planned, (tuple(shape), t.dtype))
        if self.first_mismatch is None:
            self.first_mismatch = mismatch
        if self.on_mismatch is not None:
            self.on_mismatch(mismatch)
        return _MUST_SAVE

    def __call__(self, t: torch.Tensor) -> CheckpointPolicy:
        raise GraphswapTypeError(
            "auto_swap_policy decides by the save's index in the layer's forward: run it "
            "under a graphswap SwapManager, which calls decide(t, index)"
        )


_MUST_SWAP = CheckpointPolicy.MUST_SWAP
_MUST_SAVE = CheckpointPolicy.MUST_SAVE

_REPLAN = (
    "run the model at the settings the plan was made for, or plan the step it runs (its"
    " seq_len, batch_size, and dtype: autocast's when the step runs under autocast)"
)


class PlanExecutor:
    """An ``auto`` or ``budget`` plan and the per-layer policies that carry it out on one
    model.

    ``made_for`` names the settings the plan was traced for (``key: value``), for
    the error when the model runs something else; ``measured`` is the link timed at
    start-up when the bandwidth was ``measure``.
    """

    def __init__(
        self, plan: MemoryPlan, *, made_for: str, measured: CopyBandwidth | None = None
    ) -> None:
        strategy = STRATEGIES.get(plan.activation_swap)
        if strategy is None or not strategy.executes_plan:
            raise PlanSettingError(
                "activation_swap",
                plan.activation_swap,
                "PlanExecutor carries out a plan_memory(activation_swap='auto' or 'budget')"
                " plan; plan with one of those",
            )
        self.plan = plan
        self.made_for = made_for
        self.measured = measured
        self.policies = [PlanPolicy(layer) for layer in plan.layers]
        self.mismatched_forwards = 0
        """Layer forwards whose recomputed or offloaded bytes differed from the plan's."""
        self._first_bytes_mismatch: BytesMismatch | None = None
        self._manager: SwapManager | None = None  # the rewrite's, once the rule wrapped a layer
        self._names: list[str] = [layer.name for layer in plan.layers]
        """Each layer's group name with the manager (its path in the rewritten model)."""
        self._counted: dict[str, tuple[int, ...]] | None = None
        """Each group's counters when the current step began (:meth:`_counters`)."""
        self._warned = False

    def rule(self) -> Rule:
        """``layer_swap`` with this plan's policy in each layer (and, for a ``budget``
        plan, its recomputed submodules wrapped inside)."""
        base = get_rule(_BASE_RULE)
        return dataclasses.replace(
            base,
            name=AUTO_RULE,
            description=f"swap, per decoder layer, the saved tensors the"
            f" {self.plan.activation_swap} plan chose",
            factory=self._wrap,
            restore=_unwrap,
            validate=self._validate,
            node_attributes=self._node_attributes,
            check=self.check,
        )

    def _validate(self, root: nn.Module) -> None:
        base = get_rule(_BASE_RULE)
        assert base.validate is not None
        base.validate(root)
        found = len(decoder_layers(root)[1])
        if found != len(self.plan.layers):
            raise HierarchyError(
                f"{AUTO_RULE}: the model has {found} decoder layers but the"
                f" {self.plan.activation_swap} plan was made for {len(self.plan.layers)}; plan"
                " the model that is rewritten"
            )

    def _wrap(self, module: nn.Module, ctx: RuleContext) -> nn.Module:
        policy = self.policies[ctx.index]
        policy.on_mismatch = functools.partial(self._mismatched, ctx.manager, ctx.fqn)
        self._manager = ctx.manager
        self._names[ctx.index] = ctx.fqn
        if ctx.index == 0:
            policy.on_forward = self._step_begins
        recomputed = self.plan.layers[ctx.index].recomputed
        if recomputed == ("",):  # the whole layer: recomputed inside its own swap
            return swap_wrapper(
                module,
                policy=policy,
                manager=ctx.manager,
                name=ctx.fqn,
                recompute=True,
                recompute_kwargs=cache_as_before,
            )
        counter = functools.partial(ctx.manager.count_recompute, ctx.fqn)
        units = []
        try:
            for name in recomputed:
                try:
                    units.append(module.get_submodule(name))
                except AttributeError:
                    raise HierarchyError(
                        f"{AUTO_RULE}: {ctx.fqn} has no submodule {name!r}, which the budget "
                        "plan recomputes; plan the model that is rewritten"
                    ) from None
                recompute_wrapper(
                    units[-1],
                    counter=counter,
                    save_matmuls=saves_matmuls(self.plan.recompute, name),
                    rerun_to_input_width=reruns_down_projections(self.plan.recompute, name),
                )
            return swap_wrapper(module, policy=policy, manager=ctx.manager, name=ctx.fqn)
        except Exception:
            for unit in units:
                if is_recompute_wrapped(unit):
                    unwrap_recompute(unit)
            raise

    def _counters(self) -> dict[str, tuple[int, ...]]:
        """Per group: recomputed bytes, offloaded bytes, and the saves the swap kept for
        a counted reason (which make offloaded bytes differ from the plan's anyway)."""
        assert self._manager is not None
        return {
            name: (
                group.recomputed_bytes,
                group.offloaded_bytes,
                group.kept_tensors + group.plan_mismatches,
            )
            for name, group in self._manager.stats.per_group.items()
        }

    def _step_begins(self) -> None:
        """The first layer's forward begins: check the step before it, layer by layer."""
        counted = self._counters()
        if self._counted is not None:
            self._check_bytes(self._counted, counted)
        self._counted = counted

    def _check_bytes(
        self, before: dict[str, tuple[int, ...]], after: dict[str, tuple[int, ...]]
    ) -> None:
        """Each layer's recomputed and offloaded bytes between ``before`` and ``after``
        (one step) against the plan's; a step the stats were reset in is not checked."""
        if any(after[name][i] < before[name][i] for name in after for i in range(3)):
            return
        assert self._manager is not None
        for layer, name in zip(self.plan.layers, self._names, strict=True):
            now, then = after[name], before[name]
            recomputed, offloaded, kept = (a - b for a, b in zip(now, then, strict=True))
            if not (recomputed or offloaded or kept):
                continue  # the layer did not run (a forward under no_grad): nothing to check
            found: BytesMismatch | None = None
            if recomputed != layer.recomputed_bytes:
                found = BytesMismatch(name, "recomputed", layer.recomputed_bytes, recomputed)
            elif not kept and offloaded != layer.offloaded_bytes:
                found = BytesMismatch(name, "offloaded", layer.offloaded_bytes, offloaded)
            if found is not None:
                self.mismatched_forwards += 1
                if self._first_bytes_mismatch is None:
                    self._first_bytes_mismatch = found
                self._mismatched(self._manager, name, found)

    def _mismatched(
        self, manager: SwapManager, group: str, mismatch: Mismatch | BytesMismatch
    ) -> None:
        """A save met with another shape or dtype than planned, or a forward that
        recomputed or offloaded other bytes: counted in the stats of the group that made
        it, and warned about once, since a model built for one step and run at another
        would otherwise swap nothing, or exceed its budget, without a word."""
        manager.count_plan_mismatch(group)
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            PlanMismatchWarning(
                f"activation_swap: {self.plan.activation_swap}:"
                f" {_met_and_planned(mismatch, self.made_for)}; this step is not the one"
                " planned: a save that differs stays on device, and what a budget bounds may"
                " not hold (counted in the swap manager's stats.plan_mismatches; the rewrite"
                f" report's check() raises): {_REPLAN}"
            ),
            stacklevel=2,
        )

    def _node_attributes(self, ctx: RuleContext) -> dict[str, Any]:
        layer = self.plan.layers[ctx.index]
        return {
            "auto_swapped_saves": ",".join(str(s.index) for s in layer.swapped_saves) or "-",
            "auto_swapped_bytes": layer.swappable_bytes,
            "auto_kept_bytes": layer.kept_bytes,
            "auto_copy_ms": round(layer.copy_seconds * 1e3, 6),
            "auto_forward_window_ms": round(layer.forward_window * 1e3, 6),
            "auto_backward_window_ms": round(layer.backward_window * 1e3, 6),
            "auto_verdict": layer.verdict(),
            **(
                {
                    "recomputed": ",".join(layer.recomputed) or "-",
                    "recomputed_bytes": layer.recomputed_bytes,
                }
                if STRATEGIES[self.plan.activation_swap].recomputes
                else {}
            ),
        }

    @property
    def mismatched_tensors(self) -> int:
        return sum(policy.mismatched_tensors for policy in self.policies)

    def check(self) -> None:
        """Raise :class:`PlanMismatchError` if any save or layer forward so far (the
        last step's included) did not match the plan."""
        if self._counted is not None:
            self._step_begins()
        mode = self.plan.activation_swap
        count = self.mismatched_tensors
        if count:
            first = next(p.first_mismatch for p in self.policies if p.first_mismatch is not None)
            raise PlanMismatchError(
                f"activation_swap: {mode}: {count} saved tensor(s) did not match the plan and"
                f" stayed on device; first: {_met_and_planned(first, self.made_for)}; {_REPLAN}"
            )
        if self._first_bytes_mismatch is not None:
            raise PlanMismatchError(
                f"activation_swap: {mode}: {self.mismatched_forwards} layer forward(s) did not"
                " match the plan; first:"
                f" {_met_and_planned(self._first_bytes_mismatch, self.made_for)}; {_REPLAN}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The plan's data (``plan``), what it was made for and what run time found;
        ``graphswap train`` renders it (``graphswap.train.reports.format_auto_report``)."""
        return {
            "made_for": self.made_for,
            "measured_bandwidth": None
            if self.measured is None
            else dataclasses.asdict(self.measured),
            "swapped_bytes": self.plan.swapped_bytes,
            "mismatched_tensors": self.mismatched_tensors,
            "mismatched_forwards": self.mismatched_forwards,
            "plan": self.plan.to_dict(),
        }

    def format_report(self) -> str:
        """Deprecated (0.1.0's name), removed in 0.3: the report ``graphswap train`` prints."""
        _compat.warn(
            "PlanExecutor.format_report is deprecated:"
            " use graphswap.train.reports.format_auto_report(auto.to_dict())",
            inside=__name__,
        )
        report = _compat.resolve("graphswap.train.reports:format_auto_report")
        return str(report(self.to_dict()))


def _unwrap(module: nn.Module) -> nn.Module:
    """Undo :meth:`PlanExecutor._wrap`: the recomputed submodules, then the layer's swap."""
    for unit in module.modules():
        if is_recompute_wrapped(unit):
            unwrap_recompute(unit)
    return unwrap_swap(module)


def check_measurable(device: torch.device) -> None:
    """``swap_bandwidth_gbps: measure`` needs a CUDA device: on CPU there is no host link
    to time, and no number to fall back on silently."""
    if device.type != "cuda":
        raise PlanSettingError(
            "swap_bandwidth_gbps",
            "measure",
            f"times a pinned copy between host and a CUDA device, but training runs"
            f" on {device.type}; give the link's bandwidth in GB/s (e.g. 50)",
        )


def measure_copy_bandwidth(
    device: torch.device, *, nbytes: int = 128 << 20, repeats: int = 5
) -> CopyBandwidth:
    """Time a pinned copy of ``nbytes`` each way on a side stream; the best of ``repeats``.

    Only a CUDA device has a host link to time (:func:`check_measurable`).
    """
    check_measurable(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)

    def best_gbps(dst: torch.Tensor, src: torch.Tensor) -> float:
        seconds: list[float] = []
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)  # warm-up
            for _ in range(repeats):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
                end.synchronize()
                seconds.append(start.elapsed_time(end) / 1e3)
        return nbytes / min(seconds) / 1e9

    return CopyBandwidth(best_gbps(host, on_device), best_gbps(on_device, host))


__getattr__ = _compat.module_getattr(__name__)  # AutoSwap* renamed Plan*, until 0.3
