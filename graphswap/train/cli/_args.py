"""Argument types shared by the sub-commands."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (``inf`` and ``nan`` are refused, as ``graphswap train`` does)."""
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value!r}")
    return value
