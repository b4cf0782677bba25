"""The one class swap behind ``swap_wrapper``, ``recompute_wrapper`` and the chunked loss
head: a module keeps its object, FQNs, ``state_dict`` keys and ``isinstance`` under a
generated class, named with the wrapper's prefix or, for code that records classes by
name (``save_pretrained``), as the original; the class pickles by its recipe with the
wrapper's state, and undo gives the exact class back."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch

from graphswap.errors import GraphswapTypeError
from graphswap.runtime._class_swap import ClassSwap, Forward


class Prefixed:
    """Marker of ``_PREFIXED``'s classes."""


class Named:
    """Marker of ``_NAMED``'s classes."""


def _doubled(original: Forward) -> Forward:
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs) * self.__dict__["_test_state"]

    return forward


def _described(cls: type) -> dict[str, Any]:
    return {"described": f"a {cls.__name__} that scales its output"}


_PREFIXED = ClassSwap(
    prefix="Scaled", marker=Prefixed, state_attr="_test_state", forward=_doubled, wrapper="scaled"
)
_NAMED = ClassSwap(
    prefix=None,
    marker=Named,
    state_attr="_test_state",
    forward=_doubled,
    wrapper="named",
    members=_described,
)


@_PREFIXED.bind
def _prefixed_class(cls: type[torch.nn.Module]) -> type:
    return _PREFIXED.generated(cls)


@_NAMED.bind
def _named_class(cls: type[torch.nn.Module]) -> type:
    return _NAMED.generated(cls)


def _toy() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())


@pytest.mark.parametrize(
    ("swap", "name"), [(_PREFIXED, "ScaledSequential"), (_NAMED, "Sequential")]
)
def test_a_swapped_module_stays_itself_pickles_and_undoes(swap: ClassSwap, name: str) -> None:
    module = _toy()
    keys, x = list(module.state_dict()), torch.randn(2, 4)
    expected = module(x) * 3
    swap.install(module, 3)
    assert isinstance(module, torch.nn.Sequential) and isinstance(module, swap.marker)
    assert type(module).__name__ == name and swap.state(module) == 3
    assert list(module.state_dict()) == keys and torch.equal(module(x), expected)
    if swap.prefix is None:
        original = torch.nn.Sequential
        assert type(module).__module__ == original.__module__
        assert type(module).__qualname__ == original.__qualname__
        assert type(module).described == "a Sequential that scales its output"
    for copied in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
        assert type(copied) is type(module) and swap.state(copied) == 3
        assert torch.equal(copied(x), expected)
    swap.remove(module, torch.nn.Sequential)
    assert type(module) is torch.nn.Sequential and swap.state(module) is None
    assert "_test_state" not in module.__dict__


def test_one_generated_class_per_original_and_swap() -> None:
    first, second = _toy(), _toy()
    _PREFIXED.install(first, 1)
    _PREFIXED.install(second, 2)
    assert type(first) is type(second) is _prefixed_class(torch.nn.Sequential)
    assert _named_class(torch.nn.Sequential) is not type(first)


def test_a_class_of_another_metaclass_is_refused_naming_the_wrapper() -> None:
    class Meta(type):
        pass

    class Odd(torch.nn.Module, metaclass=Meta):
        pass

    with pytest.raises(GraphswapTypeError, match=r"^scaled supports modules whose class"):
        _PREFIXED.generated(Odd)
