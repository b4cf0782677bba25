"""Every TrainerConfig field changes what runs (P1: the origin dropped a distributed-setup
argument on the way to the builder, which silently skipped the module replacement).

Each field has one test that changes it and observes the difference from outside,
through the public entry points only: the pass plan (``graphswap.passes.pass_plan``), the
built model (``graphswap.train.build.build``), the training run
(``graphswap.train.trainer.train``: losses, measured activations, applied passes, swap
statistics), the files ``graphswap train`` writes, or an error that names the field.
``test_every_field_has_a_behaviour_case`` fails when a field is added without one.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from graphswap import passes
from graphswap.runtime.sim import SimulatedAccelerator
from graphswap.train.build import build
from graphswap.train.config import ConfigError, TrainerConfig
from graphswap.train.trainer import TrainResult, train

CASES: dict[str, str] = {}
"""Field -> the test that shows it changes what runs."""

Test = TypeVar("Test", bound=Callable[..., None])


def case(*fields: str) -> Callable[[Test], Test]:
    """Register a test as the behaviour case of ``fields``."""

    def register(test: Test) -> Test:
        for field in fields:
            assert field not in CASES, f"{field} has two cases: {CASES[field]}, {test.__name__}"
            CASES[field] = test.__name__
        return test

    return register


def test_every_field_has_a_behaviour_case() -> None:
    missing = sorted(set(TrainerConfig.keys()) - set(CASES))
    assert not missing, f"TrainerConfig fields without a behaviour case here: {missing}"
    assert set(CASES) <= set(TrainerConfig.keys())


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> TrainerConfig:
    """One tiny layer, two short steps on CPU: every run here takes about a second."""
    output_dir = tmp_path_factory.mktemp("out")
    return TrainerConfig(
        num_layers=1, seq_len=16, batch_size=1, steps=2, device="cpu", output_dir=str(output_dir)
    )


@pytest.fixture(scope="module")
def base_run(base: TrainerConfig) -> TrainResult:
    return train(base, progress=False)


@pytest.fixture(scope="module")
def swap_base(base: TrainerConfig) -> TrainerConfig:
    """Two layers at a shape whose attention tensors reach the 1 MiB swap threshold (the
    last layer keeps its tensors on device, so one layer alone swaps nothing)."""
    return dataclasses.replace(base, num_layers=2, seq_len=512, batch_size=2, steps=1)


@pytest.fixture(scope="module")
def swap_base_run(swap_base: TrainerConfig) -> TrainResult:
    """``swap_base`` without swap: what the swap modes' runs are compared with."""
    return run(swap_base)


def run(config: TrainerConfig, **changes: Any) -> TrainResult:
    return train(dataclasses.replace(config, **changes), progress=False)


# The swap and its settings.


@case("activation_swap")
def test_activation_swap_offloads_without_changing_the_losses(
    swap_base: TrainerConfig, swap_base_run: TrainResult
) -> None:
    plain, swapped = swap_base_run, run(swap_base, activation_swap="attention")
    assert (plain.applied_passes, swapped.applied_passes) == ([], ["swap"])
    assert swapped.swap["offloaded_bytes"] > 0
    assert swapped.resident_activation_bytes < plain.resident_activation_bytes
    assert swapped.losses == plain.losses


@case("activation_memory_budget")
def test_activation_memory_budget_decides_what_budget_recomputes(
    swap_base: TrainerConfig, swap_base_run: TrainResult
) -> None:
    plain = swap_base_run
    with pytest.raises(passes.PassSettingError) as refused:
        run(swap_base, activation_swap="budget", activation_memory_budget=1)
    found = re.search(r"smallest peak any plan reaches is (\d+) bytes", str(refused.value))
    assert found is not None, "a budget no plan meets names the smallest one that does"
    plans = {}
    for budget in ("1TiB", int(found.group(1))):
        result = run(swap_base, activation_swap="budget", activation_memory_budget=budget)
        assert result.losses == plain.losses
        assert result.auto_swap is not None
        plans[budget] = result.auto_swap["plan"]
    roomy, tight = plans.values()
    assert roomy["recompute"] == [] and roomy["budget_swap"] == "none"
    assert tight["recompute"] and tight["recomputed_bytes"] > 0
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(swap_base, activation_swap="budget")
    assert info.value.key == "activation_memory_budget", "budget needs one"
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(swap_base, activation_memory_budget="1GiB")
    assert info.value.key == "activation_memory_budget", "only budget reads it"


