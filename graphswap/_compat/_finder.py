"""0.1.0's module paths, served by an import hook: no file stands at an old place.

``import graphswap.policy`` finds no file; the finder on ``sys.meta_path`` (put there
by ``import graphswap``, which every old path imports first) makes a module that warns
on import and finds each of its old names in the new module. ``graphswap.cli`` is a
package, as in 0.1.0, so that ``python -m graphswap.cli`` (what torchrun users typed)
finds its ``__main__``, whose code runs the command.
"""

from __future__ import annotations

import importlib.abc
import sys
import types
from collections.abc import Sequence
from importlib.machinery import ModuleSpec

from graphswap._compat._attrs import moved
from graphswap._compat._table import MODULES

_CLI_MAIN = "graphswap.cli.__main__"
_CLI_MAIN_SOURCE = """\
import sys

from graphswap._compat._warn import warn
from graphswap.train.cli import main

warn("python -m graphswap.cli is deprecated: use python -m graphswap.train.cli")
sys.exit(main())
"""
_PACKAGES = ("graphswap.cli",)
"""Old paths that were packages: they have submodules (``__main__``)."""


def _cli_main_code() -> types.CodeType:
    return compile(_CLI_MAIN_SOURCE, f"<{_CLI_MAIN}>", "exec")


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finder and loader of the old module paths. (``importlib.abc`` costs ``import
    graphswap`` nothing: torch imports it.)"""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in MODULES and fullname != _CLI_MAIN:
            return None
        return ModuleSpec(fullname, self, origin=__package__, is_package=fullname in _PACKAGES)

    def create_module(self, spec: ModuleSpec) -> None:
        """The default module."""

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == _CLI_MAIN:
            exec(_cli_main_code(), vars(module))
        else:
            module.__getattr__ = moved(module.__name__)  # type: ignore[method-assign]

    def is_package(self, fullname: str) -> bool:
        return fullname in _PACKAGES

    def get_code(self, fullname: str) -> types.CodeType | None:
        """``runpy`` (``python -m``) runs a module by its code: the old modules have none,
        ``graphswap.cli.__main__`` runs the command."""
        return _cli_main_code() if fullname == _CLI_MAIN else None

    def get_source(self, fullname: str) -> str | None:
        return _CLI_MAIN_SOURCE if fullname == _CLI_MAIN else None


def install() -> None:
    """Put the finder on ``sys.meta_path``, once, first: it answers only for the old
    paths, and before any other finder, so that no file left at an old place (a stale
    checkout an editable install's finder maps ``graphswap.*`` to) is imported instead."""
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, OldPaths())
