"""rewrite() and PEFT's LoRA, in either order: the swap rules find the Hugging Face model
inside a ``PeftModel``, ``get_peft_model`` finds its targets inside swap-wrapped modules,
names and types stay, and the adapters train bitwise as they do without swap."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import graphswap
from graphswap.errors import AlreadyTransformedError
from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import preset_config
from graphswap.rewriting.apply import rewrite, rewrite_report, unrewrite
from graphswap.rewriting.rules import with_policy
from graphswap.runtime import is_swap_wrapped
from graphswap.runtime.policy import size_threshold_policy

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
POLICY = size_threshold_policy(4 << 10, name="peft_test_policy")
"""Small enough that a 64-token tiny model swaps."""


def peft_model(net: nn.Module) -> nn.Module:
    """``net`` with rank-4 adapters, initialised alike on every call (B non-zero, so that
    the base weights' path and the adapters' both reach the loss)."""
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    return peft.get_peft_model(net, config)


def step(net: nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward: the loss and every gradient, by parameter name."""
    ids = torch.randint(2, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    loss = net(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return loss.item(), grads


def assert_bitwise(
    got: tuple[float, dict[str, torch.Tensor]], expected: tuple[float, dict[str, torch.Tensor]]
) -> None:
    assert got[0] == expected[0]
    assert got[1].keys() == expected[1].keys()
    for name, grad in expected[1].items():
        assert torch.equal(got[1][name], grad), name


def fresh(preset: str) -> nn.Module:
    torch.manual_seed(0)
    return build_model(preset_config(preset))


ORDERS: dict[str, Callable[[nn.Module, str], nn.Module]] = {
    "after": lambda net, rule: _rewritten(peft_model(net), rule),
    "before": lambda net, rule: peft_model(_rewritten(net, rule)),
}


def _rewritten(net: nn.Module, rule: str) -> nn.Module:
    rewrite(net, with_policy(rule, POLICY))
    return net


@pytest.mark.parametrize("order", ["after", "before"])
@pytest.mark.parametrize(
    ("preset", "rule"),
    [("tiny-llama", "attn_swap"), ("tiny-llama", "layer_swap"), ("tiny", "qwen3_moe_layer_swap")],
)
def test_rewrite_before_or_after_get_peft_model_trains_the_adapters_bitwise(
    preset: str, rule: str, order: str
) -> None:
    """The swapped step's loss and adapter gradients are the plain LoRA step's, bit for
    bit; only the adapters get gradients; parameter names and the classes a user checks
    with isinstance are LoRA's as without swap; the swap moved activations."""
    plain = peft_model(fresh(preset))
    expected = step(plain)
    swapped = ORDERS[order](fresh(preset), rule)
    assert_bitwise(step(swapped), expected)
    assert set(expected[1]) and all("lora_" in name for name in expected[1])
    assert list(swapped.state_dict()) == list(plain.state_dict())
    for (fqn, module), (_, original) in zip(
        swapped.named_modules(), plain.named_modules(), strict=True
    ):
        assert isinstance(module, type(original)), fqn
    report = rewrite_report(swapped)
    assert report is not None and report.manager.stats.offloaded_bytes > 0
    wrapped = [fqn for fqn, m in swapped.named_modules() if is_swap_wrapped(m)]
    assert wrapped and all(".layers." in fqn for fqn in wrapped)
    inside = [fqn for fqn, m in swapped.named_modules() if isinstance(m, peft.tuners.lora.Linear)]
    assert any(fqn.startswith(f"{w}.") for w in wrapped for fqn in inside)


@pytest.mark.parametrize("order", ["after", "before"])
def test_unrewrite_leaves_the_peft_model_as_get_peft_model_made_it(order: str) -> None:
    """Undone, the model holds no wrapper and the types it held before the swap."""
    plain = peft_model(fresh("tiny-llama"))
    swapped = ORDERS[order](fresh("tiny-llama"), "layer_swap")
    unrewrite(swapped)
    assert not any(is_swap_wrapped(m) for m in swapped.modules())
    assert [type(m) for m in swapped.modules()] == [type(m) for m in plain.modules()]
    assert rewrite_report(swapped) is None
    assert_bitwise(step(swapped), step(plain))


def test_a_rewritten_peft_model_refuses_a_second_rewrite() -> None:
    """Wrapping wrappers is refused through the PeftModel as on the model itself."""
    net = peft_model(fresh("tiny-llama"))
    graphswap.rewrite(net, "layer_swap")
    with pytest.raises(AlreadyTransformedError, match="unrewrite"):
        graphswap.rewrite(net, "attn_swap")
