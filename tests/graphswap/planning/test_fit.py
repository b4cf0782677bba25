"""``fit_sequence`` answers only what is safe: every length up to a mode's answer fits,
host memory is in the plan, and ``auto`` plans its offload lag."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
from transformers import PretrainedConfig

from graphswap.hf.presets import preset_config, qwen3_moe_config
from graphswap.planning import FitResult, PlanSettingError, fit_sequence, plan_memory
from graphswap.planning._fit import _Scan
from graphswap.planning.saved_tensors import build_meta_model
from graphswap.planning.trace import StepShape, SwapSchedule, plan_step, trace_step
from graphswap.runtime.profile import device_profile

GIB = 1 << 30


def _short(config: PretrainedConfig, max_seq: int = 24576) -> PretrainedConfig:
    """Four layers, up to 24k tokens: a fit of 48 grid lengths in a few seconds."""
    config.num_hidden_layers = 4
    config.max_position_embeddings = max_seq
    return config


@pytest.mark.parametrize(
    ("name", "memory", "offload_lag", "max_seq"),
    [("llama-3.1-8b", 40 * GIB, 2, 24576), ("qwen3-30b-a3b", 24 * GIB, None, 16384)],
)
def test_every_length_up_to_an_answer_fits(
    name: str, memory: int, offload_lag: int | None, max_seq: int, one_thread: None
) -> None:
    """Sampled below each answer (traced, not interpolated), the planned peak is within the
    memory; the answer is where the first run of fitting lengths ends. Each model's lengths
    reach past every mode's answer (the 30B's longest, budget's, is 12288 at 24 GiB)."""
    config = _short(preset_config(name), max_seq)
    schedule = SwapSchedule(swap_offload_lag=offload_lag, state_shards=8)
    fit = fit_sequence(config, memory_bytes=memory, schedule=schedule)
    answers = {mode.activation_swap: mode for mode in fit.modes}
    assert all(mode.seq_len is not None for mode in fit.modes)
    for mode in fit.modes:
        assert mode.fits[0] == (fit.seq_step, mode.seq_len)
        beyond = [p for p in mode.points if p.seq_len == mode.seq_len + fit.seq_step]
        assert mode.capped or beyond[0].peak_bytes > memory
    longest = max(mode.seq_len for mode in fit.modes if mode.seq_len is not None)
    for seq in sorted({longest // 4 // 512 * 512, longest // 2 // 512 * 512, longest}):
        trace = trace_step(build_meta_model(config, StepShape(seq_len=seq)), fit.profile)
        for mode, answer in answers.items():
            if answer.seq_len is not None and seq <= answer.seq_len:
                plan = (
                    plan_memory(
                        config,
                        StepShape(seq_len=seq),
                        activation_swap="budget",
                        activation_memory_budget=memory,
                        schedule=SwapSchedule(swap_offload_lag=offload_lag, state_shards=8),
                    )
                    if mode == "budget"
                    else plan_step(
                        config,
                        trace,
                        schedule=SwapSchedule(swap_offload_lag=offload_lag, state_shards=8),
                        activation_swap=mode,
                    )
                )
                assert plan.timeline.peak_bytes <= memory, (mode, seq)
                point = next(p for p in answer.points if p.seq_len == seq)
                assert point.peak_bytes == plan.timeline.peak_bytes


def test_a_fit_stops_where_what_no_mode_moves_exceeds_the_memory() -> None:
    """Four Llama layers up to 24576 tokens in 10 GiB: past the length where the state and
    the saves of the embedding and the head (Llama's fp32 logits) exceed the memory, no
    mode can fit, and the fit stops planning there; below it every mode's peak is at least
    that floor, which is what makes stopping safe."""
    from graphswap.planning._fit import _floor_bytes
    from graphswap.train.cli._memory import format_fit

    config = _short(preset_config("llama-3.1-8b"))
    fit = fit_sequence(config, memory_bytes=10 * GIB, schedule=SwapSchedule(state_shards=8))
    assert 0 < fit.planned < 48 and all(len(m.points) == fit.planned for m in fit.modes)
    last = fit.planned * fit.seq_step
    for seq in (last, last + fit.seq_step):
        trace = trace_step(build_meta_model(config, StepShape(seq_len=seq)), fit.profile)
        floor = _floor_bytes(trace, 8)
        assert (floor > 10 * GIB) == (seq > last)
        if seq == last:
            assert all(mode.points[-1].peak_bytes >= floor for mode in fit.modes)
    assert (
        f"every multiple of 512 up to {last} planned ({fit.planned} lengths; past it, to "
        "24576, the state and what the embedding and the head save, which no mode moves, "
        "exceed 10.00 GiB)"
    ) in format_fit(fit.to_dict())


def _plan(seq: int, peak: int, step_ratio: float = 1.0) -> SimpleNamespace:
    timeline = SimpleNamespace(peak_bytes=peak)
    return SimpleNamespace(seq_len=seq, timeline=timeline, step_ratio=step_ratio, host_peak_bytes=0)


def test_a_peak_that_comes_back_under_the_memory_is_a_second_run_not_the_answer() -> None:
    scan = _Scan("auto")
    for seq, peak in ((512, 10), (1024, 20), (1536, 31), (2048, 29), (2560, 30), (3072, 40)):
        scan.add(_plan(seq, peak), 30)  # type: ignore[arg-type]
    result = scan.result(3072)
    assert result.seq_len == 1024 and result.fits == ((512, 1024), (2048, 2560))
    assert not result.contiguous and not result.capped
    assert [p.seq_len for p in result.points] == [512, 1024, 1536, 2048, 2560, 3072]


def test_the_longest_at_a_step_ratio_is_the_longest_that_fits_at_it() -> None:
    """The ratio is not monotone in the length (``layer`` at 4096 stalls more than at
    7168; a budget's heavier level at one length costs less of longer steps): the answer
    is the longest length at the ratio or less, among those the fit's own answer keeps
    (every shorter one fits)."""
    scan = _Scan("layer", max_step_ratio=1.07)
    steps = ((1024, 1.0), (2048, 1.07), (3072, 1.108), (4096, 1.06), (5120, 1.09))
    for seq, ratio in steps:
        scan.add(_plan(seq, 10, ratio), 30)  # type: ignore[arg-type]
    result = scan.result(3072)
    assert (result.seq_len, result.seq_len_at_max_step_ratio) == (5120, 4096)
    tight = _Scan("auto", max_step_ratio=1.5)
    for seq, peak in ((1024, 10), (2048, 40), (3072, 20)):
        tight.add(_plan(seq, peak), 30)  # type: ignore[arg-type]
    assert tight.result(3072).seq_len_at_max_step_ratio == 1024
    assert _Scan("none").result(512).seq_len_at_max_step_ratio is None


@pytest.mark.parametrize("ratio", [0.99, float("nan"), float("inf"), True])
def test_a_step_ratio_below_one_is_refused_before_any_model_is_built(
    ratio: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    import graphswap.planning._fit

    monkeypatch.setattr(graphswap.planning._fit, "build_meta_model", None)
    with pytest.raises(PlanSettingError) as caught:
        fit_sequence(preset_config("tiny-qwen3"), max_step_ratio=ratio)  # type: ignore[arg-type]
    assert caught.value.setting == "max_step_ratio" and ">= 1" in caught.value.detail


@pytest.mark.parametrize(
    ("rope", "lengths"),
    [
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
            [2048, 4096, 6144, 8192],
        ),
        ({"rope_type": "dynamic", "factor": 2.0}, [2048, 4096]),
    ],
)
def test_a_config_with_rope_scaling_fits_up_to_its_stretched_window(
    rope: dict[str, object], lengths: list[int]
) -> None:
    """Without a flag: the config's own rope factor stretches the lengths searched past
    ``max_position_embeddings`` (dynamic NTK's frequency update, a branch on the length,
    is traced as built)."""
    config = preset_config("tiny-qwen3")
    config.num_hidden_layers = 1
    config.rope_parameters = {"rope_theta": 1e6, **rope}
    step = StepShape(seq_len=2048, device="cpu")
    fit = fit_sequence(config, step, memory_bytes=64 * GIB, modes=("none",))
    [none] = fit.modes
    assert fit.max_seq == lengths[-1] and [p.seq_len for p in none.points] == lengths
    assert none.seq_len == lengths[-1] and none.capped


def test_the_fit_table_names_the_runs_of_a_broken_fit() -> None:
    from graphswap.train.cli._memory import format_fit

    config = _short(qwen3_moe_config("qwen3-30b-a3b"))
    sharded = SwapSchedule(state_shards=8)
    data = fit_sequence(config, memory_bytes=24 * GIB, schedule=sharded, modes=("auto",)).to_dict()
    data["modes"][0]["fits"] = [[512, 8192], [9216, 10240]]
    text = format_fit(data)
    assert "auto: the lengths that fit are not one interval: 512-8192, 9216-10240" in text
    assert "every multiple of 512 up to 24576 planned (48 lengths), 4 traced" in text


def test_a_host_budget_keeps_on_device_what_it_cannot_hold() -> None:
    config = _short(qwen3_moe_config("qwen3-30b-a3b"))
    shape = StepShape(seq_len=8192)
    roomy = plan_memory(
        config, shape, activation_swap="layer", schedule=SwapSchedule(state_shards=8)
    )
    tight = plan_memory(
        config,
        shape,
        activation_swap="layer",
        schedule=SwapSchedule(state_shards=8, max_host_bytes=2 * GIB),
    )
    assert roomy.max_host_bytes == device_profile("h200").default_max_host_bytes == 128 * GIB
    assert roomy.refused_bytes == 0 and roomy.host_peak_bytes > 2 * GIB
    assert 0 < tight.host_peak_bytes <= 2 * GIB < tight.host_peak_bytes + tight.refused_bytes
    assert tight.timeline.peak_bytes > roomy.timeline.peak_bytes
    assert tight.swapped_bytes == roomy.swapped_bytes  # chosen alike; the pool refused part


def test_a_node_with_less_host_memory_answers_shorter_and_within_its_budget() -> None:
    config = _short(qwen3_moe_config("qwen3-30b-a3b"))

    def layer_fit(profile: str) -> tuple[FitResult, int]:
        fit = fit_sequence(
            config,
            memory_bytes=24 * GIB,
            schedule=SwapSchedule(state_shards=8),
            modes=("layer",),
            profile=profile,
        )
        [layer] = fit.modes
        assert layer.plan is not None and layer.seq_len is not None
        assert layer.plan.host_peak_bytes <= fit.max_host_bytes
        return fit, layer.seq_len

    node, default = layer_fit("h200")
    small, shorter = layer_fit("h200,host_memory_bytes=64e9,ranks_per_node=8")
    assert small.max_host_bytes == 4 * 10**9 < node.max_host_bytes
    assert shorter < default


def test_auto_plans_its_lag_and_keeps_the_lower_peak() -> None:
    config = qwen3_moe_config("qwen3-30b-a3b", num_hidden_layers=6)
    trace = trace_step(build_meta_model(config, StepShape(seq_len=8192)), device_profile("h200"))
    fixed = {
        lag: plan_step(
            config,
            trace,
            schedule=SwapSchedule(swap_offload_lag=lag, state_shards=8),
            activation_swap="auto",
        )
        for lag in (1, 2)
    }
    chosen = plan_step(config, trace, schedule=SwapSchedule(state_shards=8), activation_swap="auto")
    best = min((1, 2), key=lambda lag: fixed[lag].timeline.peak_bytes)
    assert chosen.swap_offload_lag == best and chosen.swap_offload_lag_chosen
    assert chosen.timeline.peak_bytes == fixed[best].timeline.peak_bytes
    assert not fixed[1].swap_offload_lag_chosen
    assert chosen.timeline.stall_seconds == 0
    assert any("planned at swap_offload_lag 1 and 2" in a for a in chosen.assumptions)


def test_a_mode_whose_rule_refuses_the_model_is_refused_not_planned(
    tour_config: Callable[..., PretrainedConfig],
) -> None:
    """Jamba's Mamba layers hold no attention: the fit says why attention swap cannot run
    and plans the modes that can."""
    config = tour_config("jamba")
    config.max_position_embeddings = 256
    step = StepShape(seq_len=128, device="cpu")
    fit = fit_sequence(config, step, memory_bytes=8 * GIB, modes=("attention", "layer"))
    attention, layer = fit.modes
    assert attention.refused is not None and "attn_swap" in attention.refused
    assert (attention.seq_len, attention.plan, attention.points) == (None, None, ())
    assert layer.refused is None and layer.seq_len == 256 and layer.capped
    from graphswap.train.cli._memory import format_fit

    [row] = [line for line in format_fit(fit.to_dict()).splitlines() if line.startswith("atten")]
    assert row.split()[:2] == ["attention", "refused"] and row.endswith(attention.refused)
