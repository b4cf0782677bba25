"""What the sub-commands share: argument types, and how a user error ends a command."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

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


class Once(argparse.Action):
    """An option given at most once: argparse keeps the last of several values, so
    ``--config a.yaml --config b.yaml`` would drop a.yaml without a word."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        earlier = getattr(namespace, self.dest, None)
        if earlier is not None:
            parser.error(f"{option_string} {values}: given twice (first {earlier}); give it once")
        setattr(namespace, self.dest, values)


def num_layers_option(parser: argparse.ArgumentParser) -> None:
    """``--num-layers``, for the commands that build a model; unset, the preset's or
    config.json's count applies."""
    parser.add_argument(
        "--num-layers",
        action=Once,
        default=None,
        type=positive_int,
        metavar="N",
        help="number of decoder layers (overrides the preset or config.json), as the trainer"
        " config's num_layers",
    )
