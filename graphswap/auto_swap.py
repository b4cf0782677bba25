"""Deprecated: the 0.1.0 path of :mod:`graphswap.planning.auto_swap`, removed in 0.3."""

from graphswap._deprecated import moved

__getattr__ = moved(__name__)
