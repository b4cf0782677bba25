"""One base for every error: ``except graphswap.GraphswapError`` catches anything
graphswap raises on purpose, whichever module defines it, the pass plan's included."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings
from types import ModuleType

import graphswap
from graphswap import _deprecated
from graphswap.errors import GraphswapError


def every_module() -> list[ModuleType]:
    """Every module of the package, the pass plan's included, imported (0.1.0's shims
    define nothing and warn)."""
    modules = [graphswap]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for info in pkgutil.walk_packages(graphswap.__path__, "graphswap."):
            if info.name not in _deprecated.MODULES and not info.name.endswith(".__main__"):
                modules.append(importlib.import_module(info.name))
    assert "graphswap.passes.errors" in {module.__name__ for module in modules}
    return modules


def test_every_exception_class_derives_from_the_one_base() -> None:
    defined = {
        cls
        for module in every_module()
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__ and issubclass(cls, BaseException)
    }
    errors = {cls for cls in defined if not issubclass(cls, Warning)}
    assert {"PlanError", "HazardError", "ConfigError"} <= {cls.__name__ for cls in errors}
    stray = sorted(cls.__qualname__ for cls in errors if not issubclass(cls, GraphswapError))
    assert stray == [], f"derive these from graphswap.errors.GraphswapError: {stray}"
