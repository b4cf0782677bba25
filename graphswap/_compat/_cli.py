"""0.1.0's spellings on the command line: its flags, hidden aliases that warn on stderr
(``plan-memory --policy``), and its ``graphswap plan``, the command ``passes`` now."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from graphswap._compat._warn import REMOVED_IN

FLAGS: dict[str, dict[str, str]] = {
    "graph": {"--layers": "--num-layers"},
    "plan-memory": {
        "--seq": "--seq-len",
        "--batch": "--batch-size",
        "--layers": "--num-layers",
        "--bandwidth": "--swap-bandwidth-gbps",
        "--tflops": "--swap-tflops",
        "--tp": "--tp-size",
        "--policy": "--activation-swap",
        "--budget": "--activation-memory-budget",
        "--hide-margin": "--swap-hide-margin",
        "--offload-lag": "--swap-offload-lag",
        "--prefetch-depth": "--swap-prefetch-depth",
    },
}
"""Per command, 0.1.0's flag -> the flag now (the trainer config's key with dashes)."""

COMMANDS: dict[str, str] = {"plan": "passes"}
"""0.1.0's command -> its name now: ``plan`` read as the memory plan (``plan-memory``)."""


class DeprecatedAlias(argparse.Action):
    """A flag's name in 0.1.0: warns on stderr naming the flag to use, then acts as that
    flag (given at most once, between the two names)."""

    def __init__(self, *args: Any, target: argparse.Action, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.target = target

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        new = self.target.option_strings[0]
        print(
            f"{parser.prog}: warning: {option_string} is deprecated and will be removed;"
            f" use {new} {values}",
            file=sys.stderr,
        )
        self.target(parser, namespace, values, option_string)


def add_old_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Accept ``command``'s 0.1.0 flags (:data:`FLAGS`), unlisted in its help: call it
    once the command's own flags are added."""
    actions = {flag: action for action in parser._actions for flag in action.option_strings}
    for old, new in FLAGS[command].items():
        target = actions[new]
        typed: dict[str, Any] = {"type": target.type} if target.type is not None else {}
        parser.add_argument(
            old,
            dest=target.dest,
            action=DeprecatedAlias,
            target=target,
            choices=target.choices,
            help=argparse.SUPPRESS,
            **typed,
        )


def add_old_commands(
    subparsers: Any,
    command: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    description: str,
) -> None:
    """Accept ``command``'s 0.1.0 name (:data:`COMMANDS`), unlisted in ``graphswap
    --help``: it warns on stderr naming the command to use, then runs it."""
    for old, new in COMMANDS.items():
        if new != command:
            continue

        def run_old(args: argparse.Namespace, old: str = old) -> int:
            print(
                f"graphswap {old}: warning: graphswap {old} is deprecated and will be"
                f" removed in {REMOVED_IN}; use graphswap {command}",
                file=sys.stderr,
            )
            return run(args)

        # No help=: argparse lists a sub-command only with one, so the old name stays unlisted.
        parser = subparsers.add_parser(old, description=description)
        add_arguments(parser)
        parser.set_defaults(run=run_old)
