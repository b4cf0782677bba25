"""``graphswap plan``: show the pass plan a training config asks for, and check it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

FORMATS = ("text", "dot", "json")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show and check the model-infrastructure passes a training config asks for",
        description=(
            "Resolve a training config, list its passes (swap, tensor parallel, activation"
            " checkpointing, compile, FSDP, ...) in the order they run, and check their"
            " order and exclusions. Exits 1 with the reason on stderr when the config or"
            " the plan is rejected."
        ),
    )
    parser.add_argument("--config", metavar="FILE", help="training YAML (default: all defaults)")
    parser.add_argument(
        "--format", choices=FORMATS, default="text", help="output format (default: text)"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="settings that override the file"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import passes
    from graphswap.config import ConfigError, resolve_config

    try:
        plan = passes.plan(resolve_config(args.config, args.overrides)).check()
    except (ConfigError, passes.PlanError) as error:
        print(f"graphswap plan: {error}", file=sys.stderr)
        return 1
    render = {"text": plan.to_text, "dot": plan.to_dot, "json": plan.to_json}[args.format]
    sys.stdout.write(render())
    return 0
