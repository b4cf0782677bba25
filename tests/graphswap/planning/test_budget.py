"""``activation_swap: budget``: keep, swap and recompute under a memory budget, exact.

Per family (dense, MoE, hybrid), a budget tight enough to take all three decisions
trains bitwise equal to no swap, and the runtime's stats count what the plan says it
recomputes and swaps; a budget below what any plan reaches is refused with the
smallest one that fits.
"""

from __future__ import annotations

import copy
import pickle
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import graphswap
from graphswap.hf.checkpoints import decoder_layers
from graphswap.hf.presets import preset_config
from graphswap.passes.plan_executor import PlanMismatchError, PlanMismatchWarning
from graphswap.planning import PlanSettingError, plan_memory
from graphswap.planning._budget import read_memory_budget, resolve_memory_budget
from graphswap.planning.trace import StepShape
from graphswap.runtime import is_recompute_wrapped, recompute_wrapper, unwrap_recompute
from graphswap.train.build import build, from_config
from graphswap.train.config import TrainerConfig

SHAPES = {"llama": (4096, 2), "qwen3_next": (1024, 4)}
"""Tokens a sequence and sequences a batch, enough that the tiny models' saves pass the
1 MiB swap threshold: the dense model's from 4096 tokens; the others' from 2048 (at 2 a
batch), where their eager attention costs a quarter of what it does at 4096; the
hybrid's linear attention runs a chunk at a time, so it takes its tokens as more
sequences, which it runs at once."""


def _shape(config: Any) -> tuple[int, int]:
    """``(seq_len, batch_size)`` of ``config``'s model type."""
    return SHAPES.get(config.model_type, (2048, 2))


def _cpu_step(config: Any, seq_len: int, batch_size: int) -> StepShape:
    """The fp32 CPU step of ``config``'s attention at that shape, as these tests run it."""
    return StepShape(
        seq_len=seq_len,
        batch_size=batch_size,
        dtype=torch.float32,
        attn_implementation=config._attn_implementation,
        device="cpu",
    )


def _plan(config: Any, budget: int) -> Any:
    return plan_memory(
        config,
        _cpu_step(config, *_shape(config)),
        activation_swap="budget",
        activation_memory_budget=budget,
    )


