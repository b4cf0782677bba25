"""The ways of saving activations that the benchmark compares, installed on one model in turn.

``none``: autograd as is. ``attention``: graphswap on every layer's attention (the
``qwen3_attn_swap`` layout). ``layer``: graphswap on whole decoder layers. ``auto``:
``activation_swap: auto``, whole layers swapping what the planner says the link hides.
``budget``: ``activation_swap: budget``, per layer what to keep, swap or recompute so that
the predicted peak stays within a budget. ``save_on_cpu``: PyTorch's
``torch.autograd.graph.save_on_cpu`` around every attention, the synchronous baseline.
Each mode reports what it copied and recomputed with the same counters.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

NONE, ATTENTION, LAYER, AUTO, BUDGET = "none", "attention", "layer", "auto", "budget"
SAVE_ON_CPU = "save_on_cpu"
MODES = (NONE, ATTENTION, LAYER, AUTO, BUDGET, SAVE_ON_CPU)
PLANNED = (AUTO, BUDGET)
"""The modes that run a ``PlanExecutor`` of their own plan."""
COUNTERS = (
    "offloaded_tensors",
    "offloaded_bytes",
    "reloaded_bytes",
    "kept_bytes",
    "prefetch_hits",
    "prefetch_misses",
    "peak_host_bytes",
    "recomputed_bytes",
)


class _CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """``save_on_cpu`` that counts the tensors and bytes its pack hook really copied."""

    def __init__(self, counts: dict[str, int], *, pin_memory: bool) -> None:
        super().__init__(pin_memory=pin_memory)
        pack = self.pack_hook

        def counting_pack(t: torch.Tensor) -> Any:
            device, packed = pack(t)
            if packed.untyped_storage()._cdata != t.untyped_storage()._cdata:
                counts["offloaded_tensors"] += 1
                counts["offloaded_bytes"] += t.numel() * t.element_size()
            return device, packed

        self.pack_hook = counting_pack


class Mode:
    """Installs one way of saving activations on ``model``, and takes it off again.

    The graphswap modes keep one ``SwapManager`` for the whole run, so its copy
    streams and host pool are reused from step to step as in training.
    """

    def __init__(
        self, name: str, model: torch.nn.Module, device: torch.device, auto: Any = None
    ) -> None:
        if name not in MODES:
            raise ValueError(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
        if (name in PLANNED) != (auto is not None) or (
            auto is not None and auto.plan.activation_swap != name
        ):
            raise ValueError("the auto and budget modes, and only they, take their PlanExecutor")
        self.name = name
        self.auto = auto
        self.model = model
        self.device = device
        self.manager: Any = None
        self._copied = dict.fromkeys(COUNTERS, 0)
        if name in (ATTENTION, LAYER, *PLANNED):
            from graphswap.runtime import SwapManager

            # A planned mode runs at the offload lag its plan was made at (it may choose 2).
            lag = 1 if auto is None else auto.plan.swap_offload_lag
            self.manager = SwapManager(swap_offload_lag=lag)

    def _targets(self) -> list[tuple[str, torch.nn.Module]]:
        layers = self.model.model.layers
        if self.name == LAYER:
            return [(f"model.layers.{i}", layer) for i, layer in enumerate(layers)]
        return [(f"model.layers.{i}.self_attn", layer.self_attn) for i, layer in enumerate(layers)]

    @contextmanager
    def installed(self) -> Iterator[None]:
        if self.name == NONE:
            yield
            return
        if self.auto is not None:
            from graphswap.rewriting.apply import rewrite, unrewrite

            rewrite(self.model, [self.auto.rule()], manager=self.manager)
            try:
                yield
            finally:
                unrewrite(self.model)
            return
        targets = self._targets()
        if self.manager is not None:
            from graphswap.runtime import swap_wrapper, unwrap_swap

            for name, module in targets:
                swap_wrapper(module, manager=self.manager, name=name)
            for (_, prev), (_, nxt) in itertools.pairwise(targets):
                self.manager.link(prev, nxt)
            try:
                yield
            finally:
                for _, module in targets:
                    unwrap_swap(module)
            return
        for _, module in targets:
            module.forward = self._under_save_on_cpu(module.forward)
        try:
            yield
        finally:
            for _, module in targets:
                del module.forward

    def _under_save_on_cpu(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        pin = self.device.type == "cuda"

        def run(*args: Any, **kwargs: Any) -> Any:
            with _CountingSaveOnCpu(self._copied, pin_memory=pin):
                return forward(*args, **kwargs)

        return run

    def reset_counters(self) -> None:
        self._copied = dict.fromkeys(COUNTERS, 0)
        if self.manager is not None:
            self.manager.reset_stats()

    def counters(self) -> dict[str, int]:
        """What this mode copied since :meth:`reset_counters` (same keys for every mode)."""
        if self.manager is None:
            return dict(self._copied)
        stats = self.manager.stats
        return {key: getattr(stats, key) for key in COUNTERS}
