"""Old names on live objects: a module's moved names, a class's renamed attributes, a
function's renamed keywords."""

from __future__ import annotations

import functools
import importlib
import pkgutil
import sys
import types
from collections.abc import Callable
from typing import Any, TypeVar

from graphswap._compat._table import MODULES, NAMES, PACKAGES, PICKLED, REMOVED, RENAMED_KEYWORDS
from graphswap._compat._warn import dotted, resolve, warn

_MISSING = object()
_UNPICKLERS = ("torch", "pickle")
F = TypeVar("F", bound=Callable[..., Any])


def old_name(old: str, search: tuple[str, ...]) -> Any:
    """What the dotted 0.1.0 path ``old`` is now: a row of the table (which warns), else
    the same name in the first module of ``search`` that has it."""
    if old in NAMES:
        # An unpickler looks a pickled class up by name: the warning points past it, at
        # the line that loaded the pickle.
        warn(f"{old} is deprecated: use {dotted(NAMES[old])}", inside=_UNPICKLERS)
        return resolve(NAMES[old])
    if old in PICKLED:
        return resolve(PICKLED[old])
    if old in REMOVED:
        raise AttributeError(f"{old} is gone since graphswap 0.1.0: use {REMOVED[old]}")
    module, _, name = old.rpartition(".")
    if not name.startswith("__"):
        for new in search:
            value = vars(importlib.import_module(new)).get(name, _MISSING)
            if value is not _MISSING:
                return value
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def module_getattr(module: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of a live module whose 0.1.0 names or submodules moved:
    ``graphswap`` (its old names, its old modules as attributes), ``graphswap.runtime``,
    ``graphswap.hf`` and ``graphswap.train`` (which were modules in 0.1.0), and
    ``graphswap.passes`` (0.1.0's top-level ``passes``, whose ``Plan`` and ``plan`` were
    renamed)."""

    def __getattr__(name: str) -> Any:
        old = f"{module}.{name}"
        if old in MODULES:
            return importlib.import_module(old)  # the finder's module warns
        return old_name(old, ())

    return __getattr__


class Renamed:
    """A class attribute under its 0.1.0 name (``seq = Renamed("seq_len")``): reading it
    warns, naming the new one, and reads that."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.message = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.message = f"{owner.__name__}.{name} is deprecated: use {owner.__name__}.{self.new}"

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        warn(self.message)
        return getattr(obj, self.new)


def renamed_keywords(
    caller: str,
    keywords: dict[str, Any],
    inside: str | None = None,
    renamed: dict[str, str] = RENAMED_KEYWORDS,
) -> dict[str, Any]:
    """``keywords`` with each old name of ``renamed`` (old -> new; by default 0.1.0's
    planner keywords) replaced by its new one, warning once per old name used at the
    first frame outside the package ``inside``; an old name given beside its new one
    stays, for the caller to refuse as unknown."""
    given = {}
    for name, value in keywords.items():
        new = renamed.get(name)
        if new is not None and new not in keywords:
            warn(f"{caller}({name}=...) is deprecated: use {new}=", inside)
            name = new
        given[name] = value
    return given


def renamed_kwargs(**renamed: str) -> Callable[[F], F]:
    """A decorator: the function accepts each keyword's old name (``old="new"``) with a
    ``DeprecationWarning`` naming the new one, and receives the new one. An old name
    given beside its new one is passed on as is, so the function refuses it as an
    unexpected keyword. ``@renamed_kwargs(offload_lag="swap_offload_lag")``."""

    def decorate(function: F) -> F:
        caller = function.__qualname__.removesuffix(".__init__")  # a class as users call it

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            kwargs = renamed_keywords(caller, kwargs, renamed=renamed)
            return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def moved(old: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of the module the finder serves at ``old``: warns once, on
    import, and finds each old name in its new module."""
    new = MODULES[old]
    warn(f"{old} is deprecated: import from {new[0]}")
    return lambda name: old_name(f"{old}.{name}", new)


def moved_package(old: str) -> None:
    """Called by the package's ``__init__`` when it runs under its old top-level name:
    warn, and make the old name and its submodules the new modules themselves. A second
    copy would have classes of its own, and ``except passes.PassPlanError`` would miss the
    errors graphswap raises."""
    new = PACKAGES[old]
    warn(f"{old} is deprecated: import from {new}")
    package = importlib.import_module(new)
    for info in pkgutil.iter_modules(package.__path__, f"{new}."):
        importlib.import_module(info.name)
    for name, module in list(sys.modules.items()):
        if name == new or name.startswith(f"{new}."):
            sys.modules[old + name.removeprefix(new)] = module


class Package(types.ModuleType):
    """``graphswap``'s module type: importing the old module path ``graphswap.rewrite``
    must not replace the function ``graphswap.rewrite`` with that module, as the import
    system would (it sets every imported submodule as an attribute of its package)."""

    def __setattr__(self, name: str, value: Any) -> None:
        old_module = f"{self.__name__}.{name}" in MODULES
        if old_module and isinstance(value, types.ModuleType) and callable(self.__dict__.get(name)):
            return
        super().__setattr__(name, value)


def renamed_override(cls: type, old: str, new: str) -> None:
    """A subclass written for 0.1.0 implements the method under its old name ``old``
    (``CopyEngine.loads``): it serves as ``new``, with a warning. Called by the base
    class's ``__init_subclass__``, whose ``old`` is a :class:`Renamed`."""
    if old in vars(cls) and new not in vars(cls):
        base = next(c for c in cls.__mro__[1:] if isinstance(vars(c).get(old), Renamed))
        warn(
            f"{cls.__qualname__}.{old}: {base.__name__}.{old} is deprecated: implement"
            f" {base.__name__}.{new}",
            inside=base.__module__,
        )
        setattr(cls, new, vars(cls)[old])
