"""Deprecated: the path of :mod:`graphswap.passes.plan_executor` until 0.2, removed in 0.3."""

from graphswap._deprecated import moved

__getattr__ = moved(__name__)