def _step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(
        0,
        model.config.vocab_size,
        _shape(model.config)[::-1],
        generator=torch.Generator().manual_seed(1),
    )
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _eval_step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, gradients and the returned cache's length of one step in eval mode, with
    ``use_cache`` at its default (on there)."""
    model.eval().zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, _shape(model.config)[::-1], generator=generator)
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    cache = output.cache if "cache" in output else output.past_key_values
    return output.loss.detach(), grads, cache.get_seq_length()


FAMILIES = {
    "dense": lambda: preset_config("tiny-llama", attn_implementation="sdpa"),
    "moe": lambda: preset_config("tiny", attn_implementation="eager"),
    "moe-mixtral": lambda: preset_config("tiny-mixtral", attn_implementation="sdpa"),
}


@pytest.fixture(params=[*FAMILIES, "hybrid"])
def family(request: pytest.FixtureRequest, tour_config: Callable[..., Any]) -> Any:
    if request.param == "hybrid":
        return tour_config("qwen3_next")
    return FAMILIES[request.param]()


def _options(config: Any) -> tuple[Any, ...]:
    """Every option the budget plan weighs (a budget of one byte weighs them all)."""
    with pytest.raises(PlanSettingError) as info:
        _plan(config, 1)
    return info.value.options  # type: ignore[attr-defined,no-any-return]


def _trains_as_planned(config: Any, budget: int, *, eval_too: bool = False) -> Any:
    """The budget mode at ``budget`` trains bitwise equal to no swap, and its stats
    count what its plan recomputes and swaps; returns that plan. ``eval_too``: so does
    a step in eval mode, where the cache is on (and holds each token once)."""
    trainer = TrainerConfig(
        activation_swap="budget",
        activation_memory_budget=budget,
        seq_len=_shape(config)[0],
        batch_size=_shape(config)[1],
        attn_implementation=config._attn_implementation,
    )
    torch.manual_seed(0)
    plain = from_config(config)
    torch.manual_seed(0)
    built = build(trainer, hf_config=config)
    assert built.plan_executor is not None
    plan = built.plan_executor.plan
    budgeted = built.model
    loss, grads = _step(plain)
    budget_loss, budget_grads = _step(budgeted)
    assert torch.equal(loss, budget_loss)
    assert grads.keys() == budget_grads.keys()
    assert all(torch.equal(grads[k], budget_grads[k]) for k in grads)
    stats = graphswap.rewrite_report(budgeted).manager.stats  # type: ignore[union-attr]
    assert stats.recomputed_bytes == plan.recomputed_bytes > 0
    assert stats.offloaded_bytes == plan.swapped_bytes
    layer = decoder_layers(budgeted)[1][0]
    # The whole layer is recomputed inside its swap; anything less, in wrapped submodules.
    assert plan.recompute == ("layer",) or any(is_recompute_wrapped(m) for m in layer.modules())
    if eval_too:
        loss, grads, length = _eval_step(plain)
        budget_loss, budget_grads, budget_length = _eval_step(budgeted)
        assert torch.equal(loss, budget_loss) and length == budget_length == _shape(config)[0]
        assert grads.keys() == budget_grads.keys()
        assert all(torch.equal(grads[k], budget_grads[k]) for k in grads)
    graphswap.unrewrite(budgeted)
    assert not any(is_recompute_wrapped(m) for m in budgeted.modules())
    return plan


@pytest.mark.parametrize("name", FAMILIES)
def test_the_smallest_budget_recomputes_whole_layers_and_changes_no_number(name: str) -> None:
    """At the smallest peak any plan reaches, each layer is recomputed whole inside its
    swap, which moves the layer's inputs; the last layer's are kept. (The hybrid takes
    all three decisions in the test below: its whole-layer plan costs a minute here.)"""
    config = FAMILIES[name]()
    config.num_hidden_layers = 2  # the first swaps, the last is kept
    smallest = min(o.peak_bytes for o in _options(config))
    # In eval mode too, once: tests/graphswap/hf/test_cache.py runs the families there.
    plan = _trains_as_planned(config, smallest, eval_too=name == "dense")
    assert plan.recompute == ("layer",) and plan.swapped_bytes > 0
    assert plan.timeline.peak_bytes <= smallest


def test_recomputing_between_the_matmuls_swaps_their_outputs_and_changes_no_number(
    family: Any,
) -> None:
    """Level 3: the matmul outputs are saved through the swap, but for the down
    projections' (the experts' run again in backward; a dense block's are never saved)."""
    config = family
    config.num_hidden_layers = 2
    level = ("norms", "mlp_memory_bound", "mlp_down")
    options = _options(config)
    peaks = {(o.recompute, o.swap): o.peak_bytes for o in options}
    budget = peaks[level, "auto"]
    assert budget < peaks[("norms", "mlp_memory_bound"), "auto"], "it fits only at this level"
    plan = _trains_as_planned(config, budget)
    assert plan.recompute == level and plan.swapped_bytes > 0


def test_a_budget_no_plan_meets_names_the_smallest_that_does() -> None:
    config = preset_config("tiny-llama", attn_implementation="sdpa")
    with pytest.raises(PlanSettingError, match=r"smallest peak any plan reaches is (\d+) bytes"):
        _plan(config, 1 << 20)


