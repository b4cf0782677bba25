import inspect

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

from graphswap import SwapManager, swap_wrapper, unwrap_swap
from graphswap.runtime import is_swap_wrapped


def test_wrap_keeps_identity_names_and_attributes(tiny_model) -> None:
    model = tiny_model()
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    attn = model.model.layers[0].self_attn
    wrapped = swap_wrapper(attn, manager=SwapManager(), name="model.layers.0.self_attn")

    assert wrapped is attn is model.model.layers[0].self_attn
    assert isinstance(wrapped, Qwen3MoeAttention)
    assert type(wrapped) is not Qwen3MoeAttention
    assert type(wrapped).__bases__[-1] is Qwen3MoeAttention
    assert is_swap_wrapped(wrapped)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == names
    assert wrapped.head_dim == 64 and wrapped.layer_idx == 0
    assert wrapped.q_proj is model.model.layers[0].self_attn.q_proj


def test_forward_outputs_unchanged_with_hf_kwargs(tiny_model) -> None:
    model = tiny_model()
    attn = model.model.layers[1].self_attn
    hidden = torch.randn(2, 64, 128, requires_grad=True)
    pos = model.model.rotary_emb(hidden, torch.arange(64)[None])
    expected = attn(hidden, position_embeddings=pos, attention_mask=None)
    swap_wrapper(attn, manager=SwapManager(keep_last=False))
    got = attn(hidden, position_embeddings=pos, attention_mask=None)
    assert torch.equal(expected[0], got[0])
    assert torch.equal(expected[1], got[1])


def test_forward_keeps_its_signature(tiny_model) -> None:
    attn = tiny_model().model.layers[0].self_attn
    expected = inspect.signature(attn.forward)
    swap_wrapper(attn, manager=SwapManager())
    assert inspect.signature(attn.forward) == expected
    assert "position_embeddings" in expected.parameters


def test_unwrap_restores_exact_type(tiny_model) -> None:
    attn = tiny_model().model.layers[0].self_attn
    manager = SwapManager()
    swap_wrapper(attn, manager=manager)
    assert unwrap_swap(attn) is attn
    assert type(attn) is Qwen3MoeAttention
    assert manager.groups() == []
    assert "_graphswap_swap_state" not in attn.__dict__


def test_wrapping_twice_is_refused(tiny_model) -> None:
    attn = tiny_model().model.layers[0].self_attn
    swap_wrapper(attn, manager=SwapManager())
    with pytest.raises(ValueError, match="already swap-wrapped"):
        swap_wrapper(attn, manager=SwapManager())


def test_unwrap_of_plain_module_is_refused() -> None:
    with pytest.raises(ValueError, match="not swap-wrapped"):
        unwrap_swap(torch.nn.Linear(2, 2))


def test_generated_class_is_shared_per_type(tiny_model) -> None:
    layers = tiny_model().model.layers
    manager = SwapManager()
    a = swap_wrapper(layers[0].self_attn, manager=manager)
    b = swap_wrapper(layers[1].self_attn, manager=manager)
    assert type(a) is type(b)
    assert type(a).__name__ == "SwapQwen3MoeAttention"


def test_duplicate_names_are_refused(tiny_model) -> None:
    layers = tiny_model().model.layers
    manager = SwapManager()
    swap_wrapper(layers[0].self_attn, manager=manager, name="attn")
    with pytest.raises(ValueError, match="already registered"):
        swap_wrapper(layers[1].self_attn, manager=manager, name="attn")
    assert type(layers[1].self_attn) is Qwen3MoeAttention


def test_the_default_policy_is_generic_and_swaps_large_activations() -> None:
    """A wrapper of any module, not only a Qwen3 one, swaps what the 1 MiB test picks."""
    from graphswap.runtime.policy import MIN_SWAP_TENSOR_BYTES

    manager = SwapManager(keep_last=False)
    block = swap_wrapper(
        torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU()),
        manager=manager,
        name="block",
    )
    (info,) = manager.groups()
    assert info.policy == "swap_large_activations"
    rows = MIN_SWAP_TENSOR_BYTES // (512 * 4)
    block(torch.randn(rows, 512, requires_grad=True)).sum().backward()
    assert manager.stats.offloaded_bytes >= MIN_SWAP_TENSOR_BYTES
    assert manager.stats.reloaded_bytes == manager.stats.offloaded_bytes


@pytest.mark.parametrize(
    "answer",
    [torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE, True, None],
    ids=["torch's enum", "a bool", "None"],
)
def test_a_policy_answering_anything_else_is_an_error(answer: object) -> None:
    """Another answer is never taken as 'keep': the user meant something graphswap
    does not do (torch's recompute policies), and a silent keep would free nothing."""
    manager = SwapManager(keep_last=False)
    block = swap_wrapper(
        torch.nn.Linear(8, 8), manager=manager, name="block", policy=lambda t: answer
    )
    with pytest.raises(
        TypeError,
        match=r"of 'block' answered .*; a swap policy answers"
        r" graphswap\.CheckpointPolicy\.MUST_SWAP or MUST_SAVE",
    ):
        block(torch.randn(4, 8, requires_grad=True))
