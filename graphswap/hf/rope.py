"""A model's context window, and the rope scaling that extends it.

``max_position_embeddings`` is the longest sequence a config was made for. Rope scaling
(YaRN, linear, dynamic NTK, Llama 3's, LongRoPE) stretches the rotary positions by its
``factor`` over the pretraining window (``original_max_position_embeddings``, else
``max_position_embeddings``): Qwen3 documents YaRN x4 over 32768 tokens, 131072. Transformers
5 keeps the scaling in ``config.rope_parameters`` (one dict, or one per layer type), where
it also reads 4.x's ``rope_scaling`` key of a ``config.json``; :func:`set_rope_factor`
writes it there as transformers writes a YaRN config.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from graphswap.hf.attention_kernels import PlanSettingError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SCALED_ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "longrope")
"""The ``rope_type``s whose ``factor`` stretches positions over the pretraining window."""


def _rope_dicts(config: PretrainedConfig) -> list[dict[str, Any]]:
    """The config's rope parameters: one dict, or one per layer type (Gemma 3's)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return []
    nested = [value for value in params.values() if isinstance(value, dict)]
    return nested or [params]


def _factor(params: dict[str, Any]) -> float | None:
    """The stretch of one rope dict, ``None`` when it does not scale."""
    factor = params.get("factor")
    if params.get("rope_type") not in SCALED_ROPE_TYPES:
        return None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        return None
    return float(factor)


def pretraining_window(config: PretrainedConfig) -> int:
    """The window rope scaling stretches: the shortest ``original_max_position_embeddings``
    the config's rope names, else ``max_position_embeddings``."""
    originals = [
        p["original_max_position_embeddings"]
        for p in _rope_dicts(config)
        if isinstance(p.get("original_max_position_embeddings"), int)
    ]
    return min(originals, default=int(config.max_position_embeddings))


def context_window(config: PretrainedConfig) -> int | None:
    """The longest sequence ``config`` covers: ``max_position_embeddings``, or its rope
    factor times the pretraining window when that is longer. With a rope per layer type,
    the least stretched one decides: every layer runs the whole sequence. ``None``: a
    model without positions (Mamba) names no window."""
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    dicts = _rope_dicts(config)
    if not dicts:
        return limit
    original = pretraining_window(config)
    stretched = min(math.floor((_factor(p) or 0.0) * original) for p in dicts)
    return max(limit, stretched)


def check_rope_factor(factor: object) -> float:
    """``factor`` as a float when it stretches the window (a finite number > 1), else the
    setting ``rope_factor`` refused."""
    if (
        isinstance(factor, bool)
        or not isinstance(factor, (int, float))
        or not math.isfinite(factor)
        or factor <= 1
    ):
        raise PlanSettingError(
            "rope_factor",
            factor,
            "must be a finite number > 1: how many times rope scaling (YaRN) stretches the "
            "pretraining window (Qwen3 documents 4)",
        )
    return float(factor)


def set_rope_factor(config: PretrainedConfig, factor: float) -> None:
    """``config`` with YaRN by ``factor`` over its pretraining window in place of its rope
    scaling, as transformers writes a YaRN config: ``rope_parameters`` of ``rope_type``
    ``yarn`` with ``factor`` and ``original_max_position_embeddings``, and
    ``max_position_embeddings`` the stretched window. A factor that leaves the window
    where the config has it, or a model without rotary positions, is refused
    (``rope_factor``): it would change nothing."""
    factor = check_rope_factor(factor)
    params = getattr(config, "rope_parameters", None)
    if not _rope_dicts(config):
        raise PlanSettingError(
            "rope_factor", factor, "the model has no rotary position embeddings to scale; drop it"
        )
    original = pretraining_window(config)
    window = math.floor(factor * original)
    limit = int(config.max_position_embeddings)
    if window <= limit:
        raise PlanSettingError(
            "rope_factor",
            factor,
            f"stretches the pretraining window of {original} tokens to {window}, which the "
            f"model's max_position_embeddings ({limit}) covers already, so it would change "
            f"nothing; use more than {limit / original:g}",
        )

    def yarn(old: dict[str, Any]) -> dict[str, Any]:
        kept = {k: old[k] for k in ("rope_theta", "partial_rotary_factor") if k in old}
        return {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": original,
            **kept,
        }

    assert isinstance(params, dict)
    nested = any(isinstance(value, dict) for value in params.values())
    config.rope_parameters = (
        {key: yarn(value) if isinstance(value, dict) else value for key, value in params.items()}
        if nested
        else yarn(params)
    )
    config.max_position_embeddings = window