@pytest.mark.parametrize(
    ("value", "read"),
    [
        ("0.85", 0.85),  # as YAML's 0.85: a fraction, not 0 bytes
        (0.85, 0.85),
        (1.0, 1.0),
        ("2e7", 20_000_000),  # above 1: bytes, however spelled
        (2e7, 20_000_000),
        ("8e10", 8 * 10**10),
        (1, 1),
        ("120GiB", 120 << 30),
    ],
)
def test_a_budget_up_to_one_is_a_fraction_and_above_it_bytes(
    value: int | float | str, read: int | float
) -> None:
    got = read_memory_budget(value)
    assert (got, type(got)) == (read, type(read))


@pytest.mark.parametrize("value", ["1e400", float("inf"), float("nan"), "1e400GiB", 0, "0", -1])
def test_a_budget_that_is_no_finite_positive_size_is_refused_by_its_key(
    value: int | float | str,
) -> None:
    with pytest.raises(PlanSettingError) as info:
        read_memory_budget(value)
    assert info.value.setting == "activation_memory_budget"


def test_a_budget_above_the_devices_memory_is_refused_naming_that_memory() -> None:
    assert resolve_memory_budget("0.5", 1000) == 500
    assert resolve_memory_budget(1000, 1000) == 1000
    with pytest.raises(PlanSettingError, match=r"1001 bytes, more than the 1000 bytes .* of sim"):
        resolve_memory_budget(1001, 1000, device="sim")


def test_a_roomy_budget_keeps_everything() -> None:
    plan = _plan(preset_config("tiny-llama", attn_implementation="sdpa"), 1 << 40)
    assert (plan.recompute, plan.budget_swap, plan.swapped_bytes) == ((), "none", 0)
    assert plan.step_ratio == 1.0


def test_a_trainer_that_checkpoints_gets_whole_layers_whatever_the_budget() -> None:
    """The trainer's request to checkpoint every layer is honoured as the whole-layer
    level, the only one weighed, even where a roomy budget would recompute nothing; it is
    a decision of the budget mode alone."""
    config = preset_config("tiny-llama", attn_implementation="sdpa")
    shape = StepShape(seq_len=256, dtype=torch.float32, device="cpu")
    plan = plan_memory(
        config,
        shape,
        activation_swap="budget",
        activation_memory_budget=1 << 40,
        activation_checkpointing=True,
    )
    assert plan.recompute == ("layer",)
    assert [option.recompute for option in plan.budget_options] == [("layer",)]
    assert all(layer.recomputed == ("",) for layer in plan.layers)
    assert "recompute levels tried: layer" in " ".join(plan.assumptions)
    with pytest.raises(PlanSettingError, match="activation_checkpointing=True: is honoured by"):
        plan_memory(config, shape, activation_swap="auto", activation_checkpointing=True)


def test_recompute_wrapper_keeps_the_module_and_undoes_exactly() -> None:
    norm = torch.nn.LayerNorm(8)
    counted: list[tuple[int, int]] = []
    wrapped = recompute_wrapper(norm, counter=lambda n, b: counted.append((n, b)))
    assert wrapped is norm and isinstance(norm, torch.nn.LayerNorm)
    x = torch.randn(4, 8, requires_grad=True)
    reference = torch.nn.functional.layer_norm(x, (8,), norm.weight, norm.bias)
    out = norm(x)
    assert torch.equal(out, reference) and counted and counted[0][1] > 0
    unwrap_recompute(norm)
    copy = pickle.loads(pickle.dumps(recompute_wrapper(torch.nn.LayerNorm(8))))
    assert is_recompute_wrapped(copy) and isinstance(copy, torch.nn.LayerNorm)
    assert type(norm) is torch.nn.LayerNorm


def test_recompute_reads_inputs_as_saved_so_an_in_place_change_is_an_error() -> None:
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    recompute_wrapper(mlp)
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 2
    out = mlp(h).sum()
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_forward_without_backward_leaves_nothing_behind() -> None:
    import gc
    import weakref

    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    recompute_wrapper(mlp)
    x = torch.randn(4, 8, requires_grad=True)
    out = mlp(x)
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None


class _GatedMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(8, 16)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
        return func(*args, **(kwargs or {}))


