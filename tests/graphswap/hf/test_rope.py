"""A model's window is what its rope covers: ``max_position_embeddings``, or a rope
factor times the pretraining window, read from a config as transformers writes it, and
``rope_factor`` writes YaRN there as Qwen3 documents it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.hf.checkpoints import load_hf_config, model_config
from graphswap.hf.presets import preset_config
from graphswap.hf.rope import context_window, set_rope_factor


def test_a_checkpoint_with_qwen3s_documented_yarn_covers_four_times_32768(
    tmp_path: Path,
) -> None:
    """Qwen3's model card: add ``rope_scaling`` (4.x's key) to config.json, whose
    ``max_position_embeddings`` stays 40960."""
    config = preset_config("tiny-qwen3")
    text = json.loads(config.to_json_string())
    text.pop("rope_parameters", None)
    text["max_position_embeddings"] = 40960
    text["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    (tmp_path / "config.json").write_text(json.dumps(text))
    assert context_window(load_hf_config(tmp_path)) == 131072


@pytest.mark.parametrize(
    ("rope", "window"),
    [
        ({"rope_type": "default"}, 2048),
        ({"rope_type": "linear", "factor": 2.0}, 4096),
        ({"rope_type": "dynamic", "factor": 3.0}, 6144),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}, 2048),
    ],
)
def test_a_rope_factor_stretches_the_pretraining_window(rope: dict[str, Any], window: int) -> None:
    """Linear and dynamic stretch ``max_position_embeddings``; YaRN its original window,
    never below what ``max_position_embeddings`` covers."""
    config = preset_config("tiny-qwen3")
    config.rope_parameters = {"rope_theta": 1e6, **rope}
    assert context_window(config) == window


def test_rope_per_layer_type_covers_what_the_least_stretched_covers() -> None:
    config = preset_config("tiny-gemma3")
    config.rope_parameters["full_attention"] = {
        "rope_type": "linear",
        "factor": 8.0,
        "rope_theta": 1e6,
    }
    assert context_window(config) == 2048
    set_rope_factor(config, 4)
    assert context_window(config) == 8192
    assert {p["rope_type"] for p in config.rope_parameters.values()} == {"yarn"}


def test_rope_factor_writes_yarn_as_transformers_writes_it() -> None:
    config = model_config("tiny-qwen3", rope_factor=4)
    assert config.rope_parameters == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
        "rope_theta": preset_config("tiny-qwen3").rope_parameters["rope_theta"],
    }
    assert config.max_position_embeddings == context_window(config) == 8192


@pytest.mark.parametrize("factor", [1, 0.5, -2.0, math.nan, math.inf, True])
def test_a_factor_that_does_not_stretch_is_refused_naming_rope_factor(factor: object) -> None:
    with pytest.raises(PlanSettingError) as caught:
        model_config("tiny-qwen3", rope_factor=factor)  # type: ignore[arg-type]
    assert caught.value.setting == "rope_factor" and "> 1" in caught.value.detail


def test_a_factor_within_the_window_already_covered_would_change_nothing() -> None:
    config = preset_config("tiny-qwen3")
    config.rope_parameters = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "rope_theta": 1e6,
    }
    with pytest.raises(PlanSettingError) as caught:
        set_rope_factor(config, 2)
    assert caught.value.setting == "rope_factor"
    assert "covers already" in caught.value.detail and "more than 4" in caught.value.detail
