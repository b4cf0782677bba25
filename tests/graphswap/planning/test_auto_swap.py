"""``activation_swap: layer`` and ``auto`` end to end on CPU: the runtime numbers saves
as the trace does, the numbers do not change, and what leaves the device is what the
plan says (measured by the independent tracker and by the swap's own stats)."""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import qwen3_moe_config
from graphswap.passes import PassSettingError
from graphswap.passes.plan_executor import (
    PlanExecutor,
    PlanMismatchError,
    PlanMismatchWarning,
    PlanPolicy,
)
from graphswap.planning import MemoryPlan
from graphswap.planning.measure import ResidentActivationTracker, output_tensors
from graphswap.planning.saved_tensors import trace_saved_tensors
from graphswap.planning.trace import StepShape, StepTrace, plan_step
from graphswap.runtime import SwapManager, swap_wrapper
from graphswap.runtime.policy import CheckpointPolicy
from graphswap.train.build import BuiltModel, build
from graphswap.train.cli._memory import format_auto_report
from graphswap.train.config import ConfigError, TrainerConfig

SEQ = 512
"""The shortest sequence at which sdpa saves tensors of the 1 MiB swap threshold."""

MIDDLE = {"swap_bandwidth_gbps": 2.0, "swap_tflops": 0.5}
"""A link at which each layer's copy hides for some of its swappable tensors, not all."""


def _ids(seq: int = SEQ, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(1))


def _build(mode: str, **settings: Any) -> BuiltModel:
    torch.manual_seed(0)
    return build(TrainerConfig(activation_swap=mode, **settings))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def fast_link_plan(slow_compute_at: Callable[[float], StepTrace]) -> MemoryPlan:
    """``auto`` on the tiny step (4 layers, sdpa, batch 2 x seq 512, float32, CPU) at a link
    so fast that it swaps what layer swap would."""
    return plan_step(qwen3_moe_config("tiny"), slow_compute_at(1e9), activation_swap="auto")


class _Recorder:
    """A policy that keeps everything and records what the runtime asks it."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, tuple[int, ...], torch.dtype]] = []

    def decide(self, t: torch.Tensor, index: int) -> CheckpointPolicy:
        self.asked.append((index, tuple(t.shape), t.dtype))
        return CheckpointPolicy.MUST_SAVE

    def __call__(self, t: torch.Tensor) -> CheckpointPolicy:
        raise AssertionError("the runtime must call decide(t, index)")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_runtime_numbers_saves_as_the_trace_does(attn: str, one_thread: None) -> None:
    """Every pack call counts, parameters and repeated saves of one storage too: the
    index a policy is told finds the traced save, with its shape and dtype."""
    config = qwen3_moe_config("tiny", num_hidden_layers=2, attn_implementation=attn)
    model = build_model(config).train()
    manager = SwapManager()
    recorders = [_Recorder() for _ in model.model.layers]
    for i, (layer, recorder) in enumerate(zip(model.model.layers, recorders, strict=True)):
        swap_wrapper(layer, manager=manager, policy=recorder, name=f"model.layers.{i}")
    ids = _ids(128)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    trace = trace_saved_tensors(
        config,
        StepShape(
            seq_len=128, batch_size=2, dtype=torch.float32, attn_implementation=attn, device="cpu"
        ),
    )
    for recorder, layer in zip(recorders, trace.layers, strict=True):
        # Kept tensors make no swap entry, so every non-parameter save is asked about.
        expected = [(s.index, s.shape, s.dtype) for s in layer.saves if not s.parameter]
        assert recorder.asked == expected
        assert any(s.parameter for s in layer.saves)  # numbered, never asked


def _train_steps(mode: str, attn: str, steps: int = 2) -> tuple[list[torch.Tensor], list[Any]]:
    settings = MIDDLE if mode == "auto" else {}
    built = _build(mode, num_layers=2, attn_implementation=attn, **settings)
    model = built.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for _ in range(steps):
        loss = model(input_ids=_ids(), labels=_ids(), use_cache=False).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if mode != "none":
        assert built.swap_manager is not None
        assert built.swap_manager.stats.offloaded_bytes > 0, "the swap moved nothing"
    return losses, grads


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_layer_and_auto_train_bitwise_equal_to_none(attn: str, one_thread: None) -> None:
    plain_losses, plain_grads = _train_steps("none", attn)
    for mode in ("layer", "auto"):
        losses, grads = _train_steps(mode, attn)
        assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True)), mode
        for step, plain in zip(grads, plain_grads, strict=True):
            assert step.keys() == plain.keys()
            assert all(torch.equal(step[n], plain[n]) for n in step), mode


def _resident_and_stats(built: BuiltModel) -> tuple[int, dict[str, int]]:
    """Saved bytes left on the device at the end of forward (the independent tracker),
    and the swap's own offloaded bytes per group."""
    tracker = ResidentActivationTracker("cpu")
    with tracker.track():
        out = built.model(input_ids=_ids(), labels=_ids(), use_cache=False)
    manager = built.swap_manager
    if manager is not None:
        manager.synchronize()
    resident = tracker.resident_bytes(exclude=output_tensors(out))
    out.loss.backward()
    if manager is None:
        return resident, {}
    return resident, {k: v.offloaded_bytes for k, v in manager.stats.per_group.items()}


