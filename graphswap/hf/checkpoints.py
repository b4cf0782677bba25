"""Hugging Face decoder models as they are, before graphswap or a pass touches them:
a config from a preset or a local folder, an instance on a device, a checkpoint's
weights, and where the decoder layers live.

The core needs these too (the planner traces a model on meta; the rules and passes
find the decoder stack), so they sit here, below the application's builder
(``graphswap.train.build``), which adds the passes. Transformers is imported inside each
function: importing graphswap must not import model code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.fx
from torch import nn

from graphswap.errors import GraphswapError, HierarchyError
from graphswap.hf.presets import preset_config
from graphswap.hf.rope import check_rope_factor, set_rope_factor

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class CheckpointError(GraphswapError, ValueError):
    """A local checkpoint folder that graphswap cannot use; the message names the file."""


def load_hf_config(path: str | Path, *, attn_implementation: str = "eager") -> PretrainedConfig:
    """Read ``config.json`` of a local checkpoint folder (never the hub) into the config
    class of the family its ``model_type`` names; a folder without one, or of a family
    that has no causal LM in this transformers, is refused rather than read as some
    other architecture's keys."""
    import transformers  # model code loads on first use, not on import
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder = Path(path)
    config_file = folder / "config.json" if folder.is_dir() else folder
    if not config_file.is_file():
        where = "does not exist (no config.json)" if not folder.exists() else "has no config.json"
        raise CheckpointError(
            f"{str(path)!r} {where}; pass a local Hugging Face checkpoint folder"
            " (one written by save_pretrained)"
        )
    try:
        values = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"{config_file} is not valid JSON ({error}); re-save the checkpoint with"
            " save_pretrained or fix the file"
        ) from error
    if not isinstance(values, dict):
        raise CheckpointError(
            f"{config_file} holds a JSON {type(values).__name__}, not an object of settings;"
            " re-save the checkpoint with save_pretrained"
        )
    model_type = values.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        found = "no model_type" if model_type is None else f"model_type {model_type!r}"
        raise CheckpointError(
            f"{config_file} has {found}, which names no causal language model in"
            f" transformers {transformers.__version__}; pass the checkpoint folder of a"
            ' decoder family (config.json with "model_type": "llama", "qwen3_moe", ...)'
        )
    # attn_implementation: what transformers writes after model.config.attn_implementation
    # = ...; the caller's, always given, wins, as from_pretrained(attn_implementation=).
    for key in (
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "attn_implementation",
    ):
        values.pop(key, None)
    try:
        return AutoConfig.for_model(model_type, attn_implementation=attn_implementation, **values)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{config_file}: {error}; fix the file") from error


def checkpoint_dtype(path: str | Path) -> str | None:
    """The dtype ``config.json`` of a checkpoint folder records (``dtype``, or
    ``torch_dtype`` as older transformers wrote it), which ``from_pretrained`` loads
    the weights in; ``None`` when it records none."""
    config_file = Path(path) / "config.json"
    try:
        values = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # load_hf_config says what is wrong with the file
    if not isinstance(values, dict):
        return None
    dtype = values.get("dtype") or values.get("torch_dtype")
    return dtype if isinstance(dtype, str) else None


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint folder, in the names ``save_pretrained`` writes;
    raises :class:`CheckpointError` when there are none."""
    from transformers.utils import (  # loads on first use, not on import
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    folder = Path(path)
    names = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
    found = [folder / name for name in names if (folder / name).is_file()]
    if not found:
        raise CheckpointError(
            f"{str(path)!r} has no weights ({', '.join(names)}); save the model with"
            " save_pretrained into that folder, or use a preset (model: ...) for a random init"
        )
    return found


def load_weights(
    path: str | Path, hf_config: PretrainedConfig, *, dtype: torch.dtype
) -> torch.nn.Module:
    """The causal LM of ``hf_config``'s family, ``from_pretrained`` of a local folder; a
    parameter that the checkpoint does not hold (it would stay randomly initialized) is
    an error."""
    from transformers import AutoModelForCausalLM  # model code loads on first use

    weight_files(path)
    model, info = AutoModelForCausalLM.from_pretrained(
        path, config=hf_config, local_files_only=True, dtype=dtype, output_loading_info=True
    )
    missing = sorted(info.get("missing_keys", ())) + [
        str(key) for key in info.get("mismatched_keys", ())
    ]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(
            f"{str(path)!r} does not hold {', '.join(missing[:3])}{more} for this model"
            f" ({hf_config.num_hidden_layers} layers): they would train from a random init;"
            " leave num_layers unset or at most the checkpoint's num_hidden_layers"
        )
    return model


def build_model(
    config: PretrainedConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """Instantiate the causal LM of ``config``'s family (``Qwen3MoeForCausalLM`` for a
    ``Qwen3MoeConfig``, ``LlamaForCausalLM`` for a ``LlamaConfig``...); on ``meta`` no
    memory is allocated."""
    from transformers import AutoModelForCausalLM  # model code loads on first use

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype=dtype)


def model_config(
    preset: str,
    path: str | Path | None = None,
    *,
    attn_implementation: str = "eager",
    num_layers: int | None = None,
    rope_factor: float | None = None,
) -> PretrainedConfig:
    """The config of the local checkpoint folder ``path`` when given, else of ``preset``;
    ``num_layers`` replaces ``num_hidden_layers`` (a shallower model of the same shape);
    ``rope_factor`` stretches its window with YaRN (:func:`~graphswap.hf.rope.set_rope_factor`,
    which refuses a bad one before any model code runs)."""
    if rope_factor is not None:
        check_rope_factor(rope_factor)
    if path is None:
        config = preset_config(preset, attn_implementation=attn_implementation)
    else:
        config = load_hf_config(path, attn_implementation=attn_implementation)
    if num_layers is not None:
        _set_num_layers(config, num_layers)
    if rope_factor is not None:
        set_rope_factor(config, rope_factor)
    return config


class LayerCountError(GraphswapError, ValueError):
    """A number of decoder layers the model's per-layer settings cannot follow."""