@case("swap_prefetch_depth")
def test_swap_prefetch_depth_reaches_the_swap_manager(base: TrainerConfig) -> None:
    swap = dataclasses.replace(base, activation_swap="attention", num_layers=3)
    depths = []
    for depth in (1, 2):
        manager = build(dataclasses.replace(swap, swap_prefetch_depth=depth)).swap_manager
        assert manager is not None
        depths.append(manager.swap_prefetch_depth)
    assert depths == [1, 2]


@case("swap_offload_lag")
def test_swap_offload_lag_reaches_the_swap_manager(base: TrainerConfig) -> None:
    swap = dataclasses.replace(base, activation_swap="attention", num_layers=3)
    lags = []
    for lag in (0, 2):
        manager = build(dataclasses.replace(swap, swap_offload_lag=lag)).swap_manager
        assert manager is not None
        lags.append(manager.swap_offload_lag)
    assert lags == [0, 2]
    unset = build(swap).swap_manager
    assert unset is not None and unset.swap_offload_lag == 1
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(base, swap_offload_lag=2)
    assert info.value.key == "swap_offload_lag"


AUTO = {
    "swap_bandwidth_gbps": 2.0,
    "swap_tflops": 0.25,
    "swap_hide_margin": 0.1,
    "swap_offload_lag": 1,
}
"""An auto plan that swaps part of what it could (3 of the 6 MiB of ``swap_base``), so
that each setting can move it either way."""


def planned_bytes(config: TrainerConfig, **changes: Any) -> int:
    auto = dataclasses.replace(config, activation_swap="auto", **{**AUTO, **changes})
    built = build(auto)
    assert built.plan_executor is not None
    return int(built.plan_executor.to_dict()["swapped_bytes"])


@case("swap_bandwidth_gbps")
def test_swap_bandwidth_gbps_decides_what_auto_swaps(swap_base: TrainerConfig) -> None:
    assert planned_bytes(swap_base, swap_bandwidth_gbps=1e9) > planned_bytes(swap_base) > 0
    assert planned_bytes(swap_base, swap_bandwidth_gbps=0.001) == 0


@case("swap_tflops")
def test_swap_tflops_decides_what_auto_swaps(swap_base: TrainerConfig) -> None:
    """Slower compute leaves more time for the copies to hide behind."""
    assert planned_bytes(swap_base, swap_tflops=0.125) > planned_bytes(swap_base) > 0


@case("swap_hide_margin")
def test_swap_hide_margin_decides_what_auto_swaps(swap_base: TrainerConfig) -> None:
    assert 0 < planned_bytes(swap_base, swap_hide_margin=0.5) < planned_bytes(swap_base)
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(swap_base, swap_hide_margin=0.5)
    assert info.value.key == "swap_hide_margin", "only activation_swap: auto reads it"


# The loss head.


@case("loss_head")
def test_loss_head_chunked_computes_the_loss_over_chunks(
    base: TrainerConfig, base_run: TrainResult
) -> None:
    chunked = dataclasses.replace(base, loss_head="chunked", loss_head_chunk_size=8)
    built = build(chunked)
    assert built.infrastructure.loss_head_chunk_size == 8
    ids = torch.zeros(1, 16, dtype=torch.long)
    assert built.model(input_ids=ids, labels=ids).logits is None
    assert build(base).model(input_ids=ids, labels=ids).logits is not None
    losses = run(chunked).losses
    assert losses == pytest.approx(base_run.losses, rel=1e-6) and losses != []


@case("loss_head_chunk_size")
def test_loss_head_chunk_size_reaches_the_head(base: TrainerConfig) -> None:
    chunked = dataclasses.replace(base, loss_head="chunked")
    sizes = [
        build(
            dataclasses.replace(chunked, loss_head_chunk_size=size)
        ).infrastructure.loss_head_chunk_size
        for size in (1, 4096)
    ]
    assert sizes == [1, 4096]
    assert build(chunked).infrastructure.loss_head_chunk_size == 1024, "the default"
    for bad in ({"loss_head_chunk_size": 0}, {"loss_head": "full", "loss_head_chunk_size": 8}):
        with pytest.raises(ConfigError) as info:
            dataclasses.replace(chunked, **bad)
        assert info.value.key == "loss_head_chunk_size"


# The model.


@case("model")
def test_model_preset_sets_the_shape(base: TrainerConfig) -> None:
    def hidden_size(model: str) -> int:
        built = build(dataclasses.replace(base, model=model), device="meta")
        return int(built.model.get_input_embeddings().weight.shape[1])

    assert (hidden_size("tiny"), hidden_size("qwen3-30b-a3b")) == (128, 2048)


