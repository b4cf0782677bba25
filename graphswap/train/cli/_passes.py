"""``graphswap passes``: show the pass plan a training config asks for, and check it.

0.1.0 called it ``graphswap plan``, which read as the memory plan (``graphswap
plan-memory``); that name runs it still, hidden from the command list and with a
warning on stderr (:func:`graphswap._compat.add_old_commands`), until 0.3.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from graphswap import _compat
from graphswap.train.cli._args import USER_ERROR, Once, user_error

FORMATS = ("text", "dot", "json")

DESCRIPTION = (
    "Resolve a training config, list its passes (swap, tensor parallel, activation"
    " checkpointing, compile, FSDP, ...) in the order they run (canonical, or the"
    " config's pass_order, or --order), and check their order and exclusions, and"
    " check the model it names (its config.json and weights,"
    " heads divisible by tp_size), and that a plan meets activation_memory_budget (without"
    " fsdp, whose ranks' share of the state is not known here). Exits"
    f" {USER_ERROR} with the reason on stderr when graphswap train would refuse the"
    " config. The world size is not known here: the ranks the pass plan needs are printed"
    " to stderr."
)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "passes",
        help="show and check the model-infrastructure passes a training config asks for",
        description=DESCRIPTION,
    )
    _add_arguments(parser)
    parser.set_defaults(run=run)
    _compat.add_old_commands(subparsers, "passes", _add_arguments, run, DESCRIPTION)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", action=Once, metavar="FILE", help="training YAML (default: all defaults)"
    )
    parser.add_argument(
        "--format", choices=FORMATS, default="text", help="output format (default: text)"
    )
    parser.add_argument(
        "--order",
        metavar="PASS,...",
        help="run the passes in this order, checked as given (the config's pass_order), e.g."
        " swap,tensor_parallel,fsdp",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="settings that override the file"
    )


def run(args: argparse.Namespace) -> int:
    # Deferred so that `graphswap --help` does not load torch (see graphswap.train.cli).
    from graphswap import passes
    from graphswap.train.config import ConfigError, parse_names, resolve_config
    from graphswap.train.preflight import check_budget_plan, check_model, check_swap_rule

    try:
        config = resolve_config(args.config, args.overrides)
        if args.order is not None:
            config = dataclasses.replace(config, pass_order=parse_names(args.order))
        pass_plan = passes.pass_plan(config).check_runnable()
        hf_config = check_model(config)
        check_swap_rule(config, hf_config)
        check_budget_plan(config, hf_config, world_size=None)
    except (ConfigError, passes.PassPlanError) as error:
        return user_error(args.command, str(error))
    formats = {"text": pass_plan.to_text, "dot": pass_plan.to_dot, "json": pass_plan.to_json}
    sys.stdout.write(formats[args.format]())
    world = world_requirement(config.tp_size, config.fsdp)
    if world:
        print(f"graphswap {args.command}: {world}", file=sys.stderr)
    return 0


def world_requirement(tp_size: int, fsdp: bool) -> str | None:
    """What the world size must be, which the pass plan cannot see (torchrun sets it)."""
    unknown = "the world size is not known here (torchrun sets it)"
    if tp_size > 1 and fsdp:
        return (
            f"{unknown}: tp_size: {tp_size} with fsdp: true needs a multiple of {tp_size}"
            f" ranks, {tp_size} per replica"
        )
    if tp_size > 1:
        return (
            f"{unknown}: tp_size: {tp_size} without fsdp needs exactly {tp_size} ranks;"
            " set fsdp: true for more"
        )
    if fsdp:
        return f"{unknown}: fsdp: true shards over every rank started"
    return None
