"""One base for every error: ``except graphswap.GraphswapError`` catches anything
graphswap raises on purpose, whichever module defines it, the pass plan's included, and
every ``raise`` in the package raises such a class (issue 31)."""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import inspect
import os
import pkgutil
import typing
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import graphswap
from graphswap import errors
from graphswap.errors import GraphswapError
from graphswap.runtime import _group, _handles

PACKAGE = Path(graphswap.__file__).parent

_ARGPARSE = (
    "argparse's protocol for a type= function: argparse prints it as the command's usage"
    " error and exits 2, as for its own refusals; it never reaches a caller"
)
ALLOWED: dict[tuple[str, type[BaseException]], str] = {
    ("graphswap._compat._attrs", AttributeError): (
        "a module's __getattr__ must raise AttributeError for a missing name: hasattr,"
        " getattr with a default and `from m import name` rely on it"
    ),
    ("graphswap.train.cli._args", argparse.ArgumentTypeError): _ARGPARSE,
    ("graphswap.train.cli._memory", argparse.ArgumentTypeError): _ARGPARSE,
}
"""(module, class) -> why that module raises a class outside the one base: Python's or a
library's protocols, never a refusal of graphswap's own. A bare ``raise`` re-raises and
names no class. None raises ``NotImplementedError`` (``abc`` refuses an engine missing a
method) or ``StopIteration`` by hand."""


def every_module() -> list[ModuleType]:
    """Every module of the package, the pass plan's included, imported (0.1.0's module
    paths have no file: ``graphswap._compat`` makes them on import)."""
    modules = [graphswap]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for info in pkgutil.walk_packages(graphswap.__path__, "graphswap."):
            if not info.name.endswith(".__main__"):
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
    assert {"PassPlanError", "HazardError", "ConfigError"} <= {cls.__name__ for cls in errors}
    stray = sorted(cls.__qualname__ for cls in errors if not issubclass(cls, GraphswapError))
    assert stray == [], f"derive these from graphswap.errors.GraphswapError: {stray}"


@dataclass(frozen=True)
class _Made:
    """What calling ``cls`` (or a function that returns one) evaluates to: an instance."""

    cls: type


def _returned(func: Any) -> object:
    """What calling ``func`` gives, by its return annotation: an instance of the class it
    names, or for ``type[C]`` the class ``C``."""
    func = inspect.unwrap(func)
    hint = func.__annotations__.get("return")
    if isinstance(hint, str):  # postponed: ``from __future__ import annotations``
        hint = eval(hint, func.__globals__)
    if typing.get_origin(hint) is type:
        return typing.get_args(hint)[0]
    if isinstance(hint, type):
        return _Made(hint)
    raise LookupError(f"{func!r} has no return annotation that names an exception class")


def _value(node: ast.expr, scopes: list[ast.AST], module: ModuleType) -> object:
    """What ``node`` evaluates to, as far as names, attributes and annotated calls tell:
    a local name by its one assignment in an enclosing function, then the module's
    globals, then the builtins."""
    if isinstance(node, ast.Name):
        for scope in reversed(scopes):
            assigned = [
                statement.value
                for statement in ast.walk(scope)
                if isinstance(statement, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == node.id for t in statement.targets)
            ]
            if len(assigned) == 1:
                return _value(assigned[0], scopes, module)
        for namespace in (vars(module), vars(builtins)):
            if node.id in namespace:
                return namespace[node.id]
    elif isinstance(node, ast.Attribute):
        return getattr(_value(node.value, scopes, module), node.attr)
    elif isinstance(node, ast.Call):
        callee = _value(node.func, scopes, module)
        return _Made(callee) if isinstance(callee, type) else _returned(callee)
    raise LookupError(f"cannot tell what {ast.unparse(node)!r} is")


def raised_class(node: ast.Raise, scopes: list[ast.AST], module: ModuleType) -> type:
    """The class that ``raise X``, ``raise X(...)`` or ``raise make_error(...)`` raises."""
    assert node.exc is not None
    value = _value(node.exc, scopes, module)
    raised = value.cls if isinstance(value, _Made) else value
    if not isinstance(raised, type):
        raise LookupError(f"{ast.unparse(node.exc)!r} is not an exception class")
    return raised


def raises(tree: ast.AST) -> Iterator[tuple[ast.Raise, list[ast.AST]]]:
    """Every ``raise`` that names what it raises, with its enclosing functions."""

    def walk(node: ast.AST, scopes: list[ast.AST]) -> Iterator[tuple[ast.Raise, list[ast.AST]]]:
        if isinstance(node, ast.Raise) and node.exc is not None:
            yield node, scopes
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scopes = [*scopes, node]
        for child in ast.iter_child_nodes(node):
            yield from walk(child, scopes)

    return walk(tree, [])


def package_files() -> Iterator[tuple[str, Path]]:
    """Every ``.py`` file of the installed package and its module name; ``followlinks``
    takes in ``graphswap/passes``, the link to the pass plan."""
    for folder, _, files in os.walk(PACKAGE, followlinks=True):
        for file in sorted(f for f in files if f.endswith(".py")):
            path = Path(folder, file)
            parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def test_every_raise_raises_a_graphswap_error() -> None:
    """A ``raise ValueError(...)`` added anywhere in the package fails here: raise a class
    of ``graphswap.errors`` (or of the subpackage whose concept it is) that also derives
    from the built-in type, or, for a protocol exception, add it to ``ALLOWED``."""
    stray, allowed, modules = [], set(), set()
    for name, path in package_files():
        found = list(raises(ast.parse(path.read_text(), str(path))))
        if not found:
            continue
        modules.add(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = importlib.import_module(name)
        for node, scopes in found:
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            try:
                raised = raised_class(node, scopes, module)
            except (LookupError, AttributeError) as exc:
                stray.append(f"{where}: {exc}; raise an error class by its name")
                continue
            if (name, raised) in ALLOWED:
                allowed.add((name, raised))
            elif not issubclass(raised, GraphswapError):
                stray.append(f"{where}: raise {raised.__qualname__}")
    assert {"graphswap.passes.swap", "graphswap.runtime._group"} <= modules, "the walk missed files"
    assert stray == [], "derive these from graphswap.errors.GraphswapError:\n" + "\n".join(stray)
    assert allowed == set(ALLOWED), f"allowed but no longer raised: {set(ALLOWED) - allowed}"


@pytest.mark.parametrize(
    ("source", "raised"),
    [
        ("raise ValueError('x')", "ValueError"),
        ("raise RewriteError", "RewriteError"),
        ("raise errors.SwapSetupError('x')", "SwapSetupError"),
        ("error = integrity_error\nraise error('m', (1,), 0, 1)", "SwapIntegrityError"),
        ("raise _traced_exclusion_error()('x')", "SwapExclusionError"),
    ],
)
def test_the_walk_tells_what_a_raise_raises(source: str, raised: str) -> None:
    """Names, attributes, a local bound once, and functions by their return annotation."""
    module = ModuleType("example")
    vars(module).update(
        errors=errors,
        RewriteError=errors.RewriteError,
        integrity_error=_handles.integrity_error,
        _traced_exclusion_error=_group._traced_exclusion_error,
    )
    body = "".join(f"    {line}\n" for line in source.split("\n"))
    [(node, scopes)] = raises(ast.parse(f"def f():\n{body}"))
    assert raised_class(node, scopes, module).__name__ == raised
