"""``graphswap train``: the main job."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from graphswap.train.cli._args import Once, user_error

EMBEDDED_DEFAULT: dict[str, Any] = {
    "activation_swap": "attention",
    "model": "tiny",
    "seq_len": 512,
    "batch_size": 2,
    "steps": 20,
}
"""Used without ``--config``: a small Qwen3-MoE built from a config, no downloads."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a Hugging Face decoder with the configured infrastructure and print what"
        " swap saved",
        description="Train the decoder family a preset or a local config.json names (its"
        " model_type), built through the pass plan. Without --config it runs an embedded"
        " default (the tiny Qwen3-MoE, activation_swap: attention).",
    )
    parser.add_argument("--config", action=Once, help="a YAML file of TrainerConfig keys")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override a setting")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="run activation_swap none and the configured mode (attention when none) from the "
        "same seed, interleaved step by step so that their step times compare; fail if the "
        "losses differ",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(run=run)


def _init_distributed(config: Any, pass_plan: Any) -> Any:
    """Under torchrun: a process group (gloo on CPU, nccl on CUDA) and the device mesh of
    ``pass_plan``, the pass plan of one of the run's configs (they differ in the swap only)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return None
    # Deferred so that `graphswap --help` does not load torch (see graphswap.train.cli).
    import torch
    import torch.distributed as dist

    from graphswap.passes import build_mesh
    from graphswap.train.preflight import check_world, resolve_device

    # Before the rendezvous: a refused rank must not leave the others waiting for it.
    check_world(config, world_size)
    device = resolve_device(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return build_mesh(pass_plan.config, device_type=device.type, pass_plan=pass_plan)


def _as_mode(config: Any, mode: str) -> Any:
    """``config`` with ``activation_swap: mode``; for ``none`` the swap-only settings and
    the budget reset (``none`` refuses them), and the swap pass left out of a
    ``pass_order``, whose other passes keep their order."""
    # Deferred so that `graphswap --help` does not load torch (see graphswap.train.cli).
    from graphswap.train.config import PLAN_ONLY_SETTINGS, SWAP_ONLY_SETTINGS

    if mode == "none":
        order = config.pass_order
        return dataclasses.replace(
            config,
            activation_swap="none",
            activation_memory_budget=None,
            pass_order=None if order is None else tuple(n for n in order if n != "swap"),
            **SWAP_ONLY_SETTINGS,
            **PLAN_ONLY_SETTINGS,
        )
    return dataclasses.replace(config, activation_swap=mode)


def run(args: argparse.Namespace) -> int:
    # Deferred so that `graphswap --help` does not load torch (see graphswap.train.cli).
    import torch.distributed as dist

    from graphswap.errors import LossHeadError
    from graphswap.hf.checkpoints import CheckpointError
    from graphswap.passes import PassPlanError, pass_plan
    from graphswap.passes.plan_executor import PlanMismatchError
    from graphswap.train.cli._memory import format_auto_report
    from graphswap.train.config import ConfigError, resolve_config
    from graphswap.train.trainer import format_summary, train_side_by_side, write_summary

    try:
        config = resolve_config(args.config or EMBEDDED_DEFAULT, args.overrides)
    except ConfigError as err:
        return user_error("train", str(err))
    swapped = "attention" if config.activation_swap == "none" else config.activation_swap
    modes = ["none", swapped] if args.compare else [config.activation_swap]
    configs = [_as_mode(config, mode) for mode in modes]
    try:
        pass_plans = [pass_plan(config) for config in configs]  # once: checks, mesh, build
        mesh = _init_distributed(config, pass_plans[0])
        results = train_side_by_side(
            configs, mesh=mesh, progress=not args.no_progress, pass_plans=pass_plans
        )
    except (
        PassPlanError,
        ConfigError,
        CheckpointError,
        PlanMismatchError,
        LossHeadError,
    ) as err:
        return user_error("train", str(err))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    for result in results:
        if result.auto_swap is not None:
            print(format_auto_report(result.auto_swap))
    print(format_summary(results))
    print(f"summary written to {write_summary(results, config.output_dir)}")
    if args.compare and results[0].losses != results[1].losses:
        print(
            f"graphswap train --compare: losses differ between activation_swap none and {swapped}:"
            f" {results[0].losses} vs {results[1].losses}",
            file=sys.stderr,
        )
        return 1
    return 0
