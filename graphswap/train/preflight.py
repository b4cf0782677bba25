"""Checks of a training config against what it names (the checkpoint, the data file,
the output folder, the device, the world) before any model is built (but on the meta
device, for the swap rule).

A wrong path or an impossible setting must cost the user a second and one clear
line, not a model build, a training run, or a traceback; ``graphswap train`` runs
every check here first and ``graphswap passes`` runs the ones about the model.
Every error is a :class:`~graphswap.train.config.ConfigError` (message starts with the
key) or, for a distributed layout, a ``passes`` plan error naming the setting.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from graphswap.errors import RewriteError
from graphswap.hf.attention_kernels import PlanSettingError
from graphswap.hf.checkpoints import (
    CheckpointError,
    LayerCountError,
    build_model,
    eager_only,
    weight_files,
)
from graphswap.passes import SWAP_RULES, PassPlan, PassRequirementError
from graphswap.passes.pass_plan import pass_plan_of
from graphswap.passes.plan_executor import check_measurable
from graphswap.passes.swap import plan_swap
from graphswap.passes.tensor_parallel import check_head_layout, check_heads_divisible
from graphswap.rewriting.rules import check_rule
from graphswap.train.build import trainer_hf_config
from graphswap.train.config import ConfigError, TrainerConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def check_inputs(
    config: TrainerConfig, *, world_size: int = 1, pass_plan: PassPlan | None = None
) -> PretrainedConfig:
    """Every check ``graphswap train`` needs; returns the Hugging Face config to build.
    ``pass_plan``: ``config``'s pass plan when the caller built it already."""
    pass_plan_of(config, pass_plan).check_runnable()
    check_loss_head(config)
    # The paths first: they need no model code, whose import alone takes seconds.
    check_data(config)
    check_output_dir(config)
    check_world(config, world_size)
    hf_config = check_model(config)
    check_swap_bandwidth(config, resolve_device(config))
    check_swap_rule(config, hf_config)  # last: they build the model, on meta
    check_budget_plan(config, hf_config, world_size=world_size)
    return hf_config


def check_loss_head(config: TrainerConfig) -> None:
    """``graphswap train`` runs the model's own forward: TRL's head never runs there."""
    if config.loss_head == "trl":
        raise ConfigError(
            "loss_head",
            "trl plans the fused head TRL's SFTTrainer installs, which graphswap train's loop"
            " never calls; set loss_head: full or chunked (trl is for a model built with"
            " graphswap.train.build and trained by SFTTrainer)",
        )


def check_model(config: TrainerConfig) -> PretrainedConfig:
    """The model's config (preset, or ``model_path``'s config.json and weights), and
    that ``tp_size`` divides its head counts of a family whose heads it can shard."""
    try:
        hf_config = trainer_hf_config(config)
        if config.model_path is not None:
            weight_files(config.model_path)
    except CheckpointError as error:
        raise ConfigError("model_path", str(error)) from error
    except LayerCountError as error:
        raise ConfigError("num_layers", str(error)) from None
    except PlanSettingError as error:  # a rope_factor the model's window already covers
        raise ConfigError(error.setting, error.detail) from None
    check_attention(config, hf_config)
    if config.tp_size > 1:
        check_heads_divisible(hf_config, config.tp_size)
        check_head_layout(hf_config, config.tp_size)
    return hf_config


def check_attention(config: TrainerConfig, hf_config: PretrainedConfig) -> None:
    """``attn_implementation: sdpa`` on a family whose model runs eager attention only
    (gpt-oss: its attention sinks) is refused before the build, naming the key."""
    model_class = eager_only(hf_config)
    if config.attn_implementation == "sdpa" and model_class is not None:
        raise ConfigError(
            "attn_implementation",
            f"sdpa: {model_class} runs eager attention only in this transformers;"
            " set attn_implementation: eager",
        )


def check_swap_rule(config: TrainerConfig, hf_config: PretrainedConfig) -> None:
    """The rule of ``activation_swap`` accepts the model (built on meta, which costs no
    memory): a hybrid stack's attention, or a model without a decoder layer list, is
    refused here with the rule's reason, not by a traceback after the build."""
    rule = SWAP_RULES.get(config.activation_swap)
    if rule is None:
        return
    try:
        check_rule(build_model(hf_config, device="meta"), rule)
    except RewriteError as error:
        raise ConfigError("activation_swap", f"{config.activation_swap}: {error}") from None


def check_budget_plan(
    config: TrainerConfig, hf_config: PretrainedConfig, *, world_size: int | None
) -> None:
    """``activation_swap: budget``: the swap pass's plan (``plan_swap``) of the model
    built on meta, so that ``train`` and ``passes`` refuse a budget no plan meets, or one
    above the device's memory, alike and before a model is built (the swap pass plans
    again from the traces this leaves in the planner's cache). With ``fsdp`` a rank's
    share of the state needs the ``world_size``; ``None`` (``passes``, before
    ``torchrun``): unknown, and the check is left to ``train``."""
    if config.activation_swap != "budget" or (config.fsdp and world_size is None):
        return
    shards = (world_size or 1) // config.tp_size if config.fsdp else 1
    model = build_model(hf_config, device="meta", dtype=getattr(torch, config.dtype))
    plan_swap(model, config, state_shards=shards, device=resolve_device(config))


def resolve_device(config: TrainerConfig) -> torch.device:
    """The device ``config.device`` names; under torchrun, this rank's CUDA device."""
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(
                "device",
                "cuda was asked for but no CUDA device is visible; set device: cpu"
                " (or auto, which picks cuda when there is one)",
            )
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def check_swap_bandwidth(config: TrainerConfig, device: torch.device) -> None:
    """``swap_bandwidth_gbps: measure`` times the host link of the training device."""
    if config.swap_bandwidth_gbps == "measure":
        try:
            check_measurable(device)
        except PlanSettingError as error:
            raise ConfigError(error.setting, f"{error.value} {error.detail}") from error


def check_data(config: TrainerConfig) -> int:
    """Bytes in ``config.data`` (0 without a file); it must hold more than one window."""
    if config.data is None:
        return 0
    path = Path(config.data)
    if path.is_dir():
        raise ConfigError("data", f"{config.data!r} is a folder; give a local text file")
    if not path.is_file():
        raise ConfigError(
            "data", f"no file at {config.data!r}; give a local text file (or data: null)"
        )
    size = path.stat().st_size
    if size <= config.seq_len:
        raise ConfigError(
            "data",
            f"{config.data!r} has {size} bytes, but one window needs more than"
            f" seq_len={config.seq_len}; give a longer file or a smaller seq_len",
        )
    return size


def check_output_dir(config: TrainerConfig) -> Path:
    """Create ``config.output_dir`` and prove it writable now, rather than after the
    run when the summary would be lost."""
    path = Path(config.output_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(
            "output_dir", f"{config.output_dir!r} is a file, not a folder; choose another"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ConfigError(
            "output_dir",
            f"cannot write to {config.output_dir!r} ({error.strerror or error});"
            " choose a writable folder",
        ) from error
    return path


def check_world(config: TrainerConfig, world_size: int) -> None:
    """Several ranks need a pass that keeps them one model: without one, each rank
    would train its own unsynchronised copy."""
    if world_size > 1 and config.tp_size == 1 and not config.fsdp:
        raise PassRequirementError(
            f"tp_size: 1 and fsdp: false on a world of {world_size} ranks would train"
            f" {world_size} unsynchronised copies; set fsdp: true (data parallel, dp_shard ="
            f" {world_size}) or tp_size: {world_size}, or run one process"
        )
