"""Argument types shared by the sub-commands."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """A rate on the command line: the rule ``graphswap train`` applies to its config."""
    # Deferred: importing graphswap imports torch, which `graphswap --help` does not need.
    from graphswap.config import ConfigError, check_finite_positive

    try:
        return check_finite_positive("", float(text))
    except ConfigError as error:
        raise argparse.ArgumentTypeError(error.detail) from None
