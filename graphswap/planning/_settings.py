"""The settings a plan is made with, as two values checked once when made: the step's
shape (:class:`StepShape`) and the swap's schedule (:class:`SwapSchedule`).

Each field is spelled as the trainer's config key of the same setting (``seq_len``,
``batch_size``, ``tp_size``, ``swap_offload_lag``, ...), so a refusal's
:class:`PlanSettingError` names the key a user sets, and ``plan-memory``'s flags are
those names with dashes (``--seq-len``); nothing translates between them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from graphswap._compat import renamed_keywords
from graphswap.hf.attention_kernels import (
    AttentionKernel,
    PlanSettingError,
    resolve_attention_kernel,
)
from graphswap.hf.loss_head import LOSS_HEADS, LossHead
from graphswap.rewriting.loss_head import DEFAULT_CHUNK_SIZE
from graphswap.runtime.profile import DeviceProfile

DEFAULT_HIDE_MARGIN = 0.1
"""``auto`` fills at most 90% of each copy's window: kernel-time estimates and link
contention are not exact."""


def check_int(name: str, value: object, minimum: int, detail: str) -> None:
    """``value`` is an integer (not a bool) of at least ``minimum``, else the setting
    ``name`` is refused with ``detail``, what it means."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanSettingError(name, value, f"must be an integer >= {minimum}; {detail}")


@dataclass(frozen=True)
class StepShape:
    """The training step a plan traces: its tokens, dtype, attention and ranks.

    A shape that no step can have is refused here, before any model is built; what
    only the model shows (``tp_size`` against its heads, an attention its family
    cannot run) is checked when the model is (:func:`build_meta_model`)."""

    seq_len: int
    """Tokens per sequence."""
    batch_size: int = 1
    """Sequences per batch (one data-parallel replica's)."""
    dtype: torch.dtype = torch.bfloat16
    """The parameters' dtype, and the activations' but where autocast casts them."""
    autocast_dtype: torch.dtype | None = None
    """The dtype the step computes in under ``torch.autocast`` on ``device`` (``bfloat16``
    or ``float16``: HF Trainer's and TRL's ``bf16``/``fp16``, around weights of ``dtype``);
    ``None``: no autocast."""
    attn_implementation: str = "sdpa"
    """Hugging Face attention: ``sdpa`` (fused kernels) or ``eager``."""
    device: str = "cuda"
    """The device training runs on (``cuda`` or ``cpu``): it chooses the sdpa kernel and
    the optimizer."""
    attn_kernel: str | None = None
    """The sdpa kernel to trace; ``None``: the one PyTorch picks first for the device and
    dtype."""
    tp_size: int = 1
    """Tensor-parallel ranks: the step is one rank's, its attention heads sharded."""
    loss_head: LossHead = "full"
    """The head the step's loss runs (:data:`LossHead`): what the planner traces after
    the last decoder layer."""
    loss_head_chunk_size: int = DEFAULT_CHUNK_SIZE
    """``chunked``: tokens per chunk of the head."""
    lora_rank: int | None = None
    """The rank of the LoRA adapters that train (PEFT's ``r``); ``None``: every parameter
    trains. With it the base weights are frozen: no gradient, no AdamW state, and no
    weight gradient computed in backward (:func:`graphswap.hf.lora.inject_lora`)."""
    lora_target_modules: tuple[str, ...] | None = None
    """With ``lora_rank``: the linear layers adapted, by name (PEFT's
    ``target_modules``); ``None``: :data:`~graphswap.hf.lora.LORA_TARGET_MODULES`."""
    lora_dropout: float | None = None
    """With ``lora_rank``: the adapters' dropout (PEFT's ``lora_dropout``), which saves a
    dropped copy of each adapted layer's input; ``None``: 0."""
    kernel: AttentionKernel | None = field(init=False, repr=False, compare=False)
    """The sdpa kernel the step runs (``None``: eager attention), resolved once."""

    def __post_init__(self) -> None:
        check_int("seq_len", self.seq_len, 1, "tokens per sequence")
        check_int("batch_size", self.batch_size, 1, "sequences per batch")
        check_int("tp_size", self.tp_size, 1, "1 plans one device")
        if self.loss_head not in LOSS_HEADS:
            raise PlanSettingError(
                "loss_head", self.loss_head, f"must be one of {', '.join(LOSS_HEADS)}"
            )
        check_int("loss_head_chunk_size", self.loss_head_chunk_size, 1, "tokens per chunk")
        if self.autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise PlanSettingError(
                "autocast_dtype",
                self.autocast_dtype,
                "must be bfloat16, float16, or unset (no autocast)",
            )
        _check_lora(self)
        kernel = resolve_attention_kernel(
            self.attn_implementation,
            device=self.device,
            dtype=self.autocast_dtype or self.dtype,  # what sdpa receives under autocast
            attn_kernel=self.attn_kernel,
        )
        object.__setattr__(self, "kernel", kernel)


