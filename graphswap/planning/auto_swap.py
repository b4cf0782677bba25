"""``activation_swap: auto`` at run time: a plan's per-layer choice, carried out.

The plan (:func:`graphswap.planning.plan_memory` with ``activation_swap="auto"``) names, per
decoder layer, the saves to swap by their index in the layer's forward, with their
shape and dtype. The swap runtime counts the pack calls of each forward the way the
trace numbers saves (every call, parameters and repeated saves of one storage too)
and tells the policy the index (``decide(t, index)``). A planned index whose tensor
has the planned shape and dtype is swapped; one that differs stays on device, is
counted (the policy's ``mismatched_tensors``, the manager's ``stats.plan_mismatches``),
and warned about once per model; :meth:`AutoSwap.check`, which the rewrite report's
``check()`` calls, turns the count into an error naming the settings the plan was made
for. A model built by ``graphswap.train.build.from_config`` at one shape and run at another
is thus never silently unswapped.
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

from graphswap import _deprecated
from graphswap.errors import GraphswapError, GraphswapTypeError, HierarchyError
from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.hf.cache import cache_as_before
from graphswap.hf.checkpoints import decoder_layers
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
"""The name of the rule :meth:`AutoSwap.rule` builds from ``layer_swap``."""

_BASE_RULE = "layer_swap"
"""Whole decoder layers of any Hugging Face decoder, by the classes the model declares."""


class AutoSwapMismatchError(GraphswapError, ValueError):
    """The model saved tensors other than those the ``auto`` plan was made for."""


class AutoSwapMismatchWarning(UserWarning):
    """A planned save came with another shape or dtype: it stays on device."""


@dataclass(frozen=True)
class Mismatch:
    """A planned save that the model made with another shape or dtype."""

    layer: str
    index: int
    planned: tuple[tuple[int, ...], torch.dtype]
    found: tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class CopyBandwidth:
    """A pinned host<->device copy timed each way at start-up, in GB/s."""

    device_to_host_gbps: float
    host_to_device_gbps: float

    @property
    def gbps(self) -> float:
        """The slower direction: offloads and prefetches both have to hide."""
        return min(self.device_to_host_gbps, self.host_to_device_gbps)


def _describe(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"{shape} {str(dtype).removeprefix('torch.')}"


def _met_and_planned(mismatch: Mismatch, made_for: str) -> str:
    return (
        f"{mismatch.layer} save #{mismatch.index} is {_describe(*mismatch.found)}, but the"
        f" plan made for {made_for} expects {_describe(*mismatch.planned)}"
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what one rank holds and the plan traced); else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class AutoSwapPolicy:
    """Swaps exactly the saves one layer's plan chose, each checked by shape and dtype."""

    def __init__(
        self, layer: LayerPlan, on_mismatch: Callable[[Mismatch], None] | None = None
    ) -> None:
        self.__name__ = "auto_swap_policy"
        self.layer = layer.name
        self.planned: dict[int, tuple[tuple[int, ...], torch.dtype]] = {
            save.index: (save.shape, save.dtype) for save in layer.swapped_saves
        }
        self.mismatched_tensors = 0
        self.first_mismatch: Mismatch | None = None
        self.on_mismatch = on_mismatch
        """Told of every mismatch (:class:`AutoSwap`: the warning and the stats)."""

    def decide(self, t: torch.Tensor, index: int) -> CheckpointPolicy:
        planned = self.planned.get(index)
        if planned is None:
            return CheckpointPolicy.MUST_SAVE
        shape = t.shape if type(t) is torch.Tensor else _local(t).shape
        if shape == planned[0] and t.dtype == planned[1]:
            return CheckpointPolicy.MUST_SWAP
        self.mismatched_tensors += 1
        mismatch = Mismatch(self.layer, index, planned, (tuple(shape), t.dtype))
        if self.first_mismatch is None:
            self.first_mismatch = mismatch
        if self.on_mismatch is not None:
            self.on_mismatch(mismatch)
        return CheckpointPolicy.MUST_SAVE

    def __call__(self, t: torch.Tensor) -> CheckpointPolicy:
        raise GraphswapTypeError(
            "auto_swap_policy decides by the save's index in the layer's forward: run it "
            "under a graphswap SwapManager, which calls decide(t, index)"
        )


class AutoSwap:
    """An ``auto`` plan and the per-layer policies that carry it out on one model.

    ``made_for`` names the settings the plan was traced for (``key: value``), for
    the error when the model runs something else; ``measured`` is the link timed at
    start-up when the bandwidth was ``measure``.
    """

    def __init__(
        self, plan: MemoryPlan, *, made_for: str, measured: CopyBandwidth | None = None
    ) -> None:
        if plan.activation_swap not in ("auto", "budget"):
            raise PlanSettingError(
                "activation_swap",
                plan.activation_swap,
                "AutoSwap carries out a plan_memory(activation_swap='auto' or 'budget') plan;"
                " plan with one of those",
            )
        self.plan = plan
        self.made_for = made_for
        self.measured = measured
        self.policies = [AutoSwapPolicy(layer) for layer in plan.layers]
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

    def _mismatched(self, manager: SwapManager, group: str, mismatch: Mismatch) -> None:
        """A planned save met with another shape or dtype: counted in the stats of the
        group that made it, and warned about once, since a model built at one shape and
        run at another would otherwise swap nothing without a word."""
        manager.count_plan_mismatch(group)
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            AutoSwapMismatchWarning(
                f"activation_swap: {self.plan.activation_swap}:"
                f" {_met_and_planned(mismatch, self.made_for)}; every"
                " save that differs from the plan stays on device (counted in the swap"
                " manager's stats.plan_mismatches; the rewrite report's check() raises):"
                " run the model at the settings the plan was made for, or build it for the"
                " shape it runs"
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
                if self.plan.activation_swap == "budget"
                else {}
            ),
        }

    @property
    def mismatched_tensors(self) -> int:
        return sum(policy.mismatched_tensors for policy in self.policies)

    def check(self) -> None:
        """Raise :class:`AutoSwapMismatchError` if any planned save did not match."""
        count = self.mismatched_tensors
        if not count:
            return
        first = next(p.first_mismatch for p in self.policies if p.first_mismatch is not None)
        raise AutoSwapMismatchError(
            f"activation_swap: {self.plan.activation_swap}: {count} saved tensor(s) did not"
            " match the plan and stayed "
            f"on device; first: {_met_and_planned(first, self.made_for)}; run the model at "
            "the settings the plan was made for, or set them to what the model runs"
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
            "plan": self.plan.to_dict(),
        }

    def format_report(self) -> str:
        """Deprecated (0.1.0's name), removed in 0.3: the report ``graphswap train`` prints."""
        _deprecated.warn(
            "AutoSwap.format_report is deprecated:"
            " use graphswap.train.reports.format_auto_report(auto.to_dict())",
            inside=__name__,
        )
        report = _deprecated.resolve("graphswap.train.reports:format_auto_report")
        return str(report(self.to_dict()))


def _unwrap(module: nn.Module) -> nn.Module:
    """Undo :meth:`AutoSwap._wrap`: the recomputed submodules, then the layer's swap."""
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