def _backward_matmuls(
    module: torch.nn.Module, packed: list[torch.Tensor], *extra: torch.Tensor
) -> tuple[int, Any]:
    """Matmuls backward runs through ``module``, and its input's gradient; the saved-tensor
    hooks around the forward append to ``packed`` what they are handed."""
    x = torch.randn(4, 8, requires_grad=True, generator=torch.Generator().manual_seed(0))

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x, *extra).sum()
    with _CountMatmuls() as counted:
        out.backward()
    return counted.calls, x.grad


def test_save_matmuls_hands_the_matmul_outputs_to_the_outer_hooks_and_never_reruns_one() -> None:
    torch.manual_seed(0)
    reference = _GatedMLP()
    recomputed = copy.deepcopy(reference)
    between = copy.deepcopy(reference)
    recompute_wrapper(recomputed)
    recompute_wrapper(between, save_matmuls=True)
    plain_calls, plain_grad = _backward_matmuls(reference, [])
    recomputed_calls, recomputed_grad = _backward_matmuls(recomputed, [])
    packed: list[torch.Tensor] = []
    between_calls, between_grad = _backward_matmuls(between, packed)
    assert recomputed_calls > plain_calls, "plain recompute runs matmuls again"
    assert between_calls == plain_calls, "save_matmuls runs none again"
    assert torch.equal(between_grad, plain_grad) and torch.equal(recomputed_grad, plain_grad)
    for name in ("gate", "up", "down"):
        grads = [getattr(m, name).weight.grad for m in (reference, between)]
        assert torch.equal(*grads)
    outputs = [t for t in packed if t.shape[-1] == 16 or (t.shape == (4, 8) and t.requires_grad)]
    assert sum(t.shape == (4, 16) for t in outputs) == 2 and any(t.shape == (4, 8) for t in outputs)


