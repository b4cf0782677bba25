"""What the sub-commands share: argument types, and how a user error ends a command."""

from __future__ import annotations

import argparse
import math
import sys

USER_ERROR = 2
"""The exit code of every refused input, as argparse's own refusals exit."""


def user_error(command: str, message: str) -> int:
    """Say ``graphswap COMMAND: error: MESSAGE`` on stderr, argparse's form, and return
    :data:`USER_ERROR`: every command ends a user error the same way."""
    print(f"graphswap {command}: error: {message}", file=sys.stderr)
    return USER_ERROR


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
