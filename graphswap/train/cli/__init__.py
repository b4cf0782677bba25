"""The ``graphswap`` console script: one sub-command per module, imported by name.

Each sub-command module defines ``add_parser(subparsers)`` and keeps its heavy
imports (torch, transformers) inside the function that runs, so that ``--help``
stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

_COMMAND_MODULES = (
    "graphswap.train.cli._train",
    "graphswap.train.cli._graph",
    "graphswap.train.cli._passes",
    "graphswap.train.cli._memory",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphswap",
        description="Activation swap for transformer training.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse ends a positional list at the first option, so `train steps=1
    # --no-progress seed=2` leaves seed=2 over: overrides may follow options.
    overrides = getattr(args, "overrides", None)
    if extra and overrides is not None and not any(a.startswith("-") for a in extra):
        overrides.extend(extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:
        # The reader (``| head``) has gone: not an error of ours, and nothing more to say.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0


if __name__ == "__main__":
    sys.exit(main())