def _check_lora(shape: StepShape) -> None:
    """The LoRA settings are a step's: a rank of at least 1, and targets and dropout only
    with it (else they would change nothing). A list of targets is kept as a tuple, so
    that the shape stays hashable (the trace cache's key)."""
    targets, dropout = shape.lora_target_modules, shape.lora_dropout
    if shape.lora_rank is None:
        for name, value in (("lora_target_modules", targets), ("lora_dropout", dropout)):
            if value is not None:
                raise PlanSettingError(
                    name, value, "applies to the LoRA step only; set lora_rank or drop it"
                )
        return
    check_int("lora_rank", shape.lora_rank, 1, "the LoRA adapters' rank (PEFT's r)")
    if targets is not None:
        if (
            not isinstance(targets, (list, tuple))
            or not targets
            or not all(isinstance(t, str) and t for t in targets)
        ):
            raise PlanSettingError(
                "lora_target_modules",
                shape.lora_target_modules,
                "must be a non-empty list of linear layer names (q_proj, v_proj, ...)",
            )
        object.__setattr__(shape, "lora_target_modules", tuple(targets))
    if dropout is not None and (
        isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1
    ):
        raise PlanSettingError(
            "lora_dropout", dropout, "must be a number in [0, 1): the adapters' dropout"
        )


@dataclass(frozen=True)
class SwapSchedule:
    """When the swap's copies run, and what holds them: the ``SwapManager``'s schedule,
    the host pool's budget and the state's sharding, as a plan replays them."""

    swap_hide_margin: float = DEFAULT_HIDE_MARGIN
    """``auto``: the share of each copy's window, forward and backward, left free."""
    swap_offload_lag: int | None = None
    """The ``SwapManager``'s ``swap_offload_lag``: a module's offloads are fenced that many
    modules later; unset: ``auto`` plans at 1 and 2 and keeps the lower peak, the other
    modes take 1."""
    swap_prefetch_depth: int = 1
    """The ``SwapManager``'s ``swap_prefetch_depth``: reloads are issued that many modules
    ahead of backward."""
    state_shards: int = 1
    """Ranks the parameters, gradients and AdamW state are sharded over, FSDP-style."""
    max_host_bytes: int | None = None
    """The host pool's budget per rank (the ``SwapManager``'s ``max_host_bytes``); unset:
    the profile's node's share, as the runtime takes it there
    (:meth:`max_host_bytes_on`)."""

    def __post_init__(self) -> None:
        margin = self.swap_hide_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise PlanSettingError(
                "swap_hide_margin", margin, "must be in [0, 1): the share of each window left free"
            )
        if self.swap_offload_lag is not None:
            check_int(
                "swap_offload_lag",
                self.swap_offload_lag,
                0,
                "as SwapManager takes it (unset: the plan's)",
            )
        check_int("swap_prefetch_depth", self.swap_prefetch_depth, 1, "as SwapManager takes it")
        check_int("state_shards", self.state_shards, 1, "1 keeps all the state on one device")
        if self.max_host_bytes is not None:
            check_int("max_host_bytes", self.max_host_bytes, 0, "the host pool's budget per rank")

    def lag(self) -> int:
        """The offload lag of a plan that does not choose one: the set one, else 1."""
        return 1 if self.swap_offload_lag is None else self.swap_offload_lag

    def max_host_bytes_on(self, profile: DeviceProfile) -> int:
        """The host pool's cap on a node of ``profile``: ``max_host_bytes``, else the
        node's default (:attr:`DeviceProfile.default_max_host_bytes`)."""
        cap = self.max_host_bytes
        return profile.default_max_host_bytes if cap is None else cap


SHAPE_FIELDS = tuple(f.name for f in fields(StepShape) if f.init)
SCHEDULE_FIELDS = tuple(f.name for f in fields(SwapSchedule))
PROFILE_FIGURES = ("swap_bandwidth_gbps", "swap_tflops")
"""The device profile's figures a plan may override, as the config spells them: the host
link per direction in GB/s, and the sustained TFLOP/s."""


def split_settings(
    caller: str, settings: Mapping[str, Any]
) -> tuple[dict[str, Any], SwapSchedule, dict[str, Any]]:
    """A public call's flat keywords, the config's keys (0.1.0's names warn and work), as
    the shape's keywords, the schedule made of its own, and the profile's overrides. A
    name none of them has is refused, naming those it has."""
    given = renamed_keywords(caller, dict(settings), inside="graphswap.planning")
    known = (*SHAPE_FIELDS, *SCHEDULE_FIELDS, *PROFILE_FIGURES)
    for name, value in given.items():
        if name not in known:
            raise PlanSettingError(
                name, value, f"is not a setting of {caller}; use one of {', '.join(known)}"
            )

    def pick(names: tuple[str, ...]) -> dict[str, Any]:
        return {name: given[name] for name in names if name in given}

    return pick(SHAPE_FIELDS), SwapSchedule(**pick(SCHEDULE_FIELDS)), pick(PROFILE_FIGURES)


DEFAULT_SCHEDULE = SwapSchedule()
"""The ``SwapManager``'s own defaults, no host budget set and the state on one device."""


def step_settings(
    caller: str, settings: Mapping[str, Any]
) -> tuple[StepShape, SwapSchedule, dict[str, Any]]:
    """Flat settings under the config's keys, as the trainer config, the CLI and the swap
    pass hold them, made at that edge into the step's shape, its schedule and the
    profile's overrides (``seq_len`` required), each checked once."""
    shape_settings, schedule, figures = split_settings(caller, settings)
    if "seq_len" not in shape_settings:
        raise PlanSettingError("seq_len", None, "is required: the tokens per sequence to plan")
    return StepShape(**shape_settings), schedule, figures
