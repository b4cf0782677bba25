"""graphswap.hf.decoder on hand-built modules: what tensor parallelism can shard by heads,
and the list of module types a model without declared decoder classes gets."""

from __future__ import annotations

import pytest
from torch import nn

from graphswap.errors import NoMatchError
from graphswap.hf.decoder import decoder_classes, head_sharding_problem


class Attention(nn.Module):
    def __init__(self, head_dim: int = 8, heads: int = 4, **extra: nn.Module) -> None:
        super().__init__()
        self.head_dim = head_dim
        width = head_dim * heads
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, nn.Linear(width, width))
        for name, module in extra.items():
            setattr(self, name, module)


@pytest.mark.parametrize(
    ("attention", "problem"),
    [
        (Attention(), None),
        (Attention(q_norm=nn.LayerNorm(8), k_norm=nn.LayerNorm(8), act=nn.SiLU()), None),
        (Attention(gate=nn.Linear(32, 32)), "Attention.gate (Linear) holds weights of its own"),
        (Attention(q_norm=nn.LayerNorm(32)), "Attention.q_norm normalizes across all heads"),
    ],
)
def test_head_sharding_takes_projections_and_per_head_norms_only(
    attention: nn.Module, problem: str | None
) -> None:
    found = head_sharding_problem(attention)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_a_long_list_of_module_types_is_cut_and_counted() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList(
        [type(f"Block{i}", (nn.Module,), {})() for i in range(14)]  # 14 distinct classes
    )
    with pytest.raises(NoMatchError) as info:
        decoder_classes(model, rule="attn_swap")
    message = str(info.value)
    assert "module types found: torch.nn.modules.module.Module," in message
    assert "(+4 more). Fix: pass a Hugging Face decoder model" in message
