"""The trainer's settings and the strict YAML resolver that fills them.

Every setting is a typed field of :class:`TrainerConfig`; the resolver refuses what it
does not understand (unknown keys, wrong types, values outside a ``Literal``) instead
of dropping it, because a dropped setting is how the origin silently lost its module
replacement (P1). Every error message starts with the key path, so the user knows which
line to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from graphswap._compat import module_getattr
from graphswap.errors import GraphswapError
from graphswap.hf.loss_head import LossHead
from graphswap.hf.presets import preset_names
from graphswap.hf.rope import check_rope_factor
from graphswap.planning import PlanSettingError, SwapMode
from graphswap.planning._budget import read_memory_budget
from graphswap.planning._settings import DEFAULT_HIDE_MARGIN
from graphswap.rewriting.loss_head import DEFAULT_CHUNK_SIZE
from graphswap.runtime.profile import PRESETS, SIM_PREFIX, ProfileError, simulated_profile

SwapBandwidth = Union[float, Literal["measure"]]  # noqa: UP007 (the resolver reads Union)
AttnImplementation = Literal["eager", "sdpa"]
DType = Literal["float32", "bfloat16"]

_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
"""PyYAML follows YAML 1.1, which reads ``1e-3`` (no dot) as a string; such text is
accepted for float settings because it is unambiguously a number."""


DEVICES = ("auto", "cpu", "cuda")


class ConfigError(GraphswapError, ValueError):
    """A setting the trainer cannot accept; ``key`` names it, the message starts with it."""

    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        self.detail = detail
        super().__init__(f"{key}: {detail}")


_DEFAULT_MODEL = "tiny"
"""``model`` at this value is left out when ``model_path`` is set: the example YAML
lists every key with its default, and it must stay usable with a ``model_path``."""


@dataclass(frozen=True)
class SwapSettings:
    """Activation swap: which saved tensors go to host memory, and when they leave and
    come back."""

    activation_swap: SwapMode = "none"
    """``attention``: what each decoder layer's attention saves; ``layer``: what the whole
    layer saves; ``auto``: per layer, the saves whose copies hide in both windows;
    ``budget``: per layer, what to keep, swap and recompute so that the device peak stays
    within ``activation_memory_budget`` at the least step time; ``none``. It excludes
    ``compile``, ``activation_checkpointing`` (``budget`` recomputes itself) and
    ``pp_size > 1``."""
    activation_memory_budget: int | float | str | None = None
    """``budget`` only, and required there: the device peak to plan within, as bytes
    (an integer), a size (``120GiB``, ``80GB``) or a fraction of the device's memory
    (``0.85``; on ``sim:<profile>`` the profile's)."""
    swap_prefetch_depth: int = 1
    """Layers prefetched ahead of the backward (``SwapManager(swap_prefetch_depth=)``), >= 1."""
    swap_offload_lag: int | None = None
    """A layer's swapped tensors leave the device no later than when the forward of the
    wrapped module this many forwards later begins (``SwapManager(swap_offload_lag=)``).
    Unset: ``auto`` takes the lag its plan chose (1 or 2, the lower peak); the other
    modes 1."""


@dataclass(frozen=True)
class SwapPlanSettings:
    """What ``activation_swap: auto`` and ``budget`` plan with; another mode must leave
    them at their defaults (a value it would not read is an error)."""

    swap_bandwidth_gbps: SwapBandwidth | None = None
    """The host link in GB/s per direction, or ``measure`` (timed on the training device);
    None: the device profile's (``device: sim:<profile>``'s, else h200's)."""
    swap_tflops: float | None = None
    """Sustained TFLOP/s the copies hide behind; None: the device profile's."""
    swap_hide_margin: float = DEFAULT_HIDE_MARGIN
    """The share of each copy's window (forward and backward) left free, in [0, 1)."""


@dataclass(frozen=True)
class LossHeadSettings:
    """The loss head: how a step turns the last hidden states into the loss."""

    loss_head: LossHead = "full"
    """``full``: the model's own head (logits of every token, kept for backward);
    ``chunked``: the loss over ``loss_head_chunk_size`` tokens at a time, each chunk's
    projection and cross-entropy made again in backward, so no (tokens x vocabulary)
    tensor outlives a chunk. Same loss up to the order of its sum (hidden-state
    gradients bitwise equal, the head's weight gradient summed in fp32); the forward
    without labels is the model's own. ``trl``: TRL ``SFTTrainer``'s fused head, which
    the trainer installs on the model graphswap builds: graphswap installs nothing and
    plans ``auto`` and ``budget`` for it (``graphswap train``, whose loop runs the
    model's own forward, refuses it)."""
    loss_head_chunk_size: int = DEFAULT_CHUNK_SIZE
    """``chunked`` only: tokens per chunk, >= 1."""


@dataclass(frozen=True)
class ModelSettings:
    """The model: a preset, or a local Hugging Face checkpoint (never downloaded)."""

    model: str = _DEFAULT_MODEL
    """A preset of ``graphswap.hf.presets`` (``tiny``, ``tiny-<family>``, full sizes)."""
    model_path: str | None = None
    """A ``save_pretrained`` folder (config.json and weights): training starts from its
    weights; ``model`` stays at its default."""
    num_layers: int | None = None
    """The number of decoder layers, replacing the model's; None: keep the model's."""
    rope_factor: float | None = None
    """Stretch the model's window (``max_position_embeddings``) this many times, > 1, with
    YaRN rope scaling, as Qwen3 documents it (4); None: the model's own rope scaling."""
    attn_implementation: AttnImplementation = "sdpa"
    """``sdpa`` (fused kernels) or ``eager`` (saves the seq x seq probabilities)."""


@dataclass(frozen=True)
class TrainingSettings:
    """The training loop and where it runs."""

    seq_len: int = 512
    """Tokens per sequence."""
    batch_size: int = 2
    """Sequences per step on each data-parallel replica."""
    steps: int = 10
    """Optimizer steps (AdamW)."""
    lr: float = 1e-3
    """AdamW's learning rate."""
    dtype: DType = "float32"
    """The parameters' and activations' dtype."""
    device: str = "auto"
    """``auto`` (CUDA when visible, else CPU), ``cpu``, ``cuda``, or ``sim:<profile>``: CPU
    tensors on a clocked simulated accelerator (``sim:h200``, ``sim:h100``, figures may
    follow: ``sim:h200,link_gbps=25``) that predicts the step time, stalls and peak the
    profile's GPU would see."""
    seed: int = 0
    """Seeds the model's initial weights and the synthetic tokens."""
    data: str | None = None
    """A local text file to train on; None: synthetic tokens."""
    output_dir: str = "out"
    """Where ``summary.json`` is written (checked writable before training)."""


@dataclass(frozen=True)
class InfrastructureSettings:
    """The passes ``graphswap.passes.apply_model_infrastructure`` applies, in the plan's order."""

    compile: bool = False
    """``torch.compile`` each decoder layer."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (``checkpoint_wrapper``)."""
    tp_size: int = 1
    """Tensor parallel: attention heads split over this many ranks."""
    cp_size: int = 1
    """Context parallel: declared and ordered, not applied (must stay 1)."""
    ep_size: int = 1
    """Expert parallel: declared and ordered, not applied (must stay 1)."""
    pp_size: int = 1
    """Pipeline parallel: declared and ordered, not applied (must stay 1)."""
    fsdp: bool = False
    """FSDP2 ``fully_shard`` per decoder layer and the root."""
    pass_order: tuple[str, ...] | None = None
    """The passes in the order to run them, checked as given by ``graphswap.passes.pass_plan``;
    ``None``: the canonical order of the passes the other settings enable."""


@dataclass(frozen=True)
class TrainerConfig(
    InfrastructureSettings,
    TrainingSettings,
    ModelSettings,
    LossHeadSettings,
    SwapPlanSettings,
    SwapSettings,
):
    """Everything ``graphswap train`` reads, in groups, one flat key per field (the groups'
    order is ``examples/train.yaml``'s, which lists every key)."""

    def __post_init__(self) -> None:
        hints = _field_types()
        for field in dataclasses.fields(self):
            value = _checked(field.name, getattr(self, field.name), hints[field.name])
            object.__setattr__(self, field.name, value)
        for key in ("batch_size", "steps", "tp_size", "cp_size", "ep_size", "pp_size"):
            _check_at_least(key, getattr(self, key), 1)
        if self.seq_len < 2:
            raise ConfigError(
                "seq_len",
                f"must be >= 2, got {self.seq_len}: a causal LM learns to predict each token"
                " from those before it, so one token leaves nothing to predict (every loss nan)",
            )
        _check_at_least("swap_prefetch_depth", self.swap_prefetch_depth, 1)
        if self.swap_offload_lag is not None:
            _check_at_least("swap_offload_lag", self.swap_offload_lag, 0)
        for key, default in SWAP_ONLY_SETTINGS.items():
            value = getattr(self, key)
            if value != default and self.activation_swap == "none":
                raise ConfigError(
                    key,
                    f"is {value} but activation_swap: none, so it would change nothing; set"
                    " activation_swap: attention, layer, auto or budget, or leave"
                    f" {key} at {default}",
                )
        _check_device(self.device)
        self._check_auto_settings()
        self._check_loss_head()
        _check_at_least("seed", self.seed, 0)
        if self.num_layers is not None:
            _check_at_least("num_layers", self.num_layers, 1)
        if self.rope_factor is not None:
            _check_rope_factor(self.rope_factor)
        check_finite_positive("lr", self.lr)
        if self.model not in preset_names():
            raise ConfigError(
                "model",
                f"unknown preset {self.model!r}; allowed values: {', '.join(preset_names())}",
            )
        for key in ("model_path", "data", "output_dir"):
            if getattr(self, key) == "":
                raise ConfigError(key, "must not be empty; leave it out or give a path")
        if self.model_path is not None and self.model != _DEFAULT_MODEL:
            raise ConfigError(
                "model_path",
                f"is set, so the preset model: {self.model} would be ignored; set one of them"
                f" (model_path for a local checkpoint, model for a preset)",
            )

    def _check_auto_settings(self) -> None:
        if self.swap_bandwidth_gbps not in ("measure", None):
            check_finite_positive(
                "swap_bandwidth_gbps", self.swap_bandwidth_gbps, "GB/s", " or measure"
            )
        if self.swap_tflops is not None:
            check_finite_positive("swap_tflops", self.swap_tflops, "TFLOP/s")
        margin = self.swap_hide_margin
        if not 0 <= margin < 1:
            raise ConfigError(
                "swap_hide_margin",
                f"must be in [0, 1) (the share of each layer's backward left free of copies),"
                f" got {margin!r}",
            )
        self._check_budget()
        if self.activation_swap in ("auto", "budget"):
            return
        for key, default in PLAN_ONLY_SETTINGS.items():
            value = getattr(self, key)
            if value != default:
                raise ConfigError(
                    key,
                    f"is {value} but activation_swap: {self.activation_swap}, so it would change"
                    f" nothing (only auto and budget read it); set activation_swap: auto or"
                    f" budget, or leave {key} at {default}",
                )

    def _check_loss_head(self) -> None:
        size = self.loss_head_chunk_size
        if size < 1:
            raise ConfigError(
                "loss_head_chunk_size",
                f"must be >= 1 (tokens per chunk of the loss head), got {size}",
            )
        if self.loss_head != "chunked" and size != DEFAULT_CHUNK_SIZE:
            raise ConfigError(
                "loss_head_chunk_size",
                f"is {size} but loss_head: {self.loss_head}, so it would change nothing; set"
                f" loss_head: chunked, or leave loss_head_chunk_size at {DEFAULT_CHUNK_SIZE}",
            )

    def _check_budget(self) -> None:
        budget = self.activation_memory_budget
        if self.activation_swap != "budget":
            if budget is not None:
                raise ConfigError(
                    "activation_memory_budget",
                    f"is {budget} but activation_swap: {self.activation_swap}, so it would"
                    " change nothing; set activation_swap: budget or leave it out",
                )
            return
        if budget is None:
            raise ConfigError(
                "activation_memory_budget",
                "is required by activation_swap: budget: the device peak to plan within"
                " (120GiB, bytes, or a fraction of the device's memory such as 0.85)",
            )
        try:
            read_memory_budget(budget)
        except PlanSettingError as error:
            raise ConfigError("activation_memory_budget", error.detail) from None

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))


