"""Budget mode in one call for a model that ``transformers.Trainer`` or TRL's ``SFTTrainer``
trains: :func:`apply_budget`.

The plan is made for the step the trainer runs: its sequence length (``SFTConfig``'s
``max_length``), its batch per device, its device, and TRL's fused loss head when
``SFTTrainer`` trains the model. The trainer's gradient (activation) checkpointing, on by
default in ``SFTConfig``, is honoured, not refused: the plan recomputes every whole decoder
layer, as the trainer's checkpointing would, and swaps as much of the layers' inputs as
the budget needs, overlapped with compute (what ``activation_checkpointing_kwargs=
{"offload": True}`` does on the compute stream). graphswap owns that recompute: the
model's ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` before
transformers 5.23), which the trainer calls when training starts, is taken over so that
Hugging Face's own checkpoint never runs around the swap (I6: never recomputed twice).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from graphswap.errors import SwapExclusionError
from graphswap.hf import trl_head
from graphswap.passes import InfrastructureResult, pass_plan
from graphswap.passes.plan_executor import PlanExecutor
from graphswap.passes.swap import apply_swap, plan_swap, swap_engine
from graphswap.rewriting.apply import RewriteReport, rewrite_report
from graphswap.train.config import ConfigError, TrainerConfig

__all__ = ["apply_budget"]

PLANNING_KEYS = (
    "swap_bandwidth_gbps",
    "swap_tflops",
    "swap_hide_margin",
    "swap_prefetch_depth",
    "swap_offload_lag",
    "device",
)
"""The trainer config's keys :func:`apply_budget` takes besides what the trainer's
arguments say: the link and compute the plan assumes, the manager's schedule, and
``device: sim:<profile>`` for a clocked simulated device."""

_ENABLES = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
"""The model's checkpointing switches (the second the deprecated alias of the first from
transformers 5.23 on, the only one before): the trainer calls one when training starts."""

_HONOURED_KWARGS = ("use_reentrant", "offload", "every_n_layers")
"""The trainer's checkpointing options budget mode honours: graphswap's recompute is
non-reentrant either way and bitwise the same, it swaps the inputs as planned
(``offload``), and recomputes every layer (``every_n_layers`` 1)."""


def apply_budget(
    model: nn.Module,
    activation_memory_budget: int | float | str,
    args: Any = None,
    *,
    seq_len: int | None = None,
    batch_size: int | None = None,
    **settings: Any,
) -> InfrastructureResult:
    """Install ``activation_swap: budget`` on a model the user built, planned for the step
    that ``args`` (the trainer's ``TrainingArguments`` or ``SFTConfig``) runs.

    Call it before the trainer is built (``apply_budget(model, "60GiB", args)``) or after
    (``apply_budget(trainer.model, "60GiB", trainer.args)``), before ``train()``.

    ``activation_memory_budget``: the device peak to plan within (bytes, ``60GiB``, or a
    fraction of the device's memory such as ``0.85``). ``seq_len``: the tokens per
    sequence to plan; default ``args.max_length`` (``SFTConfig``), required with
    ``TrainingArguments``. ``batch_size``: default ``args.per_device_train_batch_size``.
    The loss head planned is TRL's fused head when ``args`` is an ``SFTConfig`` or the
    model runs it already, else the model's own; the dtype, autocast's under ``args.bf16``
    or ``args.fp16``. ``settings``: the trainer config's
    :data:`PLANNING_KEYS`.

    With ``args.activation_checkpointing`` (``gradient_checkpointing`` before
    transformers 5.23; ``SFTConfig`` turns it on), or checkpointing already on in the
    model, every layer is recomputed whole and the model's checkpointing switch is taken
    over: the trainer's call is honoured by the plan, and Hugging Face's checkpoint does
    not run. Without it the budget chooses what to recompute, and a later request to
    checkpoint is refused (:class:`~graphswap.errors.SwapExclusionError`), since the plan
    was made without it.

    Returns what ``graphswap.passes.apply_model_infrastructure`` returns: the rewrite's
    report (its ``manager.stats``) and the plan (``plan_executor.plan``; ``plan_executor.check()``
    after a step). ``graphswap.unrewrite(model)`` undoes it, checkpointing switch included.
    """
    unknown = sorted(set(settings) - set(PLANNING_KEYS))
    if unknown:
        raise ConfigError(
            unknown[0],
            f"apply_budget plans the swap alone and takes {', '.join(PLANNING_KEYS)} besides"
            " the budget, seq_len and batch_size; build other passes (tensor parallel, FSDP,"
            " compile) with graphswap.passes.apply_model_infrastructure",
        )
    hf_model = _hf_model(model)
    checkpointed = _checkpointed_layers(hf_model)
    asked = _checkpointing(args)
    if asked:
        _check_options(_checkpointing_kwargs(args), f"args.{_CHECKPOINTING_KWARGS}")
    requested = asked or bool(checkpointed)
    sft = _is_sft_config(args)
    config = TrainerConfig(
        activation_swap="budget",
        activation_memory_budget=activation_memory_budget,
        seq_len=_seq_len(args, seq_len),
        batch_size=_batch_size(args, batch_size),
        loss_head="trl" if sft or trl_head.installed(hf_model) else "full",
        **settings,
    )
    checked = pass_plan(config).check_runnable()
    device = _training_device(model, args)
    for module in checkpointed:  # the request is the plan's now: Hugging Face's is off
        module.gradient_checkpointing = False
    try:
        auto = plan_swap(
            model,
            config,
            device=device,
            autocast_dtype=_autocast_dtype(args),
            activation_checkpointing=requested,
        )
        report = apply_swap(
            model,
            activation_swap="budget",
            swap_prefetch_depth=config.swap_prefetch_depth,
            swap_offload_lag=config.swap_offload_lag,
            engine=swap_engine(config.device),
            executor=auto,
        )
    except BaseException:
        for module in checkpointed:
            module.gradient_checkpointing = True
        raise
    for name in _ENABLES:
        if hasattr(type(hf_model), name):
            hf_model.__dict__[name] = functools.partial(
                _checkpointing_enable, hf_model, model, report, auto, name
            )
    return InfrastructureResult(model, checked, report, ("swap",), None, auto)


def _hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model whose switches the trainer calls: a PEFT model's base."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The modules Hugging Face checkpoints (``gradient_checkpointing_enable`` ran)."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]


_CHECKPOINTING = "activation_checkpointing"
_CHECKPOINTING_KWARGS = "activation_checkpointing_kwargs"


def _checkpointing(args: Any) -> bool:
    """The trainer checkpoints every layer: ``activation_checkpointing`` (transformers
    5.23 on, which keeps ``gradient_checkpointing`` as its alias) or, before,
    ``gradient_checkpointing``."""
    if args is None:
        return False
    value = getattr(args, _CHECKPOINTING, None)
    if value is None:
        value = getattr(args, "gradient_checkpointing", False)
    return bool(value)


def _checkpointing_kwargs(args: Any) -> Mapping[str, Any]:
    value = getattr(args, _CHECKPOINTING_KWARGS, None)
    if value is None:
        value = getattr(args, "gradient_checkpointing_kwargs", None)
    return value or {}


def _check_options(options: Mapping[str, Any], where: str) -> None:
    """Refuse a checkpointing option budget mode would not honour (I2: never dropped)."""
    for key, value in options.items():
        if key not in _HONOURED_KWARGS or (key == "every_n_layers" and value != 1):
            raise ConfigError(
                where,
                f"{key}={value!r} asks for checkpointing other than every whole layer, which"
                " activation_swap: budget runs in its place (it recomputes every layer,"
                f" non-reentrant, and swaps the inputs as planned; it honours"
                f" {', '.join(_HONOURED_KWARGS[:2])} and every_n_layers=1); leave {key} out,"
                " or turn the trainer's checkpointing off and let the budget choose what to"
                " recompute",
            )


def _autocast_dtype(args: Any) -> torch.dtype | None:
    """The dtype the trainer's autocast computes in: ``bf16`` / ``fp16`` wrap the step in
    ``torch.autocast`` around the weights as loaded (harmless to plan for when the weights
    are in that dtype already)."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return None


def _is_sft_config(args: Any) -> bool:
    """``args`` is TRL's ``SFTConfig``: ``SFTTrainer`` installs its fused head and plans
    its sequences at ``max_length``. Read from the loaded module: an ``SFTConfig`` given
    here means TRL is imported already, and graphswap never imports it itself."""
    module = sys.modules.get("trl.trainer.sft_config")
    sft_config = getattr(module, "SFTConfig", None)
    return isinstance(sft_config, type) and isinstance(args, sft_config)


def _seq_len(args: Any, seq_len: int | None) -> int:
    if seq_len is not None:
        return seq_len
    max_length = getattr(args, "max_length", None) if _is_sft_config(args) else None
    if not isinstance(max_length, int):
        raise ConfigError(
            "seq_len",
            "apply_budget plans one sequence length and the trainer's arguments name none"
            " (SFTConfig's max_length, when it is set); pass seq_len=, the tokens per"
            " sequence the trainer runs",
        )
    return max_length


def _batch_size(args: Any, batch_size: int | None) -> int:
    if batch_size is not None:
        return batch_size
    per_device = getattr(args, "per_device_train_batch_size", None)
    if not isinstance(per_device, int):
        raise ConfigError(
            "batch_size",
            "apply_budget plans one batch and no trainer arguments were given; pass"
            " batch_size=, or args= (its per_device_train_batch_size)",
        )
    return per_device


def _training_device(model: nn.Module, args: Any) -> torch.device:
    """Where the trainer runs the model: ``args.device`` (the trainer moves the model
    there), else where the model is."""
    device = getattr(args, "device", None)
    if isinstance(device, torch.device):
        return device
    param = next(model.parameters())
    return param.device


def _checkpointing_enable(
    hf_model: nn.Module,
    root: nn.Module,
    report: RewriteReport,
    auto: PlanExecutor,
    name: str,
    *args: Any,
    **kwargs: Any,
) -> None:
    """``hf_model.<name>(...)`` while graphswap owns its recompute: honoured by the plan,
    which recomputes every whole layer, so Hugging Face's checkpoint stays off; refused
    when the plan was made without it. Once the rewrite is undone, Hugging Face's own."""
    if rewrite_report(root) is not report:
        for enable in _ENABLES:
            hf_model.__dict__.pop(enable, None)
        getattr(hf_model, name)(*args, **kwargs)
        return
    options, every_n_layers, offload = _enable_options(name, args, kwargs)
    _check_options({**options, "every_n_layers": every_n_layers, "offload": offload}, f"{name}()")
    if auto.plan.recompute != ("layer",):
        recomputed = " and ".join(auto.plan.recompute) or "nothing"
        raise SwapExclusionError(
            f"activation swap excludes activation_checkpointing: {name}() asks to recompute"
            f" every layer, but the activation_swap: budget plan was made without it (it"
            f" recomputes {recomputed}), and a second owner of recompute would handle the"
            " swapped tensors twice; pass the trainer's arguments to apply_budget"
            " (apply_budget(model, budget, args)) so that the plan recomputes whole layers,"
            " or set activation_checkpointing=False (gradient_checkpointing=False before"
            " transformers 5.23; TRL's SFTConfig turns it on by default)"
        )
    # What Hugging Face does besides checkpointing: frozen embeddings (PEFT) still pass
    # a gradient to the layers.
    if getattr(hf_model, "main_input_name", None) == "input_ids" or getattr(
        hf_model, "_hf_peft_config_loaded", False
    ):
        hf_model.enable_input_require_grads()


def _enable_options(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Mapping[str, Any], int, bool]:
    """The checkpoint options, ``every_n_layers`` and ``offload`` of a call of ``name``
    (``activation_checkpointing_enable(activation_checkpointing_kwargs, every_n_layers,
    offload)``, or the same through ``gradient_checkpointing_enable``)."""
    positional = ("options", "every_n_layers", "offload")
    given = dict(zip(positional, args, strict=False))
    options_key = name.replace("_enable", "_kwargs")
    given.setdefault("options", kwargs.pop(options_key, None))
    every_n_layers = given.get("every_n_layers", kwargs.pop("every_n_layers", 1))
    offload = given.get("offload", kwargs.pop("offload", False))
    if kwargs:
        raise ConfigError(f"{name}()", f"unexpected arguments {sorted(kwargs)}")
    return given["options"] or {}, every_n_layers, offload
