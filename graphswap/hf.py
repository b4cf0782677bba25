"""Hugging Face decoder models as they are, before graphswap or a pass touches them:
a config from a preset or a local folder, an instance on a device, a checkpoint's
weights, and where the decoder layers live.

The core needs these too (the planner traces a model on meta; the rules and passes
find the decoder stack), so they sit here, below the application's builder
(``graphswap.models``), which adds the passes. Transformers is imported inside each
function: importing graphswap must not import model code.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.fx
from torch import nn

from graphswap.errors import HierarchyError, NoMatchError
from graphswap.presets import preset_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class CheckpointError(ValueError):
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
    for key in ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype"):
        values.pop(key, None)
    try:
        return AutoConfig.for_model(model_type, attn_implementation=attn_implementation, **values)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{config_file}: {error}; fix the file") from error


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
) -> PretrainedConfig:
    """The config of the local checkpoint folder ``path`` when given, else of ``preset``;
    ``num_layers`` replaces ``num_hidden_layers`` (a shallower model of the same shape)."""
    overrides = {} if num_layers is None else {"num_hidden_layers": num_layers}
    if path is None:
        return preset_config(preset, attn_implementation=attn_implementation, **overrides)
    config = load_hf_config(path, attn_implementation=attn_implementation)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


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


@dataclass(frozen=True)
class DecoderClasses:
    """A model's own decoder layer and attention classes."""

    layers: tuple[type, ...]
    attention: tuple[type, ...]


def decoder_classes(model: nn.Module, *, rule: str) -> DecoderClasses:
    """The decoder layer and attention classes ``model``'s Hugging Face class declares:
    those whose outputs it records as ``hidden_states`` and ``attentions``
    (``_can_record_outputs``), and every layer class it keeps whole on one device
    (``_no_split_modules``, which lists each kind of layer of a hybrid stack).

    Declared, not found in the tree: a subclass or a wrapper put in the model's place
    does not become a target. A model that declares none, or holds no decoder stack,
    raises :class:`NoMatchError` (for ``rule``) listing the module types it holds.
    """
    try:
        decoder_layers(model)
    except HierarchyError as error:
        raise NoMatchError(_undeclared(rule, model, f"no decoder stack ({error})")) from None
    root = type(model)
    records = getattr(root, "_can_record_outputs", None) or {}
    attention = _record_class(records.get("attentions"))
    layer = _record_class(records.get("hidden_states"))
    if attention is None or layer is None:
        raise NoMatchError(
            _undeclared(
                rule,
                model,
                f"{_qualified(root)} declares no decoder layer and attention classes"
                " (_can_record_outputs['hidden_states'] and ['attentions'])",
            )
        )
    namespace = vars(sys.modules[root.__module__])
    hybrid = [namespace.get(name) for name in sorted(getattr(model, "_no_split_modules", ()) or ())]
    layers = (layer, *(cls for cls in hybrid if isinstance(cls, type) and cls is not layer))
    return DecoderClasses(layers=layers, attention=(attention,))


def _record_class(record: object) -> type | None:
    """The module class of one ``_can_record_outputs`` entry: a class, or an
    ``OutputRecorder`` holding it as ``target_class``."""
    cls = getattr(record, "target_class", record)
    return cls if isinstance(cls, type) and issubclass(cls, nn.Module) else None


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _undeclared(rule: str, model: nn.Module, reason: str, limit: int = 12) -> str:
    types = list(dict.fromkeys(_qualified(type(m)) for m in model.modules()))
    more = f" (+{len(types) - limit} more)" if len(types) > limit else ""
    return (
        f"rule {rule!r} found no decoder attention to match: {reason}; module types found:"
        f" {', '.join(types[:limit])}{more}. Fix: pass a Hugging Face decoder model (a"
        " ...ForCausalLM or ...Model built by transformers) as it was built, or write a Rule"
        " with targets naming your attention class"
    )


HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""What tensor parallelism shards by heads: q/k/v column-wise, o row-wise."""

HEAD_NORMS = ("q_norm", "k_norm")
"""Norms over one head's width, which a rank applies to its own heads."""


def head_sharding_problem(attention: nn.Module) -> str | None:
    """Why tensor parallelism cannot shard ``attention`` by heads, or ``None``.

    A rank holding some heads runs the attention when its weights are the q/k/v/o
    projections (``nn.Linear``) and norms over one head's width, and nothing else: a
    parameter per head (gpt-oss's sinks), a norm across all heads (OLMoE's q/k norm) or
    low-rank projections (multi-head latent attention) would need a plan of their own.
    """
    name = type(attention).__name__
    children = dict(attention.named_children())
    missing = [n for n in HEAD_PROJECTIONS if not isinstance(children.get(n), nn.Linear)]
    if missing:
        held = ", ".join(n for n, m in children.items() if any(True for _ in m.parameters()))
        return f"{name} has no {', '.join(missing)} projection (it holds {held})"
    own = [n for n, _ in attention.named_parameters(recurse=False)]
    if own:
        return f"{name} holds {', '.join(own)} itself, one value per head"
    head_dim = getattr(attention, "head_dim", None)
    for child, module in children.items():
        weights = list(module.parameters())
        if child in HEAD_PROJECTIONS or not weights:
            continue
        if child not in HEAD_NORMS:
            return f"{name}.{child} ({type(module).__name__}) holds weights of its own"
        width = weights[0].shape[-1]
        if width != head_dim:
            return (
                f"{name}.{child} normalizes across all heads (width {width}, head_dim"
                f" {head_dim}), which a rank holding some of them cannot compute"
            )
    return None