SWAP_ONLY_SETTINGS = {
    f.name: f.default
    for f in dataclasses.fields(SwapSettings)
    if f.name not in ("activation_swap", "activation_memory_budget")
}
"""Settings of the swap runtime that ``activation_swap: none`` must leave at their defaults."""

PLAN_ONLY_SETTINGS = {f.name: f.default for f in dataclasses.fields(SwapPlanSettings)}
"""Settings that only ``activation_swap: auto`` and ``budget`` read, with their defaults."""

__getattr__ = module_getattr(__name__)  # AutoSwapSettings and AUTO_ONLY_SETTINGS, until 0.3


def resolve_config(
    source: str | Path | Mapping[str, Any] | None = None, overrides: Iterable[str] = ()
) -> TrainerConfig:
    """Build a :class:`TrainerConfig` from a YAML file (or a mapping) plus ``key=value``
    overrides, each value read with ``yaml.safe_load``; raises :class:`ConfigError`."""
    values = dict(_load(source))
    given: dict[str, str] = {}
    for override in overrides:
        key, value = _parse_override(override)
        if key in given:
            raise ConfigError(
                key, f"given twice as an override ({given[key]} and {override}); keep one of them"
            )
        given[key] = override
        values[key] = value
    known = TrainerConfig.keys()
    for key in values:
        _check_known_key(key, known)
    hints = _field_types()
    return TrainerConfig(**{key: _coerce(value, hints[key]) for key, value in values.items()})