Run = Callable[[str], tuple[int, dict[str, int]]]


@pytest.fixture(scope="module")
def run() -> Run:
    """``run(mode)``: :func:`_resident_and_stats` of the default model with ``mode``, made
    once for the module (called from tests, which run it on one thread)."""
    return functools.cache(lambda mode: _resident_and_stats(_build(mode)))


def test_layer_frees_every_swappable_byte_but_the_last_layers(
    run: Run, tiny_trace: StepTrace, one_thread: None
) -> None:
    (none, _), (layer, offloaded) = run("none"), run("layer")
    attention, _ = run("attention")
    plan = plan_step(qwen3_moe_config("tiny"), tiny_trace, activation_swap="layer")
    assert none - layer >= none - attention > 0
    assert none - layer == pytest.approx(plan.swapped_bytes, rel=0.01)
    assert sum(offloaded.values()) == plan.swapped_bytes
    assert offloaded["model.layers.3"] == 0  # kept: its backward starts at once


def test_auto_with_a_very_fast_link_swaps_what_layer_swaps(run: Run, one_thread: None) -> None:
    layer = run("layer")[1]
    built = _build("auto", swap_bandwidth_gbps=1e9)
    _, auto = _resident_and_stats(built)
    assert auto == layer and sum(auto.values()) > 0
    assert built.plan_executor is not None
    assert built.plan_executor.plan.swapped_bytes == built.plan_executor.plan.layer_swappable_bytes


def test_auto_with_a_very_slow_link_swaps_nothing_and_says_so(run: Run, one_thread: None) -> None:
    built = _build("auto", swap_bandwidth_gbps=1e-3)
    resident, offloaded = _resident_and_stats(built)
    assert resident == run("none")[0] and sum(offloaded.values()) == 0
    assert built.plan_executor is not None
    report = format_auto_report(built.plan_executor.to_dict())
    assert "auto swaps nothing: the smallest swappable tensor (1.00 MiB, model.layers.0)" in report
    assert report.count("none swapped") == 3


def test_auto_in_between_swaps_exactly_the_planned_bytes_and_every_copy_hides(
    run: Run, one_thread: None
) -> None:
    built = _build("auto", **MIDDLE)
    resident, offloaded = _resident_and_stats(built)
    assert built.plan_executor is not None
    plan = built.plan_executor.plan
    assert 0 < plan.swapped_bytes < plan.layer_swappable_bytes
    assert [layer.verdict() for layer in plan.layers] == ["hides"] * 3 + ["kept on device"]
    for layer in plan.layers[:-1]:
        assert layer.copy_seconds <= 0.9 * layer.forward_window
        assert layer.forward_stall == layer.backward_stall == 0
        assert offloaded[layer.name] == pytest.approx(layer.swappable_bytes, rel=0.01)
    assert run("none")[0] - resident == pytest.approx(plan.swapped_bytes, rel=0.01)
    built.plan_executor.check()


def _run_at_another_shape(model: torch.nn.Module) -> list[warnings.WarningMessage]:
    """Two steps at seq 256 of a model planned for 512; the warnings they raised."""
    ids = _ids(256)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return [w for w in caught if issubclass(w.category, PlanMismatchWarning)]


def _check_names_both_shapes(message: str) -> None:
    assert message.startswith("activation_swap: auto: ")
    assert "seq_len: 512, batch_size: 2, dtype: float32" in message
    assert re.search(r"is \(2, 256(, \d+)+\) float32", message)
    assert re.search(r"expects \(2, 512(, \d+)+\) float32", message)


