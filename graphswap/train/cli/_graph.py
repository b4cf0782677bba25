"""``graphswap graph``: write the prefetch graph that a rewrite builds for a model.

The model is built on the meta device from its config only, so the graph of a
235B-parameter checkpoint costs no memory and no download.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from graphswap import _compat
from graphswap.train.cli._args import num_layers_option, user_error

DEFAULT_PRESET = "graph-default"
DEFAULT_RULE = "attn_swap"
FORMATS = ("dot", "json", "svg", "png")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "graph",
        help="write the prefetch graph of a swap rewrite (DOT, JSON, SVG or PNG)",
        description=(
            "Build a Hugging Face decoder (the family --model's config.json names, or a "
            "Qwen3-MoE preset) on the meta device (no weights, no downloads), apply "
            "the rewrite rules and write the resulting prefetch graph. Without --model the "
            f"embedded preset {DEFAULT_PRESET!r} is used: 48 layers, as in Qwen3-30B-A3B, "
            "at tiny widths."
        ),
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        help="local Hugging Face checkpoint folder; only its config.json is read",
    )
    num_layers_option(parser)
    parser.add_argument(
        "--rule",
        dest="rules",
        action="append",
        metavar="NAME",
        help=f"rewrite rule to apply; repeatable (default: {DEFAULT_RULE})",
    )
    parser.add_argument("--format", choices=FORMATS, default="dot", help="output format")
    parser.add_argument(
        "-o", "--output", metavar="FILE", help="write here instead of standard output"
    )
    _compat.add_old_flags(parser, "graph")
    parser.set_defaults(run=run)


def _output_problem(path: Path) -> str | None:
    """Why ``path`` cannot be written, or ``None``."""
    if path.is_dir():
        return "is a folder; give a file name"
    if not path.parent.is_dir():
        return f"its folder {str(path.parent)!r} does not exist; create it or write elsewhere"
    return None


def run(args: argparse.Namespace) -> int:
    # Deferred so that `graphswap --help` does not load torch (see graphswap.train.cli).
    from graphswap.hf.checkpoints import CheckpointError, build_model, model_config
    from graphswap.rewriting.apply import RewriteError, rewrite
    from graphswap.rewriting.graph import RENDER_FORMATS, require_graphviz, to_dot, to_json
    from graphswap.rewriting.graph import render as render_graph

    # Checked before the model is built: a wrong input should fail at once.
    if args.output is not None:
        problem = _output_problem(Path(args.output))
        if problem:
            return user_error("graph", f"-o {args.output}: {problem}")
    try:
        if args.format in RENDER_FORMATS:
            require_graphviz(args.format)
        config = model_config(DEFAULT_PRESET, args.model, num_layers=args.num_layers)
    except CheckpointError as exc:
        return user_error("graph", f"--model {args.model}: {exc}")
    except (OSError, ValueError, RuntimeError) as exc:
        return user_error("graph", str(exc))
    model = build_model(config, device="meta")
    try:
        report = rewrite(model, args.rules or [DEFAULT_RULE])
    except RewriteError as exc:
        return user_error("graph", str(exc))
    if args.format == "dot":
        data = to_dot(report.graph).encode()
    elif args.format == "json":
        data = to_json(report.graph).encode()
    else:
        try:
            data = render_graph(report.graph, args.format)
        except RuntimeError as exc:
            return user_error("graph", str(exc))
    if args.output is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        Path(args.output).write_bytes(data)
    print(str(report), file=sys.stderr)
    return 0
