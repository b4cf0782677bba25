"""The class swap the swap and recompute wrappers and the chunked loss head share: a
module's class is changed for a generated subclass, and changed back on undo.

Like FSDP2's ``fully_shard``, a wrapper does not replace the module object: it sets
``module.__class__`` to a subclass of the module's own class that it generated once per
class, whose ``forward`` the wrapper supplies (``Swap<Class>``, ``Recompute<Class>``; the
chunked loss head's keeps the original's name, which ``save_pretrained`` records as the
architecture). The object, its parameters, buffers, FQNs, ``state_dict`` keys,
attributes and ``isinstance`` all stay as they were; the wrapper's per-module state
lives in the module's ``__dict__`` under one attribute, so it pickles and deep-copies
with the module; undo puts the exact original class back. A generated class pickles as
the call that makes it (its ``recipe``, a module-level function of the wrapper), so a
wrapped model survives ``pickle``, ``torch.save`` and ``copy.deepcopy`` with the wrapper
installed.
"""

from __future__ import annotations

import copyreg
import functools
from collections.abc import Callable
from typing import Any

import torch

from graphswap.errors import GraphswapTypeError

Forward = Callable[..., Any]
"""A module class's ``forward``, unbound: ``forward(module, *args, **kwargs)``."""


class _Generated(type):
    """Metaclass of every generated class: lets it pickle by recipe, not by name."""

    _graphswap_original: type
    """The class it was generated from, and unwrap restores."""
    _graphswap_recipe: Callable[[type], type]
    """The wrapper's module-level function that makes it from the original class."""


def _reduce_generated(cls: _Generated) -> tuple[Any, tuple[type]]:
    return cls._graphswap_recipe, (cls._graphswap_original,)


copyreg.pickle(_Generated, _reduce_generated)


class ClassSwap:
    """One wrapper's class swap: its generated classes (one per original class, cached),
    the marker base they share (what ``is_*_wrapped`` tests), and its state attribute."""

    def __init__(
        self,
        *,
        prefix: str | None,
        marker: type,
        state_attr: str,
        forward: Callable[[Forward], Forward],
        wrapper: str,
        members: Callable[[type], dict[str, Any]] | None = None,
    ) -> None:
        self.prefix = prefix
        """The generated class's name is ``prefix`` + the original's; ``None``: the
        original's name, qualified name and module, for code that records a class by
        its name (``save_pretrained``'s architecture)."""
        self.marker = marker  # the base every generated class of this wrapper has first
        self.state_attr = state_attr  # the module ``__dict__`` key of the wrapper's state
        self.forward = forward  # given the original ``forward``, the generated one's
        self.wrapper = wrapper  # the wrapper's name, for errors
        self.members = members
        """Given the original class, more members of the generated one (the chunked
        head's ``loss_function``); ``None``: ``forward`` only."""
        self.recipe: Callable[[type], type] | None = None
        """The module-level function that pickles name for ``generated`` (``bind``)."""
        self._classes: dict[type, type] = {}  # original class -> generated class

    def bind(self, recipe: Callable[[type], type]) -> Callable[[type], type]:
        """Name ``recipe`` (the wrapper's module-level ``generated``) as what pickles
        rebuild a generated class with; returns it, so it can decorate it."""
        self.recipe = recipe
        return recipe

    def generated(self, cls: type[torch.nn.Module]) -> type:
        """The generated subclass of ``cls``, made on first use; its ``forward`` carries
        the original's signature (Hugging Face inspects ``forward`` parameters)."""
        made = self._classes.get(cls)
        if made is None:
            if type(cls) is not type:
                raise GraphswapTypeError(
                    f"{self.wrapper} supports modules whose class has the default metaclass;"
                    f" {cls.__qualname__} uses {type(cls).__qualname__}"
                )
            assert self.recipe is not None  # bound at import, by the wrapper's module
            original = cls.forward
            namespace: dict[str, Any] = {
                "__module__": self.recipe.__module__,
                **(self.members(cls) if self.members is not None else {}),
                "forward": functools.wraps(original)(self.forward(original)),
                "_graphswap_original": cls,
                "_graphswap_recipe": self.recipe,
            }
            name = cls.__name__
            if self.prefix is None:
                namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
            else:
                name = f"{self.prefix}{name}"
            made = self._classes[cls] = _Generated(name, (self.marker, cls), namespace)
        return made

    def install(self, module: torch.nn.Module, state: Any) -> None:
        """Give ``module`` its generated class and the wrapper's ``state``."""
        generated = self.generated(type(module))
        module.__dict__[self.state_attr] = state
        module.__class__ = generated

    def state(self, module: torch.nn.Module) -> Any:
        """The wrapper's state of ``module``; None when it is not wrapped."""
        return module.__dict__.get(self.state_attr)

    def remove(self, module: torch.nn.Module, original: type) -> None:
        """Put ``original`` back as ``module``'s class and drop the wrapper's state."""
        module.__class__ = original
        del module.__dict__[self.state_attr]