def test_a_model_run_at_another_shape_keeps_the_tensors_and_check_names_the_settings(
    one_thread: None,
) -> None:
    built = _build("auto", num_layers=2, swap_bandwidth_gbps=1e9)
    caught = _run_at_another_shape(built.model)
    assert built.swap_manager is not None and built.plan_executor is not None
    assert built.swap_manager.stats.offloaded_bytes == 0
    assert built.plan_executor.mismatched_tensors > 0
    assert built.swap_manager.stats.plan_mismatches == built.plan_executor.mismatched_tensors
    assert len(caught) == 1, "warned once per model, not per save or per step"
    _check_names_both_shapes(str(caught[0].message))
    with pytest.raises(PlanMismatchError) as info:
        built.plan_executor.check()
    _check_names_both_shapes(str(info.value))


def test_a_model_from_the_builders_run_at_another_shape_is_reported(
    tmp_path: Any, one_thread: None
) -> None:
    """from_config / from_pretrained hand back only the model: the user learns of the
    mismatch from a warning, the stats, and the rewrite report's check()."""
    from graphswap import rewrite_report
    from graphswap.train.build import from_config, from_pretrained

    hf_config = qwen3_moe_config("tiny", num_hidden_layers=2)
    planned = TrainerConfig(activation_swap="auto", swap_bandwidth_gbps=1e9)
    from_config(hf_config).save_pretrained(tmp_path)
    for model in (
        from_config(hf_config, trainer_config=planned),
        from_pretrained(tmp_path, trainer_config=planned),
    ):
        caught = _run_at_another_shape(model)
        assert len(caught) == 1
        _check_names_both_shapes(str(caught[0].message))
        report = rewrite_report(model)
        assert report is not None
        stats = report.manager.stats
        assert stats.offloaded_bytes == 0 and stats.plan_mismatches > 0
        assert stats.per_group["model.layers.0"].plan_mismatches > 0
        with pytest.raises(PlanMismatchError) as info:
            report.check()
        _check_names_both_shapes(str(info.value))


def test_a_model_run_at_its_planned_shape_passes_the_report_check(one_thread: None) -> None:
    built = _build("auto", num_layers=2, swap_bandwidth_gbps=1e9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMismatchWarning)
        built.model(input_ids=_ids(), labels=_ids(), use_cache=False).loss.backward()
    report = built.infrastructure.report
    assert report is not None and report.manager.stats.offloaded_bytes > 0
    assert report.manager.stats.plan_mismatches == 0
    report.check()