@case("model_path")
def test_model_path_trains_from_the_checkpoint_weights(base: TrainerConfig, tmp_path: Path) -> None:
    saved = build(base).model
    with torch.no_grad():
        saved.get_input_embeddings().weight.fill_(0.25)
    saved.save_pretrained(tmp_path)
    loaded = build(dataclasses.replace(base, model_path=str(tmp_path))).model
    assert bool((loaded.get_input_embeddings().weight == 0.25).all())
    with pytest.raises(ConfigError) as info:
        train(dataclasses.replace(base, model_path=str(tmp_path / "missing")), progress=False)
    assert info.value.key == "model_path"


@case("num_layers")
def test_num_layers_sets_the_depth(base: TrainerConfig) -> None:
    depths = [
        len(build(dataclasses.replace(base, num_layers=n)).model.model.layers) for n in (1, 2)
    ]
    assert depths == [1, 2]


@case("rope_factor")
def test_rope_factor_stretches_the_models_window(base: TrainerConfig) -> None:
    """YaRN by the factor over the model's own positions, as plan-memory --rope-factor
    plans it; no factor, the model as its config has it."""
    plain = build(base).model.config
    stretched = build(dataclasses.replace(base, rope_factor=4.0)).model.config
    assert stretched.max_position_embeddings == 4 * plain.max_position_embeddings
    assert stretched.rope_parameters["factor"] == 4.0
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(base, rope_factor=1.0)
    assert info.value.key == "rope_factor"


@case("attn_implementation")
def test_eager_attention_saves_more_than_sdpa(base: TrainerConfig, base_run: TrainResult) -> None:
    """Eager attention saves the seq x seq probabilities for backward; sdpa does not."""
    eager = run(base, attn_implementation="eager")
    assert (base_run.attn_implementation, eager.attn_implementation) == ("sdpa", "eager")
    assert eager.resident_activation_bytes > base_run.resident_activation_bytes


@case("dtype")
def test_bfloat16_builds_and_saves_in_bfloat16(base: TrainerConfig, base_run: TrainResult) -> None:
    bf16 = run(base, dtype="bfloat16")
    assert bf16.resident_activation_bytes < base_run.resident_activation_bytes
    assert bf16.losses != base_run.losses
    assert {
        p.dtype for p in build(dataclasses.replace(base, dtype="bfloat16")).model.parameters()
    } == {torch.bfloat16}


# The training loop.


@case("steps")
def test_steps_is_the_number_of_losses(base: TrainerConfig, base_run: TrainResult) -> None:
    assert len(base_run.losses) == 2
    assert len(run(base, steps=3).losses) == 3


@case("lr")
def test_lr_changes_the_updates(base: TrainerConfig, base_run: TrainResult) -> None:
    faster = run(base, lr=1e-1)
    assert faster.losses[0] == base_run.losses[0], "the first loss comes before any update"
    assert faster.losses[1] != base_run.losses[1]


@case("seed")
def test_seed_changes_the_initial_model_and_data(
    base: TrainerConfig, base_run: TrainResult
) -> None:
    assert run(base, seed=1).losses[0] != base_run.losses[0]
    assert run(base).losses == base_run.losses, "the same seed repeats the run exactly"


@case("seq_len")
def test_seq_len_sets_the_tokens_per_step(base: TrainerConfig, base_run: TrainResult) -> None:
    longer = run(base, seq_len=32)
    assert longer.resident_activation_bytes > base_run.resident_activation_bytes
    assert longer.losses != base_run.losses


@case("batch_size")
def test_batch_size_sets_the_sequences_per_step(base: TrainerConfig, base_run: TrainResult) -> None:
    larger = run(base, batch_size=2)
    assert larger.resident_activation_bytes > base_run.resident_activation_bytes
    assert larger.losses != base_run.losses


@case("data")
def test_data_trains_on_the_file(
    base: TrainerConfig, base_run: TrainResult, tmp_path: Path
) -> None:
    text = tmp_path / "text.txt"
    text.write_text("graphswap trains on local text. " * 20)
    assert run(base, data=str(text)).losses != base_run.losses
    with pytest.raises(ConfigError) as info:
        run(base, data=str(tmp_path / "missing.txt"))
    assert info.value.key == "data"


@case("device")
def test_device_chooses_where_the_model_trains(base: TrainerConfig, base_run: TrainResult) -> None:
    assert base_run.device == "cpu"
    if torch.cuda.is_available():
        assert run(base, device="cuda").device.startswith("cuda")
        return
    with pytest.raises(ConfigError) as info:
        run(base, device="cuda")
    assert info.value.key == "device"


