"""Deprecated: the 0.1.0 path of :mod:`graphswap.passes.plan_executor`, removed in 0.3."""

from graphswap._deprecated import moved

__getattr__ = moved(__name__)