def _load(source: str | Path | Mapping[str, Any] | None) -> Mapping[Any, Any]:
    if source is None:
        return {}
    if isinstance(source, Mapping):
        data: Any = source
    else:
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ConfigError(
                "<file>",
                f"{str(path)!r} is not a UTF-8 text file ({error.reason} at byte"
                f" {error.start}); pass a YAML file of settings",
            ) from error
        except OSError as error:
            raise ConfigError("<file>", f"cannot read {str(path)!r}: {error}") from error
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)
        except _DuplicateKeyError as error:
            raise ConfigError(
                error.key,
                f"given twice in {str(path)!r} (lines {error.first} and {error.second});"
                " keep one of them",
            ) from error
        except yaml.YAMLError as error:
            raise ConfigError("<file>", f"{str(path)!r} is not valid YAML: {error}") from error
        if data is None:
            return {}
    if not isinstance(data, Mapping):
        raise ConfigError("<root>", f"expected a mapping of settings, got {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(repr(key), "setting names must be strings")
    return data


class _DuplicateKeyError(GraphswapError, yaml.YAMLError):
    def __init__(self, key: str, first: int, second: int) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key, self.first, self.second = key, first, second


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice: PyYAML keeps the last value
    silently, so the earlier line would be a setting dropped without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                continue
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKeyError(key, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _parse_override(override: str) -> tuple[str, Any]:
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(key or override, f"override {override!r} must look like key=value")
    if not text.strip():
        # YAML reads an empty text as null, which for pass_order means the canonical order:
        # a value left out by mistake would change the run without a word.
        _check_known_key(key, TrainerConfig.keys())
        optional = type(None) in typing.get_args(_field_types()[key])
        unset = f", or {key}=null to leave it at its default" if optional else ""
        raise ConfigError(key, f"override {override!r} has no value; give one{unset}")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(key, f"cannot read override value {text!r}: {error}") from error
    annotation = _field_types().get(key)
    if isinstance(value, dict) and str in (annotation, *typing.get_args(annotation)):
        # YAML reads text ending in a colon (device=sim:) as a mapping; a text setting
        # takes it as written, and its own check says what is wrong with it.
        return key, text
    return key, value


def _check_known_key(key: str, known: tuple[str, ...]) -> None:
    if key in known:
        return
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(key, f"unknown key; {hint}valid keys: {', '.join(known)}")


@functools.cache
def _field_types() -> dict[str, Any]:
    """Resolved once: every config (and every ``dataclasses.replace``) checks its fields."""
    return typing.get_type_hints(TrainerConfig)


def parse_names(text: str) -> tuple[str, ...]:
    """``"swap,fsdp"`` -> ``("swap", "fsdp")``: the comma-separated form of a list
    setting, as an override or ``graphswap passes --order`` takes it."""
    return tuple(name.strip() for name in text.split(","))


def _coerce(value: Any, annotation: Any) -> Any:
    """Turn YAML 1.1 float text (``1e-3``) into a float where a float is expected, and
    comma-separated text into a list where a list is expected (an override
    ``pass_order=swap,fsdp`` is YAML text); everything else is passed on unchanged and
    type-checked by ``TrainerConfig``."""
    options = (annotation, *typing.get_args(annotation))
    floats = float in options
    if floats and isinstance(value, str) and _FLOAT_TEXT.fullmatch(value):
        return float(value)
    lists = any(typing.get_origin(option) is tuple for option in options)
    if lists and isinstance(value, str):
        return parse_names(value)
    return value


def _check_device(device: str) -> None:
    if device in DEVICES:
        return
    if device.strip() == SIM_PREFIX:
        raise ConfigError(
            "device",
            f"{device} names no device profile; give one of {', '.join(sorted(PRESETS))}"
            f" (sim:h200, figures may follow: sim:h200,link_gbps=25)",
        )
    try:
        if simulated_profile(device) is not None:
            return
    except ProfileError as error:
        raise ConfigError("device", str(error)) from None
    raise ConfigError(
        "device",
        f"got {device!r}; allowed values: {', '.join(DEVICES)}, or sim:<profile> for the"
        f" clocked simulated accelerator (sim:h200, sim:h100, sim:h200,link_gbps=25)",
    )


def _checked(key: str, value: Any, annotation: Any) -> Any:
    """``value`` if it has the field's type (an int is widened to float), else raise."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed or type(value) is not type(allowed[0]):
            shown = "null" if value is None else repr(value)
            hint = ""
            if value is None and "none" in allowed:
                hint = " (YAML null means no value; write none to turn it off)"
            raise ConfigError(
                key, f"got {shown}; allowed values: {', '.join(repr(a) for a in allowed)}{hint}"
            )
        return value
    if origin in (Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return value
        options = tuple(option for option in options if option is not type(None))
        if len(options) > 1:
            return _checked_union(key, value, options)
        (annotation,) = options
    if typing.get_origin(annotation) is tuple:
        return _checked_list(key, value)
    if annotation is float and type(value) is int:
        return float(value)
    if type(value) is not annotation:
        raise ConfigError(
            key,
            f"expected {_type_name(annotation)}, got {type(value).__name__} {value!r}",
        )
    return value


def _checked_union(key: str, value: Any, options: tuple[Any, ...]) -> Any:
    """``value`` checked against the first option it fits (a number or a keyword)."""
    for option in options:
        try:
            return _checked(key, value, option)
        except ConfigError:
            continue
    expected = " or ".join(_type_name(option) for option in options)
    raise ConfigError(key, f"expected {expected}, got {type(value).__name__} {value!r}")


def _checked_list(key: str, value: Any) -> tuple[str, ...]:
    """A YAML list of strings, kept as a tuple so that the config stays immutable."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(
            key,
            f"expected a list of names (YAML [a, b] or a,b), got {type(value).__name__} {value!r}",
        )
    return tuple(value)


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(annotation))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        annotation, str(annotation)
    )


def check_finite_positive(key: str, value: float, unit: str = "", alternative: str = "") -> float:
    """The one rule for a rate every command reads (a link's GB/s, compute in TFLOP/s, a
    learning rate): a number above zero and finite, since a plan or a step made with
    ``inf`` or ``nan`` is meaningless. Returns ``value``; raises :class:`ConfigError`
    naming ``key`` (a config key or a command-line flag), ``unit`` and the
    ``alternative`` spelled out (``" or measure"``)."""
    if not (value > 0 and math.isfinite(value)):
        of_unit = f" of {unit}" if unit else ""
        raise ConfigError(key, f"must be a finite number{of_unit} > 0{alternative}, got {value!r}")
    return value


def _check_rope_factor(value: float) -> None:
    """The planner's rule for ``rope_factor`` (a finite number > 1), as a config error."""
    try:
        check_rope_factor(value)
    except PlanSettingError as error:
        raise ConfigError("rope_factor", f"{error.detail}, got {value!r}") from None


def _check_at_least(key: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {value}")
