"""Plain Hugging Face models (graphswap.hf.checkpoints): local configs, presets, and the one place
that knows where the decoder layers live."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from graphswap.errors import HierarchyError
from graphswap.hf.checkpoints import CheckpointError, decoder_layers, load_hf_config, model_config

Model = Callable[..., nn.Module]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"model_type": "vit"}', "has model_type 'vit', which names no causal language model"),
        ('{"model_type": "qwen9"}', "has model_type 'qwen9', which names no causal language"),
        ('{"hidden_size": 64}', "has no model_type, which names no causal language model"),
        ('{"model_type": ', "is not valid JSON"),
        ("[1, 2]", "holds a JSON list, not an object of settings"),
    ],
)
def test_load_hf_config_rejects_foreign_and_broken_configs(tmp_path, text, message) -> None:
    config_file = tmp_path / "config.json"
    config_file.write_text(text)
    with pytest.raises(CheckpointError) as info:
        load_hf_config(tmp_path)
    assert str(info.value).startswith(f"{config_file} {message}")


def test_load_hf_config_rejects_a_missing_config(tmp_path) -> None:
    with pytest.raises(CheckpointError, match=r"has no config\.json; pass a local"):
        load_hf_config(tmp_path)


def test_model_config_reads_a_preset_or_a_folder_and_sets_the_depth(
    tiny_model: Model, tmp_path
) -> None:
    tiny_model(num_hidden_layers=3).config.save_pretrained(tmp_path)
    from_folder = model_config("qwen3-30b-a3b", tmp_path, attn_implementation="sdpa", num_layers=2)
    assert (from_folder.hidden_size, from_folder.num_hidden_layers) == (128, 2)
    assert from_folder._attn_implementation == "sdpa"
    preset = model_config("qwen3-30b-a3b")
    assert (preset.hidden_size, preset.num_hidden_layers) == (2048, 48)


def test_load_hf_config_reads_the_family_its_model_type_names(tmp_path) -> None:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4).save_pretrained(
        tmp_path
    )
    config = load_hf_config(tmp_path, attn_implementation="sdpa")
    assert type(config) is LlamaConfig
    assert (config.hidden_size, config.num_hidden_layers, config._attn_implementation) == (
        64,
        2,
        "sdpa",
    )


def test_decoder_layers_are_found_wherever_a_head_class_keeps_them(tiny_model: Model) -> None:
    from transformers import Qwen3MoeForQuestionAnswering

    causal = tiny_model(num_hidden_layers=2)
    assert decoder_layers(causal) == ("model.layers", causal.model.layers)
    assert decoder_layers(causal.model) == ("layers", causal.model.layers)
    question_answering = Qwen3MoeForQuestionAnswering(causal.config)
    fqn, layers = decoder_layers(question_answering)
    assert fqn == "transformer.layers" and len(layers) == 2


def test_decoder_layers_survive_per_layer_wrappers(tiny_model: Model) -> None:
    """The passes find the stack again after checkpointing or compiling each layer."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_model(num_hidden_layers=2)
    model.model.layers[0] = checkpoint_wrapper(model.model.layers[0])
    model.model.layers[1] = torch.compile(model.model.layers[1], backend="eager")
    assert decoder_layers(model)[0] == "model.layers"


def add_a_second_stack(model: nn.Module) -> None:
    model.draft = nn.Module()
    model.draft.layers = nn.ModuleList()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda m: setattr(m.model, "layers", nn.Sequential(*m.model.layers)),
            r"'model\.layers' is torch\.nn\.modules\.container\.Sequential; it must be a",
        ),
        (lambda m: delattr(m.model, "layers"), "found none"),
        (add_a_second_stack, r"found several: 'model\.layers', 'draft\.layers'"),
    ],
)
def test_a_model_without_exactly_one_layer_list_is_refused(
    tiny_model: Model, change: Callable[[nn.Module], None], message: str
) -> None:
    model = tiny_model(num_hidden_layers=1)
    change(model)
    with pytest.raises(HierarchyError, match=message):
        decoder_layers(model)