class _RoutedMLP(_GatedMLP):
    """An expert: its down projection's output is saved by the routing-weight product."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * weight


@pytest.mark.parametrize("routed", [True, False], ids=["routed", "dense"])
def test_rerun_to_input_width_saves_only_the_widening_matmuls(routed: bool) -> None:
    """The down projection's output (as wide as the input) is not handed to the outer
    hooks: it runs again in backward where the routing-weight product saved it, and not
    at all in a dense block, where nothing did."""
    torch.manual_seed(0)
    reference = _RoutedMLP() if routed else _GatedMLP()
    rerun = recompute_wrapper(
        copy.deepcopy(reference), save_matmuls=True, rerun_to_input_width=True
    )
    weight = torch.rand(4, 1, requires_grad=True, generator=torch.Generator().manual_seed(2))
    extra = (weight,) if routed else ()
    plain_calls, plain_grad = _backward_matmuls(reference, [], *extra)
    packed: list[torch.Tensor] = []
    rerun_calls, rerun_grad = _backward_matmuls(rerun, packed, *extra)
    assert rerun_calls == plain_calls + routed, "only the down projection runs again"
    assert torch.equal(rerun_grad, plain_grad)
    for name in ("gate", "up", "down"):
        assert torch.equal(getattr(reference, name).weight.grad, getattr(rerun, name).weight.grad)
    assert sum(t.shape == (4, 16) for t in packed) == 2, "gate and up outputs are saved"
    inputs_and_down = [t for t in packed if t.shape == (4, 8) and t.requires_grad]
    assert len(inputs_and_down) == 1, "the region's input is saved, down's output is not"


def test_rerun_to_input_width_needs_save_matmuls() -> None:
    with pytest.raises(ValueError, match="set save_matmuls=True"):
        recompute_wrapper(_GatedMLP(), rerun_to_input_width=True)


def test_save_matmuls_raises_when_a_saved_matmul_output_was_changed_in_place() -> None:
    class Square(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.proj(x)
            return h, h * h

    module = recompute_wrapper(Square(), save_matmuls=True)
    h, squared = module(torch.randn(4, 8, requires_grad=True))
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        squared.sum().backward()


def test_save_matmuls_never_recomputes_from_a_matmul_output_changed_in_place() -> None:
    """A linear layer over a 3-d input hands its caller an ``_unsafe_view`` of the matmul
    output, with a version counter of its own. Changed in place, it changes the bytes
    the recompute reads back, even where no operator saved it (and plain PyTorch, which
    never reads it again, does not raise): an error, never a gradient from the changed
    bytes."""

    class Shifted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.proj(x)
            y = h + 1  # saves nothing: only ``y`` is saved, by the product
            return h, y * y

    module = recompute_wrapper(Shifted(), save_matmuls=True)
    h, out = module(torch.randn(2, 4, 8, requires_grad=True))
    with torch.no_grad():
        h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        out.sum().backward()


def test_recompute_raises_where_a_dropped_save_was_changed_in_place() -> None:
    """A whole region recomputed (no save kept) still raises where plain PyTorch
    raises: the recompute would otherwise regenerate the changed tensor as it was."""
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 8))
    x = torch.randn(2, 4, 8, requires_grad=True)
    kept: list[torch.Tensor] = []
    mlp[0].register_forward_hook(lambda _m, _a, out: kept.append(out))
    for wrap in (False, True):
        if wrap:
            recompute_wrapper(mlp)
        out = mlp(x).sum()
        with torch.no_grad():
            kept.pop().mul_(2)
        with pytest.raises(RuntimeError, match=r"modified by an in-?place operation"):
            out.backward()


def test_save_matmuls_leaves_nothing_behind_when_backward_never_runs() -> None:
    import gc
    import weakref

    packed: list[weakref.ref[torch.Tensor]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        held = t.clone()
        packed.append(weakref.ref(held))
        return held

    module = recompute_wrapper(_GatedMLP(), save_matmuls=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(torch.randn(4, 8, requires_grad=True))
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None and packed and all(r() is None for r in packed)


def test_the_planner_traces_whole_layer_checkpointing_with_attention_on_its_kernel() -> None:
    """The trainers' activation checkpointing, priced for comparison: each layer saves
    only its inputs, and backward runs the layer again, attention included, on the
    fused kernel its forward ran (not sdpa's math path: the checkpoint would find other
    saves and refuse)."""
    from graphswap.planning._trace import Event
    from graphswap.planning.saved_tensors import build_meta_model
    from graphswap.planning.trace import trace_step
    from graphswap.runtime.profile import device_profile

    config = preset_config("tiny-llama", attn_implementation="sdpa")
    config.num_hidden_layers = 2
    profile = device_profile("h200")
    plain, whole = (
        trace_step(build_meta_model(config, StepShape(seq_len=1024), recompute=kinds), profile)
        for kinds in ((), ("layer",))
    )

    def activations(trace: Any) -> list[int]:
        return [
            sum(s.storage_nbytes for s in layer.saves if not s.parameter)
            for layer in trace.saved.layers
        ]

    def compute(trace: Any) -> float:
        return sum(p for e, p in trace.events if e is Event.COMPUTE)

    assert whole.recomputed == (("",), ("",)) and min(whole.recomputed_bytes) > 0
    assert all(w * 4 < p for w, p in zip(activations(whole), activations(plain), strict=True))
    assert compute(whole) > compute(plain)
    assert whole.attention_timing == plain.attention_timing == ("causal",)


def _options_at(config: Any, seq_len: int, batch_size: int) -> tuple[Any, ...]:
    """Every option a budget plan weighs at that shape, in fp32."""
    with pytest.raises(PlanSettingError) as info:
        plan_memory(
            config,
            _cpu_step(config, seq_len, batch_size),
            activation_swap="budget",
            activation_memory_budget=1,
        )
    return info.value.options  # type: ignore[attr-defined,no-any-return]


@pytest.fixture(scope="module")
def recomputing_norms() -> Callable[[], Any]:
    """Factory: a tiny dense model in budget mode whose plan (512 tokens, fp32)
    recomputes the norms and swaps nothing: a plan checked through no swapped save."""
    config = preset_config("tiny-llama", attn_implementation="sdpa")
    config.num_hidden_layers = 2
    norms = min(o.peak_bytes for o in _options_at(config, 512, 2) if o.recompute == ("norms",))

    def make() -> Any:
        trainer = TrainerConfig(
            activation_swap="budget",
            activation_memory_budget=norms,
            seq_len=512,
            batch_size=2,
            attn_implementation="sdpa",
        )
        torch.manual_seed(0)
        built = build(trainer, hf_config=copy.deepcopy(config))
        assert built.plan_executor is not None
        plan = built.plan_executor.plan
        assert plan.recompute == ("norms",) and plan.swapped_bytes == 0
        return built

    return make


def _steps(model: torch.nn.Module, seq_len: int, autocast: bool = False) -> list[str]:
    """Two steps at ``seq_len`` (under bf16 autocast with ``autocast``), then the rewrite
    report's check: the plan-mismatch warnings they raised, and check()'s error."""
    ids = torch.randint(0, model.config.vocab_size, (2, seq_len))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        try:
            graphswap.rewrite_report(model).check()
            error = ""
        except PlanMismatchError as raised:
            error = str(raised)
    said = [str(w.message) for w in caught if issubclass(w.category, PlanMismatchWarning)]
    return [*said, error]


def test_a_step_as_planned_matches_its_plan_layer_by_layer(
    recomputing_norms: Callable[[], Any],
) -> None:
    built = recomputing_norms()
    assert _steps(built.model, 512) == [""], "no warning, and check() passes"
    stats = built.swap_manager.stats
    assert stats.recomputed_bytes == 2 * built.plan_executor.plan.recomputed_bytes
    assert stats.plan_mismatches == 0


def test_a_step_under_autocast_warns_once_naming_the_dtype(
    recomputing_norms: Callable[[], Any],
) -> None:
    """HF Trainer's and TRL's ``bf16=True`` around fp32 weights: a plan that swaps
    nothing still finds the step is not the one planned."""
    *warned, error = _steps(recomputing_norms().model, 512, autocast=True)
    assert len(warned) == 1, "warned once per model"
    assert "activation_swap: budget:" in warned[0] and "dtype: float32" in warned[0]
    assert "the step computes in bfloat16: autocast's dtype" in warned[0]
    assert error.startswith("activation_swap: budget:") and "did not match the plan" in error


def test_whole_layer_recompute_under_autocast_warns_naming_the_bytes() -> None:
    """The whole layer recomputed saves only its inputs, which autocast leaves in fp32:
    the step differs from the plan only in what the recompute drops, and that warns at
    the next step's start."""
    config = preset_config("tiny-llama", attn_implementation="sdpa")
    config.num_hidden_layers = 2
    smallest = min(o.peak_bytes for o in _options_at(config, 512, 2))
    trainer = TrainerConfig(
        activation_swap="budget",
        activation_memory_budget=smallest,
        seq_len=512,
        batch_size=2,
        attn_implementation="sdpa",
    )
    built = build(trainer, hf_config=config)
    assert built.plan_executor is not None and built.plan_executor.plan.recompute == ("layer",)
    *warned, error = _steps(built.model, 512, autocast=True)
    assert len(warned) == 1 and re.search(r"recomputed \d+ bytes in one forward", warned[0])
    assert "layer forward(s) did not match the plan" in error


def test_a_longer_step_than_planned_warns_naming_both_lengths(
    recomputing_norms: Callable[[], Any],
) -> None:
    *warned, error = _steps(recomputing_norms().model, 1024)
    assert len(warned) == 1 and "seq_len: 512" in warned[0]
    assert re.search(r"is \(2, 1024(, \d+)*\)", warned[0])
    assert "did not match the plan" in error
