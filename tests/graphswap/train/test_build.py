import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

from graphswap.hf.presets import preset_config, qwen3_moe_config
from graphswap.runtime import is_swap_wrapped
from graphswap.train.build import build, from_config, from_pretrained
from graphswap.train.config import TrainerConfig


def attention_types(model: torch.nn.Module) -> set[type]:
    return {type(layer.self_attn) for layer in model.model.layers}


def test_from_config_threads_activation_swap() -> None:
    plain = from_config(qwen3_moe_config("tiny", num_hidden_layers=2))
    swapped = from_config(
        qwen3_moe_config("tiny", num_hidden_layers=2), activation_swap="attention"
    )
    assert attention_types(plain) == {Qwen3MoeAttention}
    assert all(is_swap_wrapped(layer.self_attn) for layer in swapped.model.layers)


@pytest.mark.parametrize("mode", ["layer", "auto"])
def test_from_config_and_from_pretrained_swap_whole_layers(mode: str, tmp_path) -> None:
    hf_config = qwen3_moe_config("tiny", num_hidden_layers=2)
    swapped = from_config(hf_config, activation_swap=mode)  # type: ignore[arg-type]
    assert all(is_swap_wrapped(layer) for layer in swapped.model.layers)
    from_config(hf_config).save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path, activation_swap=mode)  # type: ignore[arg-type]
    assert all(is_swap_wrapped(layer) for layer in loaded.model.layers)


def test_contradicting_swap_settings_are_an_error() -> None:
    with pytest.raises(ValueError, match="contradicts"):
        from_config(
            qwen3_moe_config("tiny", num_hidden_layers=2),
            activation_swap="none",
            trainer_config=TrainerConfig(activation_swap="attention"),
        )


def test_from_pretrained_loads_local_weights_and_swaps(tmp_path) -> None:
    torch.manual_seed(0)
    source = from_config(qwen3_moe_config("tiny", num_hidden_layers=2))
    source.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path, activation_swap="attention")
    assert all(is_swap_wrapped(layer.self_attn) for layer in loaded.model.layers)
    for (name, p), (_, q) in zip(source.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_rope_factor_builds_the_model_plan_memory_plans() -> None:
    """``rope_factor: 4`` stretches the trained model's rope as ``plan-memory --rope-factor
    4`` stretches the planned one: YaRN over the tiny model's 2048 positions."""
    model = build(TrainerConfig(num_layers=1, rope_factor=4)).model
    assert model.config.rope_parameters["rope_type"] == "yarn"
    assert model.config.rope_parameters["factor"] == 4.0
    assert model.config.max_position_embeddings == 8192
    assert model.model.rotary_emb.attention_scaling > 1  # YaRN's, not the default 1


def test_build_exposes_the_swap_manager() -> None:
    built = build(TrainerConfig(activation_swap="attention", num_layers=3))
    assert built.swap_manager is not None
    assert len(built.swap_manager.links) == 2
    assert build(TrainerConfig(num_layers=3)).swap_manager is None


def test_a_build_plans_once_and_runs_that_plan(plans_built: list[object]) -> None:
    """From settings to a model, one pass plan: checked before the model is built, then run."""
    built = build(TrainerConfig(activation_swap="attention", num_layers=1))
    assert plans_built == [built.infrastructure.pass_plan]
    from_config(qwen3_moe_config("tiny", num_hidden_layers=1), activation_swap="attention")
    assert len(plans_built) == 2


def test_build_refuses_a_plan_that_cannot_run_before_it_reads_the_model(tmp_path) -> None:
    """The plan is checked first: a folder with no checkpoint in it is never opened."""
    from graphswap.passes import PassConflictError

    config = TrainerConfig(activation_swap="attention", compile=True)
    with pytest.raises(PassConflictError, match=r"^activation_swap: attention excludes compile"):
        build(config, weights=tmp_path / "no-checkpoint-here")


@pytest.mark.parametrize(
    "preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma3"]
)
def test_auto_builds_on_a_dense_family(preset: str) -> None:
    """transformers records experts_implementation: eager on every model it builds; a
    model without experts has nothing to route, so auto plans it."""
    model = from_config(preset_config(preset), activation_swap="auto")
    assert all(is_swap_wrapped(layer) for layer in model.model.layers)


def test_a_checkpoint_whose_config_names_its_attention_loads(tmp_path) -> None:
    """What transformers writes after model.config.attn_implementation = ...; the
    trainer's attn_implementation is the one the model runs, as from_pretrained's
    argument wins over the file."""
    source = from_config(preset_config("tiny-llama"))
    source.config.attn_implementation = "eager"
    source.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path, activation_swap="layer")
    assert loaded.config._attn_implementation == "sdpa"


def test_from_pretrained_keeps_the_checkpoint_dtype_unless_the_config_sets_one(
    tmp_path,
) -> None:
    from_config(preset_config("tiny-llama")).to(torch.bfloat16).save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path, activation_swap="layer")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    config = TrainerConfig(activation_swap="layer", dtype="float32")
    loaded = from_pretrained(tmp_path, trainer_config=config)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
