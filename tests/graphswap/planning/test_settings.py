"""The planner's settings as two values: each refused once, when made, by the name the
trainer's config gives it, and named so again in its results; 0.1.0's keyword and
attribute names warn and still work (issue 31)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch

from graphswap.errors import GraphswapDeprecationWarning
from graphswap.hf.presets import qwen3_moe_config
from graphswap.planning import PlanSettingError, fit_sequence, plan_memory
from graphswap.planning._fit import LengthPoint, ModeFit
from graphswap.planning.trace import StepShape, StepTrace, SwapSchedule, plan_step

SMALL: dict[str, Any] = {"device": "cpu", "dtype": torch.float32, "activation_swap": "none"}


@pytest.mark.parametrize(
    ("make", "setting"),
    [
        (lambda: StepShape(seq_len=0), "seq_len"),
        (lambda: StepShape(seq_len=8, batch_size=True), "batch_size"),
        (lambda: StepShape(seq_len=8, tp_size=0), "tp_size"),
        (lambda: StepShape(seq_len=8, device="xpu"), "device"),
        (lambda: SwapSchedule(swap_hide_margin=1.0), "swap_hide_margin"),
        (lambda: SwapSchedule(swap_offload_lag=-1), "swap_offload_lag"),
        (lambda: SwapSchedule(swap_prefetch_depth=0), "swap_prefetch_depth"),
        (lambda: SwapSchedule(state_shards=0), "state_shards"),
        (lambda: SwapSchedule(max_host_bytes=-1), "max_host_bytes"),
    ],
)
def test_a_bad_value_is_refused_when_made_naming_the_config_key(make, setting) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanSettingError) as caught:
        make()
    assert caught.value.setting == setting
    assert str(caught.value).startswith(f"{setting}=")


@pytest.mark.compat
def test_an_unknown_keyword_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(PlanSettingError, match="use one of seq_len, batch_size") as caught:
        plan_memory(qwen3_moe_config("tiny"), seq_len=8, seqlen=8)
    assert caught.value.setting == "seqlen"


@pytest.mark.compat
def test_the_old_keywords_warn_naming_the_new_one_and_plan_the_same() -> None:
    config = qwen3_moe_config("tiny", num_hidden_layers=2)
    with pytest.warns(DeprecationWarning) as caught:
        old = plan_memory(config, seq=64, batch=2, tp=1, offload_lag=1, **SMALL)
    assert [str(w.message) for w in caught] == [
        f"plan_memory({name}=...) is deprecated: use {new}= (removed in 0.3)"
        for name, new in (
            ("seq", "seq_len"),
            ("batch", "batch_size"),
            ("tp", "tp_size"),
            ("offload_lag", "swap_offload_lag"),
        )
    ] + [
        "plan_memory(seq=..., batch=..., tp=..., offload_lag=..., device=..., dtype=...) is"
        " deprecated: pass the step as plan_memory(config, StepShape(...),"
        " schedule=SwapSchedule(...)) (graphswap.planning.trace) (removed in 0.3)"
    ]
    assert all(w.filename == __file__ for w in caught), "the warning points at the caller"
    new = plan_memory(
        config,
        StepShape(seq_len=64, batch_size=2, tp_size=1, device="cpu", dtype=torch.float32),
        activation_swap="none",
        schedule=SwapSchedule(swap_offload_lag=1),
    )
    assert old.to_dict() == new.to_dict()


@pytest.fixture(scope="module")
def results(tiny_trace: StepTrace) -> dict[str, Any]:
    """One of each result that names a setting: an ``auto`` plan (it has the margin and
    whether the lag was chosen), a fit (one whose state does not fit: no length is
    planned), a point of a fit's grid, a mode's answer and a traced step."""
    config = qwen3_moe_config("tiny")
    return {
        "MemoryPlan": plan_step(config, tiny_trace, activation_swap="auto"),
        "FitResult": fit_sequence(config, memory_bytes=1),
        "LengthPoint": LengthPoint(512, 1 << 20, 1.0, 0),
        "ModeFit": ModeFit("none", 512, None, capped=False),
        "StepTrace": tiny_trace,
    }


@pytest.mark.compat
@pytest.mark.parametrize(
    ("owner", "old", "new"),
    [
        ("MemoryPlan", "seq", "seq_len"),
        ("MemoryPlan", "batch", "batch_size"),
        ("MemoryPlan", "tp", "tp_size"),
        ("MemoryPlan", "offload_lag", "swap_offload_lag"),
        ("MemoryPlan", "prefetch_depth", "swap_prefetch_depth"),
        ("MemoryPlan", "hide_margin", "swap_hide_margin"),
        ("MemoryPlan", "offload_lag_chosen", "swap_offload_lag_chosen"),
        ("FitResult", "batch", "batch_size"),
        ("LengthPoint", "seq", "seq_len"),
        ("ModeFit", "seq", "seq_len"),
        ("StepTrace", "seq", "seq_len"),
        ("StepTrace", "batch", "batch_size"),
    ],
)
def test_a_results_old_attribute_warns_at_the_callers_line_and_reads_the_new_field(
    results: dict[str, Any], owner: str, old: str, new: str
) -> None:
    result = results[owner]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(result, old)
    assert value == getattr(result, new) is not None
    assert [str(w.message) for w in caught] == [
        f"{owner}.{old} is deprecated: use {owner}.{new} (removed in 0.3)"
    ]
    assert caught[0].category is GraphswapDeprecationWarning and caught[0].filename == __file__
    # Only the new name is a field and a key of the JSON: the old one cannot warn there.
    keys = result.to_dict() if hasattr(result, "to_dict") else dataclasses.fields(result)
    names = keys if isinstance(keys, dict) else {f.name for f in keys}
    assert new in names and old not in names