def _set_num_layers(config: PretrainedConfig, num_layers: int) -> None:
    """``num_hidden_layers`` replaced, and a per-layer ``layer_types`` list (Gemma 3's
    sliding and full attention) cut to its first ``num_layers``; more layers than it
    lists would have to invent their kinds, so they are refused."""
    layer_types = vars(config).get("layer_types")  # not a property derived from others
    listed = isinstance(layer_types, list)
    if listed and num_layers > len(layer_types):
        raise LayerCountError(
            f"{num_layers} layers, but the model lists the kinds of only"
            f" {len(layer_types)} (layer_types: {', '.join(layer_types)}); use at most"
            f" {len(layer_types)}"
        )
    config.num_hidden_layers = num_layers
    if listed:
        config.layer_types = layer_types[:num_layers]


def eager_only(config: PretrainedConfig) -> str | None:
    """The causal LM class of ``config``'s family when it runs eager attention only in
    this transformers (gpt-oss: its attention sinks), else ``None``."""
    from transformers import AutoModelForCausalLM  # loaded with the config already

    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    return None if model_class._supports_sdpa else model_class.__name__


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(fqn, layers)`` of the decoder layer list: the one ``ModuleList`` named
    ``layers`` in the tree, wherever a head class keeps its stack (``model.layers`` of a
    causal LM, ``layers`` of a bare model, ``transformer.layers`` of question answering).

    Found by structure, not by class, so that it holds for any Hugging Face decoder and
    after the passes that wrap single layers (checkpoint, compile, FSDP). torch.fx keeps
    the FQNs of a traced model but rebuilds its containers as plain modules, so there
    the list is found by name alone.
    """
    traced = isinstance(model, torch.fx.GraphModule)
    named = [
        (fqn, module) for fqn, module in model.named_modules() if fqn.rpartition(".")[2] == "layers"
    ]
    found = [(fqn, m) for fqn, m in named if traced or isinstance(m, nn.ModuleList)]
    if len(found) == 1:
        return found[0]  # type: ignore[return-value]
    if found:
        where = ", ".join(repr(fqn) for fqn, _ in found)
        problem = f"found several: {where}; rewrite or shard each stack separately"
    elif named:
        fqn, module = named[0]
        problem = (
            f"{fqn!r} is {type(module).__module__}.{type(module).__qualname__}; it must be a"
            " torch.nn.ModuleList"
        )
    else:
        problem = (
            "found none; graphswap swaps, shards and wraps per decoder layer: pass the"
            " Hugging Face model itself"
        )
    raise HierarchyError(
        f"{type(model).__qualname__} must hold exactly one decoder layer list (a"
        f" torch.nn.ModuleList named 'layers'), {problem}"
    )
