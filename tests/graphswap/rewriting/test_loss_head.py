"""``chunk_loss_head``: a Hugging Face causal LM's loss over chunks of tokens.

Against the same model's own forward with labels: every gradient below the head
bitwise equal, the loss within 1e-6 relative and ``lm_head``'s weight gradient within
the bound of ``tests/graphswap/runtime/test_chunked_cross_entropy.py``, in fp32 and bf16, with
ignored labels, ``num_items_in_batch``, the MoE auxiliary loss, Gemma's softcapping and
tied embeddings, Cohere's and Granite's logit scales. Without labels the forward is the
model's own. The model stays the model (class name, ``isinstance``, FQNs, ``state_dict``),
pickles, and undoes exactly; refusals name the setting and leave it as it was.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from graphswap.errors import GraphswapError, LossHeadError
from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import preset_config
from graphswap.rewriting.loss_head import (
    ChunkedLossHead,
    chunk_loss_head,
    loss_head_chunk_size,
    unchunk_loss_head,
)

CHUNK = 48
"""Tokens per chunk: 2 x 64 tokens make three chunks of 42 or 43."""
FP32_WEIGHT_BOUND = 2e-6
BF16_WEIGHT_BOUND = 2**-8


def _small(model_type: str, **values: Any) -> Any:
    """A two-layer config of a family without a tiny preset."""
    from transformers import AutoConfig

    shape = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return AutoConfig.for_model(model_type, attn_implementation="eager", **shape, **values)


CONFIGS: dict[str, Callable[[], Any]] = {
    "llama": lambda: preset_config("tiny-llama"),
    "qwen3_moe+aux_loss": lambda: preset_config("tiny", output_router_logits=True),
    "gemma3+softcap+tied": lambda: preset_config(
        "tiny-gemma3", final_logit_softcapping=30.0, tie_word_embeddings=True
    ),
    "cohere+logit_scale": lambda: _small("cohere", logit_scale=0.25),
    "granite+logits_scaling": lambda: _small("granite", logits_scaling=4.0),
}


def _model(name: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return build_model(CONFIGS[name](), dtype=dtype)


def _batch(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=gen)
    labels = ids.clone()
    labels[0, :7] = -100
    labels[1, 40:] = -100
    return ids, labels


def _step(model: nn.Module, **kwargs: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    ids, labels = _batch(model)
    model.zero_grad(set_to_none=True)
    output = model(input_ids=ids, labels=labels, **kwargs)
    output.loss.backward()
    return output, {n: p.grad.clone() for n, p in model.named_parameters()}


def _head_weight_name(model: nn.Module) -> str:
    """The name ``named_parameters`` gives ``lm_head.weight`` (the embedding's, if tied)."""
    weight = model.lm_head.weight
    return next(n for n, p in model.named_parameters() if p is weight)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize(
    ("name", "dtype", "kwargs"),
    [
        ("llama", torch.float32, {}),
        ("llama", torch.bfloat16, {}),
        ("llama", torch.float32, {"num_items_in_batch": torch.tensor(300)}),
        ("qwen3_moe+aux_loss", torch.float32, {}),
        ("qwen3_moe+aux_loss", torch.bfloat16, {}),
        ("gemma3+softcap+tied", torch.float32, {}),
        ("gemma3+softcap+tied", torch.bfloat16, {}),
        ("cohere+logit_scale", torch.float32, {}),
        ("granite+logits_scaling", torch.float32, {}),
    ],
    ids=[
        "llama-fp32",
        "llama-bf16",
        "llama-num_items_in_batch",
        "qwen3_moe+aux_loss-fp32",
        "qwen3_moe+aux_loss-bf16",
        "gemma3+softcap+tied-fp32",
        "gemma3+softcap+tied-bf16",
        "cohere+logit_scale",
        "granite+logits_scaling",
    ],
)
def test_the_chunked_loss_follows_the_models_own(
    name: str, dtype: torch.dtype, kwargs: dict[str, Any]
) -> None:
    model = _model(name, dtype)
    full, full_grads = _step(model, **kwargs)
    chunk_loss_head(model, chunk_size=CHUNK)
    chunked, grads = _step(model, **kwargs)
    assert type(chunked) is type(full) and chunked.logits is None
    assert float((abs(chunked.loss - full.loss) / full.loss).detach()) <= 1e-6
    if "aux_loss" in full:
        assert torch.equal(chunked.aux_loss, full.aux_loss), "the family's own aux loss"
    head = _head_weight_name(model)
    below = [n for n in grads if n != head and not torch.equal(grads[n], full_grads[n])]
    assert below == [], "every gradient below the head is the full head's, bit for bit"
    bound = FP32_WEIGHT_BOUND if dtype == torch.float32 else BF16_WEIGHT_BOUND
    assert _relative(grads[head], full_grads[head]) <= bound


def test_without_labels_the_forward_and_generate_are_the_models_own() -> None:
    model = _model("llama").eval()
    ids, _ = _batch(model)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        generated = model.generate(ids[:, :8], max_new_tokens=4, do_sample=False)
        chunk_loss_head(model, chunk_size=CHUNK)
        assert torch.equal(model(input_ids=ids).logits, logits)
        assert torch.equal(model.generate(ids[:, :8], max_new_tokens=4, do_sample=False), generated)


def test_the_model_stays_the_model_and_undoes_exactly() -> None:
    model = _model("llama")
    cls = type(model)
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    assert chunk_loss_head(model, chunk_size=CHUNK) is model
    assert isinstance(model, cls) and isinstance(model, ChunkedLossHead)
    assert type(model).__name__ == cls.__name__, "save_pretrained records the architecture"
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    assert loss_head_chunk_size(model) == CHUNK
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert type(copied) is type(model) and loss_head_chunk_size(copied) == CHUNK
        assert _step(copied)[0].logits is None
    with pytest.raises(LossHeadError, match=r"already has a chunked loss head \(48 tokens"):
        chunk_loss_head(model)
    assert unchunk_loss_head(model) is model
    assert type(model) is cls and loss_head_chunk_size(model) is None
    assert "_graphswap_loss_head" not in model.__dict__
    assert _step(model)[0].logits is not None
    with pytest.raises(LossHeadError, match="has no chunked loss head; nothing to undo"):
        unchunk_loss_head(model)


DATA = Path(__file__).parent / "data"


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return build_model(config)


def test_a_model_pickled_by_0_2_0_with_a_chunked_head_loads_and_undoes() -> None:
    """``data/chunked_llama_0.2.0.pt`` is what the head of 0.2.0, with its own class swap
    (commit 5f8cf61), saved of ``_tiny_llama()`` after ``chunk_loss_head(model,
    chunk_size=5)`` with ``torch.save``: it names ``_head_class`` and ``_HeadState``. It
    loads as a model with the head installed now, computes what a fresh install
    computes, and undoes to the exact class."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = torch.load(DATA / "chunked_llama_0.2.0.pt", weights_only=False)
    fresh = chunk_loss_head(_tiny_llama(), chunk_size=5)
    assert type(loaded) is type(fresh) and loss_head_chunk_size(loaded) == 5
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert list(loaded.state_dict()) == list(fresh.state_dict())
    (output, grads), (fresh_output, fresh_grads) = _step(loaded), _step(fresh)
    assert output.logits is None and torch.equal(output.loss, fresh_output.loss)
    assert all(torch.equal(grads[n], fresh_grads[n]) for n in fresh_grads)
    with pytest.raises(LossHeadError, match=r"already has a chunked loss head \(5 tokens"):
        chunk_loss_head(loaded)
    original = type(_tiny_llama())
    assert type(unchunk_loss_head(loaded)) is original
    assert "_graphswap_loss_head" not in loaded.__dict__


def test_return_dict_false_returns_the_tuple_without_logits() -> None:
    model = _model("llama")
    ids, labels = _batch(model)
    chunk_loss_head(model, chunk_size=CHUNK)
    loss, *rest = model(input_ids=ids, labels=labels, return_dict=False)
    assert loss.shape == () and not any(
        isinstance(t, torch.Tensor) and t.shape[-1] == model.config.vocab_size for t in rest
    )


def test_no_tensor_larger_than_one_chunk_of_logits(largest_output: Callable[[], Any]) -> None:
    """A 32k vocabulary over 2 x 256 tokens: the full head makes (tokens x vocabulary)
    tensors, the chunked one nothing larger than a chunk's logits."""
    vocab, chunk = 32000, 64
    torch.manual_seed(0)
    model = build_model(preset_config("tiny-llama", vocab_size=vocab, num_hidden_layers=1))
    ids = torch.randint(0, vocab, (2, 256), generator=torch.Generator().manual_seed(1))
    sizes = []
    for install in (False, True):
        if install:
            chunk_loss_head(model, chunk_size=chunk)
        with largest_output() as seen:
            model(input_ids=ids, labels=ids).loss.backward()
        sizes.append(seen.largest)
    assert sizes[0] >= ids.numel() * vocab
    assert sizes[1] <= chunk * vocab


def test_runs_on_the_meta_device() -> None:
    model = build_model(preset_config("tiny-llama"), device="meta")
    chunk_loss_head(model, chunk_size=CHUNK)
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    assert output.logits is None and output.loss.device.type == "meta"
    assert model.lm_head.weight.grad is not None


# Refusals: one line naming the setting; the model as it was.


def _untouched(model: nn.Module, cls: type) -> None:
    assert type(model) is cls and loss_head_chunk_size(model) is None


@pytest.mark.parametrize("size", [0, -5, True, 1.5])
def test_a_chunk_size_below_one_is_refused(size: object) -> None:
    model = _model("llama")
    cls = type(model)
    with pytest.raises(LossHeadError, match=r"^loss_head_chunk_size: must be an integer >= 1"):
        chunk_loss_head(model, chunk_size=size)  # type: ignore[arg-type]
    _untouched(model, cls)


@pytest.mark.parametrize(
    ("make", "found"),
    [
        (lambda: build_model(preset_config("tiny-llama")).model, "LlamaModel has no lm_head"),
        (lambda: nn.Linear(4, 4), "Linear has no lm_head"),
    ],
    ids=["decoder-without-head", "linear"],
)
def test_a_model_without_lm_head_is_refused(make: Callable[[], nn.Module], found: str) -> None:
    model = make()
    cls = type(model)
    with pytest.raises(LossHeadError) as info:
        chunk_loss_head(model)
    message = str(info.value)
    assert "\n" not in message and message.startswith("loss_head: chunked needs")
    assert found in message and message.endswith("set loss_head: full")
    _untouched(model, cls)


def test_a_loss_function_of_ones_own_is_refused() -> None:
    model = _model("llama")
    cls = type(model)
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.sum()
    with pytest.raises(
        LossHeadError, match=r"not transformers' ForCausalLMLoss.*set loss_head: full"
    ):
        chunk_loss_head(model)
    _untouched(model, cls)


def test_logits_changed_otherwise_than_the_config_says_are_refused() -> None:
    """The family's transform is checked against the config's: a softcapping the config
    did not name at install, or another value, is an error, never a wrong loss."""
    model = _model("gemma3+softcap+tied")
    model.config.final_logit_softcapping = None
    chunk_loss_head(model, chunk_size=CHUNK)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(LossHeadError, match="in a way the chunked head does not know"):
        _step(model)
    unchunk_loss_head(model)
    chunk_loss_head(model, chunk_size=CHUNK)
    model.config.final_logit_softcapping = 20.0
    with pytest.raises(LossHeadError, match="otherwise than its config's final_logit_softcapping"):
        _step(model)


def test_labels_for_fewer_positions_than_the_head_projects_are_refused() -> None:
    model = _model("llama")
    ids, labels = _batch(model)
    chunk_loss_head(model, chunk_size=CHUNK)
    with pytest.raises(LossHeadError, match="projects 2 positions but the labels give 128"):
        model(input_ids=ids, labels=labels, logits_to_keep=1)


def test_a_compiled_model_is_refused() -> None:
    model = _model("llama")
    model._compiled_call_impl = object()  # what torch.compile(model) in place leaves (m.compile())
    with pytest.raises(LossHeadError, match=r"is already compile.*install it first"):
        chunk_loss_head(model)
    assert loss_head_chunk_size(model) is None


def test_a_head_sharded_by_tensor_parallelism_is_refused(tmp_path: Any) -> None:
    """A vocabulary-sharded ``lm_head`` (a DTensor outside FSDP): refused at install, and
    at the forward when the head was sharded after it (one rank, gloo)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = _model("llama")
        cls = type(model)
        parallelize_module(model.lm_head, mesh, ColwiseParallel())
        with pytest.raises(LossHeadError, match=r"lm_head.weight is a DTensor sharded as \(Shard"):
            chunk_loss_head(model)
        _untouched(model, cls)
        model = _model("llama")
        chunk_loss_head(model, chunk_size=CHUNK)
        parallelize_module(model.lm_head, mesh, ColwiseParallel())
        with pytest.raises(LossHeadError, match=r"DTensor.*set loss_head: full"):
            _step(model)
    finally:
        dist.destroy_process_group()


def test_every_refusal_is_a_graphswap_error() -> None:
    assert issubclass(LossHeadError, GraphswapError) and issubclass(LossHeadError, ValueError)
