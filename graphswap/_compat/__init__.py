"""Every path, name, flag and pickle of graphswap 0.1.0 (and 0.2.0) that
moved, kept working until 0.3 with a ``DeprecationWarning`` (on stderr, for the command
line) naming the new one.

All of it is here, so 0.3 deletes this package and its call sites, which import it by
this name: the finder that serves 0.1.0's module paths (:func:`install`, called by
``graphswap/__init__``), the ``__getattr__`` of the packages whose names moved
(:func:`module_getattr`), renamed class attributes (:class:`Renamed`, and
:func:`renamed_override` for a method a subclass implements), renamed keywords
(:func:`renamed_keywords`, :func:`renamed_kwargs`; the runtime's swap options,
:data:`RENAMED_SWAP_OPTIONS`), the planner's flat keywords (:func:`flat_settings`,
:func:`flat_fit_settings`, :func:`schedule_keywords`), the command line's old flags and
command (:func:`add_old_flags`, :func:`add_old_commands`) and the loaders of older
pickles (:func:`manager_state`, :func:`rules_of_today`). The table of what moved where
is :mod:`._table`. Nothing here imports the rest of graphswap (targets are dotted
names, imported on use), so the package sits under every layer.
"""

from graphswap._compat._attrs import (
    Package,
    Renamed,
    module_getattr,
    moved_package,
    renamed_keywords,
    renamed_kwargs,
    renamed_override,
)
from graphswap._compat._cli import add_old_commands, add_old_flags
from graphswap._compat._finder import install
from graphswap._compat._flat_settings import (
    flat_fit_settings,
    flat_settings,
    schedule_keywords,
)
from graphswap._compat._pickles import manager_state, rules_of_today
from graphswap._compat._table import RENAMED_SWAP_OPTIONS
from graphswap._compat._warn import REMOVED_IN, resolve, warn

__all__ = [
    "REMOVED_IN",
    "RENAMED_SWAP_OPTIONS",
    "Package",
    "Renamed",
    "add_old_commands",
    "add_old_flags",
    "flat_fit_settings",
    "flat_settings",
    "install",
    "manager_state",
    "module_getattr",
    "moved_package",
    "renamed_keywords",
    "renamed_kwargs",
    "renamed_override",
    "resolve",
    "rules_of_today",
    "schedule_keywords",
    "warn",
]