def test_a_simulated_device_clocks_every_step_on_its_profile(base: TrainerConfig) -> None:
    result = run(base, device="sim:h100,link_gbps=10", activation_swap="attention")
    assert result.clock is not None and result.clock["profile"] == "h100 (custom)"
    assert len(result.clock_step_seconds) == base.steps
    assert result.clock["step_seconds"] >= result.clock["compute_seconds"] > 0
    assert result.peak_memory_bytes == result.clock["peak_bytes"] > result.clock["base_bytes"]
    swap = dataclasses.replace(base, activation_swap="attention", device="sim:h200")
    manager = build(swap).swap_manager
    assert manager is not None and isinstance(manager.engine, SimulatedAccelerator)
    with pytest.raises(ConfigError, match="unknown device profile 'h300'; presets: h100, h200"):
        dataclasses.replace(base, device="sim:h300")


@case("output_dir")
def test_output_dir_receives_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from graphswap.train.cli import main

    target = tmp_path / "runs" / "first"
    argv = ["train", "--no-progress", "activation_swap=none", "num_layers=1", "seq_len=16"]
    assert main([*argv, "batch_size=1", "steps=1", "device=cpu", f"output_dir={target}"]) == 0
    assert f"summary written to {target / 'summary.json'}" in capsys.readouterr().out
    [summary] = json.loads((target / "summary.json").read_text())
    assert len(summary["losses"]) == 1


# The passes that shard, compile or checkpoint the model.


@case("activation_checkpointing")
def test_activation_checkpointing_recomputes_instead_of_saving(
    base: TrainerConfig, base_run: TrainResult
) -> None:
    checkpointed = run(base, activation_checkpointing=True)
    assert checkpointed.applied_passes == ["activation_checkpointing"]
    assert checkpointed.resident_activation_bytes < base_run.resident_activation_bytes
    assert checkpointed.losses == base_run.losses


@case("compile")
def test_compile_compiles_each_layer(base: TrainerConfig) -> None:
    torch._dynamo.reset()
    built = build(dataclasses.replace(base, compile=True))
    assert built.infrastructure.applied == ("compile",)
    assert {type(layer).__name__ for layer in built.model.model.layers} == {"OptimizedModule"}


@case("fsdp")
def test_fsdp_shards_the_model(base: TrainerConfig, base_run: TrainResult, world: None) -> None:
    from torch.distributed.fsdp import FSDPModule

    config = dataclasses.replace(base, fsdp=True)
    assert passes.pass_plan(config).names == ("fsdp",)
    assert isinstance(build(config).model, FSDPModule)
    sharded = run(base, fsdp=True)
    assert sharded.applied_passes == ["fsdp"]
    assert sharded.losses == pytest.approx(base_run.losses)


@case("tp_size")
def test_tp_size_plans_tensor_parallel_and_needs_its_ranks(base: TrainerConfig) -> None:
    config = dataclasses.replace(base, tp_size=2)
    assert passes.pass_plan(config).names == ("tensor_parallel",)
    with pytest.raises(passes.PassPlanError, match=r"^tp_size: 2 "):
        run(base, tp_size=2)


@case("cp_size", "ep_size", "pp_size")
@pytest.mark.parametrize(
    ("field", "name"),
    [
        ("cp_size", "context_parallel"),
        ("ep_size", "expert_parallel"),
        ("pp_size", "pipeline_parallel"),
    ],
)
def test_declared_parallelisms_are_planned_and_refused(
    base: TrainerConfig, field: str, name: str
) -> None:
    config = dataclasses.replace(base, **{field: 2})
    assert passes.pass_plan(config).names == (name,)
    with pytest.raises(passes.PassNotImplementedError) as info:
        run(base, **{field: 2})
    assert str(info.value).startswith(f"{field}: 2 asks for {name}, which graphswap declares")


@case("pass_order")
def test_pass_order_is_the_order_that_runs(base: TrainerConfig) -> None:
    both = dataclasses.replace(base, activation_checkpointing=True, compile=True)
    torch._dynamo.reset()
    built = build(dataclasses.replace(both, pass_order=("activation_checkpointing", "compile")))
    assert built.infrastructure.applied == ("activation_checkpointing", "compile")
    with pytest.raises(passes.PassOrderError, match=r"^pass_order: activation_checkpointing "):
        run(both, pass_order=("compile", "activation_checkpointing"))
    with pytest.raises(passes.PassSettingError, match=r"^pass_order: .*add compile to pass_order"):
        run(both, pass_order=("activation_checkpointing",))