@pytest.fixture
def fake_tp_mesh() -> Iterator[Any]:
    """Rank 0 of a two-rank world whose collectives do nothing: the real tensor-parallel
    pass shards the model, and the saves are those of a real rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_auto_under_tensor_parallel_plans_one_ranks_saves(
    fake_tp_mesh: Any, one_thread: None
) -> None:
    config = TrainerConfig(
        activation_swap="auto",
        tp_size=2,
        num_layers=2,
        attn_implementation="eager",
        swap_bandwidth_gbps=1e9,
    )
    built = build(config, mesh=fake_tp_mesh)
    built.model(input_ids=_ids(), labels=_ids(), use_cache=False).loss.backward()
    assert built.swap_manager is not None and built.plan_executor is not None
    planned = built.plan_executor.plan.layers[0]
    assert planned.swappable_bytes > 0 and built.plan_executor.plan.tp_size == 2
    assert built.swap_manager.stats.offloaded_bytes == planned.swappable_bytes
    built.plan_executor.check()


def test_the_plan_is_in_the_prefetch_graph_nodes() -> None:
    built = _build("auto", num_layers=3, **MIDDLE)
    report = built.infrastructure.report
    assert report is not None and built.plan_executor is not None
    assert str(report) == "auto_swap: 3 modules wrapped, 2 prefetch links"
    nodes = {node["id"]: node for node in report.to_dict()["prefetch_graph"]["nodes"]}
    first, last = nodes["model.layers.0"], nodes["model.layers.2"]
    planned = built.plan_executor.plan.layers[0]
    assert first["auto_swapped_saves"] == ",".join(str(s.index) for s in planned.swapped_saves)
    assert (first["auto_swapped_bytes"], first["auto_kept_bytes"]) == (
        planned.swappable_bytes,
        planned.kept_bytes,
    )
    assert first["auto_verdict"] == "hides" and first["policy"] == "auto_swap_policy"
    assert first["auto_copy_ms"] < first["auto_forward_window_ms"]
    assert first["auto_copy_ms"] < first["auto_backward_window_ms"]
    assert (last["auto_swapped_saves"], last["auto_verdict"]) == ("-", "kept on device")


def test_the_policy_needs_the_save_index(fast_link_plan: MemoryPlan) -> None:
    policy = PlanPolicy(fast_link_plan.layers[0])
    with pytest.raises(TypeError, match=r"calls decide\(t, index\)"):
        policy(torch.zeros(2))
    kept = next(i for i in range(len(policy.expected)) if i not in policy.planned)
    kept_shape, kept_dtype = policy.expected[kept]
    assert policy.decide(torch.zeros(kept_shape, dtype=kept_dtype), kept) is (
        CheckpointPolicy.MUST_SAVE
    )
    index, shape, dtype = next(iter((i, *p) for i, p in policy.planned.items()))
    assert policy.decide(torch.zeros(shape, dtype=dtype), index) is CheckpointPolicy.MUST_SWAP
    wrong = torch.zeros(shape, dtype=torch.bfloat16)
    assert policy.decide(wrong, index) is CheckpointPolicy.MUST_SAVE
    assert policy.mismatched_tensors == 1


def test_a_plan_for_another_depth_is_refused_before_anything_changes(
    fast_link_plan: MemoryPlan,
) -> None:
    from graphswap.rewriting.apply import HierarchyError, rewrite

    auto = PlanExecutor(fast_link_plan, made_for="a test")
    model = build_model(qwen3_moe_config("tiny", num_hidden_layers=3))
    with pytest.raises(HierarchyError, match=r"has 3 decoder layers but the auto plan .* for 4"):
        rewrite(model, [auto.rule()])
    assert not any(type(m).__name__.startswith("Swap") for m in model.modules())


def test_a_budget_plan_is_named_budget_in_what_it_says(
    fast_link_plan: MemoryPlan, one_thread: None
) -> None:
    """PlanExecutor carries out budget plans too: its refusal, its warning, its check and the
    report train prints name the mode planned, not auto."""
    from graphswap.rewriting.apply import HierarchyError, rewrite

    plan = dataclasses.replace(
        fast_link_plan, activation_swap="budget", activation_memory_budget=1 << 40
    )
    budget = PlanExecutor(plan, made_for="seq_len: 512, batch_size: 2, dtype: float32")
    with pytest.raises(HierarchyError, match=r"but the budget plan was made for 4"):
        rewrite(build_model(qwen3_moe_config("tiny", num_hidden_layers=3)), [budget.rule()])
    model = build_model(qwen3_moe_config("tiny"))
    rewrite(model, [budget.rule()])
    [caught] = _run_at_another_shape(model)
    assert str(caught.message).startswith("activation_swap: budget: ")
    with pytest.raises(PlanMismatchError, match=r"^activation_swap: budget: "):
        budget.check()
    assert format_auto_report(budget.to_dict()).startswith("activation_swap: budget, planned")


@pytest.mark.compat
def test_the_released_report_method_warns_and_renders_what_train_prints(
    fast_link_plan: MemoryPlan,
) -> None:
    """0.1.0's ``AutoSwap.format_report`` (``PlanExecutor``'s now), until 0.3."""
    auto = PlanExecutor(fast_link_plan, made_for="a test")
    with pytest.warns(DeprecationWarning, match=r"format_report .*format_auto_report") as caught:
        assert auto.format_report() == format_auto_report(auto.to_dict())
    assert caught[0].filename == __file__, "the warning points at the caller's line"


def test_measure_needs_a_cuda_device() -> None:
    from graphswap.train.preflight import check_inputs

    config = TrainerConfig(activation_swap="auto", swap_bandwidth_gbps="measure", device="cpu")
    with pytest.raises(ConfigError, match=r"^swap_bandwidth_gbps: measure times a pinned copy"):
        check_inputs(config)
    with pytest.raises(
        PassSettingError, match=r"^swap_bandwidth_gbps: measure times .* training runs on cpu"
    ):
        build(dataclasses.replace(config, num_layers=1))


@pytest.mark.cuda
def test_measure_times_the_host_link_each_way() -> None:
    from graphswap.passes.plan_executor import measure_copy_bandwidth

    measured = measure_copy_bandwidth(torch.device("cuda"))
    assert measured.device_to_host_gbps > 0 and measured.host_to_device_gbps > 0
    assert measured.gbps == min(measured.device_to_host_gbps, measured.host_to_device_gbps)
