"""The deprecation warning every old path gives (a
:class:`~graphswap.errors.GraphswapDeprecationWarning`), pointing at the user's line."""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import Any

from graphswap._compat._table import PACKAGES
from graphswap.errors import GraphswapDeprecationWarning

REMOVED_IN = "0.3"
"""The release that deletes :mod:`graphswap._compat`, and with it every old path."""


def resolve(target: str) -> Any:
    """The object at ``"module:name"``."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def dotted(target: str) -> str:
    """``"module:name"`` as a user writes it: ``module.name``."""
    return target.replace(":", ".")


def warn(message: str, inside: str | tuple[str, ...] | None = None) -> None:
    """A :class:`GraphswapDeprecationWarning` that points at the user's line: past this
    package, the import machinery, 0.1.0's top-level ``passes`` and the packages
    ``inside`` (the one whose function was called; for an unpickled object, also torch
    and pickle, which called it), so Python's default filter shows it in scripts."""
    level = 2
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and _skipped(frame, inside):
        # warnings.warn leaves the import system's own frames out of the count itself.
        level, frame = level + (not _bootstrap(frame)), frame.f_back
    warnings.warn(
        f"{message} (removed in {REMOVED_IN})", GraphswapDeprecationWarning, stacklevel=level
    )


def _skipped(frame: types.FrameType, inside: str | tuple[str, ...] | None) -> bool:
    name = frame.f_globals.get("__name__", "")
    return (
        name.startswith("graphswap._compat")
        or name in ("importlib", *PACKAGES)
        or _bootstrap(frame)
        or (inside is not None and name.startswith(inside))
    )


def _bootstrap(frame: types.FrameType) -> bool:
    return "importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename
