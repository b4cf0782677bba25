"""``graphswap plan-memory``: one training step with activation swap, predicted without a GPU.

The model is built and traced on the meta device (see ``graphswap.planning``), so a
235B-parameter config costs neither memory nor a download. The planner returns data;
this module renders it, from the same dictionaries ``--format json`` prints.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphswap import _compat
from graphswap.train.cli._args import (
    Once,
    num_layers_option,
    positive_float,
    positive_int,
    user_error,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from graphswap.planning import MemoryPlan

DTYPES = ("bfloat16", "float16", "float32")
AUTOCAST_DTYPES = ("bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
DEVICES = ("cuda", "cpu")
KERNELS = ("flash", "efficient", "cudnn", "math")


def memory_size(text: str) -> int:
    """``141GiB``, ``80GB``, ``8e10`` (bytes): a device memory, for ``--fit``."""
    from graphswap.planning._budget import SIZE_EXAMPLES, parse_size

    value = parse_size(text)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"expected a finite size such as {SIZE_EXAMPLES}, got {text!r}"
        )
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte, got {text!r}")
    return value


def module_names(text: str) -> tuple[str, ...]:
    """``q_proj,v_proj``: module names, for ``--lora-target-modules``."""
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected names separated by commas, got {text!r}")
    return names


def memory_budget(text: str) -> str:
    """``--activation-memory-budget``: bytes, a size, or a fraction of the profile's
    memory, read as ``activation_memory_budget`` is."""
    from graphswap.hf.attention_kernels import PlanSettingError
    from graphswap.planning._budget import read_memory_budget

    try:
        read_memory_budget(text)
    except PlanSettingError as error:
        raise argparse.ArgumentTypeError(f"{error.detail}, got {text!r}") from None
    return text  # as written: run() takes a fraction of the profile's memory and names it


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    # Deferred so that `graphswap --help` does not load torch (see graphswap.train.cli).
    from graphswap.hf.presets import preset_names

    parser = subparsers.add_parser(
        "plan-memory",
        help="predict one training step with activation swap: time, stalls, memory (no GPU)",
        description=(
            "Trace one training step (forward, backward, AdamW) of a Hugging Face decoder (any "
            "family a preset or --model DIR's config.json names) on the "
            "meta device, time every operator on a device profile, and replay the step as the "
            "swap runtime runs it: per decoder layer what is saved and swapped, the copy time "
            "against both windows (forward, fenced --swap-offload-lag modules later; backward, "
            "prefetched --swap-prefetch-depth modules ahead) and both stalls, the predicted step "
            "time and its ratio to the step without swap, and the device-memory peak with "
            "and without swap and where it falls. Attention runs the kernel the training "
            "device runs; with --tp-size the prediction is one rank's. --activation-swap auto "
            "shows what activation_swap: auto would swap: per layer the saved tensors whose "
            "copies hide in both windows. --fit finds the longest sequence each mode fits in "
            "a device's memory."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model", metavar="DIR", help="local Hugging Face checkpoint folder (config.json only)"
    )
    source.add_argument("--preset", choices=preset_names(), help="embedded model shape")
    # Each planner setting's flag is its config key with dashes (--seq-len: seq_len), so
    # a refusal naming the setting names the flag.
    parser.add_argument(
        "--seq-len",
        action=Once,
        default=None,
        type=positive_int,
        metavar="N",
        help="tokens (required unless --fit)",
    )
    parser.add_argument(
        "--batch-size",
        action=Once,
        default=None,
        type=positive_int,
        metavar="B",
        help="sequences per batch (default 1)",
    )
    num_layers_option(parser)
    parser.add_argument(
        "--profile",
        default=None,
        metavar="NAME",
        help="device profile: h200 (default) or h100, figures may follow "
        "(h200,link_gbps=25,tflops=300,hbm_gbps=3000,memory_bytes=8e10,"
        "attention_efficiency=0.7)",
    )
    parser.add_argument(
        "--host-memory",
        type=memory_size,
        default=None,
        metavar="SIZE",
        help="host memory of the node training runs on (2TiB); the host pool's budget per "
        "rank is half of it over --ranks-per-node, as the runtime takes it there (default: "
        "the profile's node, 8 GPUs and 2 TiB for h100 and h200)",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=positive_int,
        default=None,
        metavar="N",
        help="ranks (GPUs) per node sharing its host memory (default: the profile's, 8)",
    )
    parser.add_argument(
        "--swap-bandwidth-gbps",
        action=Once,
        default=None,
        type=positive_float,
        metavar="GBPS",
        help="host link bandwidth per direction in GB/s (default: the profile's, 50)",
    )
    parser.add_argument(
        "--swap-tflops",
        action=Once,
        default=None,
        type=positive_float,
        metavar="T",
        help="sustained compute in TFLOP/s (default: the profile's, 400)",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument(
        "--autocast-dtype",
        choices=AUTOCAST_DTYPES,
        help="the step runs under torch.autocast in this dtype around --dtype weights (HF"
        " Trainer's and TRL's bf16/fp16 mixed precision: --dtype float32 --autocast-dtype"
        " bfloat16); default: no autocast",
    )
    parser.add_argument(
        "--attn-implementation",
        choices=ATTN_IMPLEMENTATIONS,
        default="sdpa",
        help="Hugging Face attention: sdpa (default, fused kernels) or eager (saves the "
        "seq x seq probabilities)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cuda",
        help="device the training runs on, which decides the sdpa kernel and the optimizer "
        "(default cuda)",
    )
    parser.add_argument(
        "--attn-kernel",
        choices=KERNELS,
        default=None,
        help="sdpa kernel to trace; on cuda: flash (default for bfloat16/float16), efficient "
        "(default for float32, which flash and cudnn cannot run), cudnn, math; on cpu: flash "
        "(default) or math",
    )
    parser.add_argument(
        "--tp-size",
        action=Once,
        default=None,
        type=positive_int,
        metavar="N",
        help="tensor-parallel ranks (attention heads sharded as graphswap train tp_size=N "
        "shards them): predict one rank's bytes (default 1)",
    )
    parser.add_argument(
        "--loss-head",
        choices=("full", "chunked", "trl"),
        default=None,
        help="the head the step's loss runs: full (the model's own: every token's logits at "
        "once, the default), chunked (graphswap's chunked head, as graphswap train "
        "loss_head: chunked installs it) or trl (TRL SFTTrainer's fused head)",
    )
    parser.add_argument(
        "--loss-head-chunk-size",
        type=positive_int,
        metavar="TOKENS",
        default=None,
        help="with --loss-head chunked: tokens per chunk (default 1024)",
    )
    parser.add_argument(
        "--lora-rank",
        type=positive_int,
        metavar="R",
        default=None,
        help="plan a LoRA fine-tune (PEFT): adapters of rank R on --lora-target-modules train,"
        " every other weight is frozen (no gradient, no AdamW state, no weight gradient in "
        "backward)",
    )
    parser.add_argument(
        "--lora-target-modules",
        type=module_names,
        metavar="NAMES",
        default=None,
        help="with --lora-rank: the linear layers adapted, comma-separated (default "
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)",
    )
    parser.add_argument(
        "--lora-dropout",
        type=float,
        metavar="P",
        default=None,
        help="with --lora-rank: the adapters' dropout (default 0)",
    )
    parser.add_argument(
        "--activation-swap",
        action=Once,
        default=None,
        metavar="MODE",
        help="what is swapped, as graphswap train's activation_swap: attention (default), "
        "layer (every tensor of the decoder layer the size policy swaps), auto (per layer, "
        "largest first, the tensors whose copies hide in both windows, less --swap-hide-margin), "
        "budget (per layer what to keep, swap and recompute within --activation-memory-budget) "
        "or none",
    )
    parser.add_argument(
        "--activation-memory-budget",
        action=Once,
        default=None,
        type=memory_budget,
        metavar="MEMORY",
        help="--activation-swap budget (implied): the device peak to plan within (120GiB, "
        "80GB, bytes, or a fraction of the profile's memory such as 0.85); prints per layer "
        "the bytes kept, swapped and recomputed",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="with --activation-swap budget: the trainer checkpoints every layer (TRL's "
        "SFTConfig default, graphswap.train.budget.apply_budget honours it), so the plan "
        "recomputes every whole layer and weighs only how much of their inputs to swap",
    )
    parser.add_argument(
        "--swap-hide-margin",
        action=Once,
        default=None,
        type=float,
        metavar="M",
        help="auto: share of each copy's window left free, in [0, 1) (default 0.1)",
    )
    parser.add_argument(
        "--swap-offload-lag",
        action=Once,
        default=None,
        type=int,
        metavar="N",
        help="the SwapManager's swap_offload_lag: a module's copies to host are fenced when the "
        "forward N modules later begins (default: auto plans 1 and 2 and keeps the lower "
        "peak, the other modes 1)",
    )
    parser.add_argument(
        "--swap-prefetch-depth",
        action=Once,
        default=None,
        type=int,
        metavar="N",
        help="the SwapManager's swap_prefetch_depth: a module's tensors come back when backward "
        "reaches the module N later (default 1)",
    )
    parser.add_argument(
        "--state-shards",
        type=int,
        default=1,
        metavar="N",
        help="shard parameters, gradients and AdamW state FSDP-style over N ranks (an "
        "approximation: gathers and communication are not modelled; default 1)",
    )
    parser.add_argument(
        "--fit",
        type=memory_size,
        nargs="?",
        const=0,
        default=None,
        metavar="MEMORY",
        help="instead of one plan: the longest sequence each mode (none, attention, layer, "
        "auto, budget) fits in MEMORY (141GiB, 80GB; alone: the profile's memory), and its step "
        "ratio",
    )
    parser.add_argument(
        "--seq-step",
        type=positive_int,
        default=None,
        metavar="N",
        help="--fit: answer in multiples of N tokens (default 512)",
    )
    parser.add_argument(
        "--max-step-ratio",
        type=float,
        action=Once,
        default=None,
        metavar="R",
        help="--fit: also the longest sequence that fits (every shorter one too) and runs at "
        "a step ratio (to none's at the same length) of at most R >= 1 (1.05: 5%% slower)",
    )
    parser.add_argument(
        "--rope-factor",
        type=float,
        action=Once,
        default=None,
        metavar="F",
        help="stretch the model's window F > 1 times with YaRN rope scaling, as the trainer's "
        "rope_factor (Qwen3 documents 4): --seq-len and --fit go up to F x the window "
        "(default: the config's own rope scaling, if any)",
    )
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw device memory over the step; with --fit, each mode's peak and step "
        "ratio over the sequence length, the memory as a line (needs matplotlib)",
    )
    _compat.add_old_flags(parser, "plan-memory")
    parser.set_defaults(run=run)


def _mode(args: argparse.Namespace) -> str:
    """The swap mode of one plan: ``--activation-memory-budget`` implies ``budget``; else
    ``attention``."""
    budget = args.activation_memory_budget
    return args.activation_swap or ("budget" if budget is not None else "attention")


def _plot_refusal(plot: str) -> str | None:
    """``--plot FILE`` whose suffix names no format matplotlib writes: refused before the
    planning, not by matplotlib once it is done. Without matplotlib, ``run`` says so."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase  # optional: the plot extra
    except ModuleNotFoundError:
        return None
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if Path(plot).suffix.lstrip(".").lower() in formats:
        return None
    return (
        f"--plot {plot}: the file's suffix names the image format, one of {', '.join(formats)};"
        " name the file accordingly (fit.png)"
    )


def _refusal(args: argparse.Namespace) -> str | None:
    """A combination of flags that would change nothing, or lacks what it needs."""
    if args.plot is not None and (refusal := _plot_refusal(args.plot)) is not None:
        return refusal
    mode = _mode(args)
    budget = args.activation_memory_budget
    if args.fit is None and (mode == "budget") != (budget is not None):
        if budget is None:
            return (
                "--activation-swap budget needs --activation-memory-budget MEMORY (120GiB): the"
                " peak to plan in"
            )
        return (
            f"--activation-memory-budget {budget} is read by --activation-swap budget only (it"
            f" would change nothing for --activation-swap {mode}); drop one of them"
        )
    if args.activation_checkpointing and (args.fit is not None or mode != "budget"):
        return (
            "--activation-checkpointing is honoured by --activation-swap budget alone (the"
            " mode that owns recompute), and --fit weighs every mode; plan with"
            " --activation-memory-budget MEMORY and --seq-len N, or drop it"
        )
    margin = args.swap_hide_margin
    if margin is not None and mode not in ("auto", "budget") and args.fit is None:
        return (
            f"--swap-hide-margin {margin} applies to --activation-swap auto only (it would"
            f" change nothing for --activation-swap {mode}); add --activation-swap auto or drop it"
        )
    if args.fit is None and mode == "none":
        for flag, value in (
            ("--host-memory", args.host_memory),
            ("--ranks-per-node", args.ranks_per_node),
        ):
            if value is not None:
                return (
                    f"{flag} {value} sizes the swap's host pool, and --activation-swap none "
                    f"swaps nothing; choose a swap mode or drop {flag}"
                )
    if args.fit is None:
        if args.seq_len is None:
            return "--seq-len N is required (or --fit, which searches the sequence length)"
        for flag, value in (
            ("--seq-step", args.seq_step),
            ("--max-step-ratio", args.max_step_ratio),
        ):
            if value is not None:
                return f"{flag} {value} applies to --fit only; add --fit or drop it"
        return None
    for flag, value in (
        ("--seq-len", args.seq_len),
        ("--activation-swap", args.activation_swap),
        ("--activation-memory-budget", budget),
    ):
        if value is not None:
            return (
                f"{flag} {value} with --fit: the fit searches the sequence for every mode (none, "
                f"attention, layer, auto, and budget within the fit's memory); drop {flag}"
            )
    return None


def run(args: argparse.Namespace) -> int:
    # Deferred so that `graphswap --help` does not load torch (see graphswap.train.cli).
    import torch

    from graphswap.planning import (
        DEFAULT_PROFILE,
        PlanSettingError,
        ProfileError,
        fit_sequence,
        plan_memory,
    )
    from graphswap.planning._budget import resolve_memory_budget
    from graphswap.planning._fit import DEFAULT_SEQ_STEP, fit_settings
    from graphswap.planning._registry import memory_strategy
    from graphswap.planning._settings import (
        PROFILE_FIGURES,
        SCHEDULE_FIELDS,
        SHAPE_FIELDS,
        step_settings,
    )
    from graphswap.runtime.profile import device_profile

    refusal = _refusal(args)
    if refusal is not None:
        return user_error("plan-memory", refusal)
    source = f"--model {args.model}" if args.model is not None else f"--preset {args.preset}"
    config = _model_config(args, source)
    if isinstance(config, str):
        return user_error("plan-memory", config)
    node = {
        key: value
        for key, value in (
            ("host_memory_bytes", args.host_memory),
            ("ranks_per_node", args.ranks_per_node),
        )
        if value is not None
    }
    try:
        profile = device_profile(args.profile or DEFAULT_PROFILE)
        if node:
            profile = profile.with_figures(**node)
    except ProfileError as error:
        return user_error("plan-memory", f"--profile {args.profile or DEFAULT_PROFILE}: {error}")
    # The flags' destinations are the settings' names: what is set goes to the planner.
    settings: dict[str, Any] = {
        name: getattr(args, name)
        for name in (*SHAPE_FIELDS, *SCHEDULE_FIELDS, *PROFILE_FIGURES)
        if getattr(args, name, None) is not None
    }
    settings["dtype"] = getattr(torch, args.dtype)
    if args.autocast_dtype is not None:
        settings["autocast_dtype"] = getattr(torch, args.autocast_dtype)
    try:
        if args.fit is not None:
            shape, schedule, figures = fit_settings(
                "fit_sequence", settings, args.seq_step or DEFAULT_SEQ_STEP
            )
            fit = fit_sequence(
                config,
                shape,
                schedule=schedule,
                memory_bytes=args.fit or None,
                profile=profile,
                max_step_ratio=args.max_step_ratio,
                **figures,
            )
            data = fit.to_dict()
        else:
            budget = args.activation_memory_budget
            strategy = memory_strategy(_mode(args))
            budget_bytes = (
                None
                if budget is None
                else resolve_memory_budget(
                    budget, profile.memory_bytes, device=f"the {profile.name} profile"
                )
            )
            strategy.check_budget(budget_bytes)
            shape, schedule, figures = step_settings("plan_memory", settings)
            plan = plan_memory(
                config,
                shape,
                schedule=schedule,
                profile=profile,
                activation_swap=strategy.name,
                activation_memory_budget=budget_bytes,
                activation_checkpointing=args.activation_checkpointing,
                **figures,
            )
            data = plan.to_dict()
    except PlanSettingError as error:
        if error.setting == "model":
            return user_error("plan-memory", f"{source}: {error.detail}")
        flag = "--" + error.setting.replace("_", "-")
        return user_error("plan-memory", f"{flag} {error.value}: {error.detail}")
    except ProfileError as error:
        return user_error("plan-memory", f"--profile {args.profile or DEFAULT_PROFILE}: {error}")
    if args.plot:
        try:
            if args.fit is not None:
                plot_fit(data, Path(args.plot))
            else:
                plot_timeline(plan, Path(args.plot))
        except ModuleNotFoundError as error:
            if error.name != "matplotlib":
                raise
            return user_error(
                "plan-memory",
                f"--plot {args.plot} needs matplotlib, which is not installed;"
                " install it with: pip install graphswap[plot]",
            )
    if args.format == "json":
        print(json.dumps(data, indent=2))
        return 0
    print(format_fit(data) if args.fit is not None else format_plan(data))
    if args.plot:
        print(f"{'fit' if args.fit is not None else 'timeline'} written to {args.plot}")
    return 0


def _model_config(args: argparse.Namespace, source: str) -> PretrainedConfig | str:
    """The config to plan (``--num-layers`` and ``--rope-factor`` applied), or why not:
    a bad flag, or a ``--seq-len`` past the window its positions cover."""
    from graphswap.hf.checkpoints import CheckpointError, LayerCountError, model_config
    from graphswap.hf.rope import context_window, pretraining_window
    from graphswap.planning import PlanSettingError

    try:
        config = model_config(
            args.preset,
            args.model,
            attn_implementation=args.attn_implementation,
            num_layers=args.num_layers,
            rope_factor=args.rope_factor,
        )
    except CheckpointError as error:
        return f"--model {args.model}: {error}"
    except LayerCountError as error:
        return f"--num-layers {args.num_layers}: {source} has {error}"
    except PlanSettingError as error:
        return f"--rope-factor {error.value}: {error.detail}"
    window = context_window(config)
    if window is not None and args.seq_len is not None and args.seq_len > window:
        original = pretraining_window(config)
        factor = -(-args.seq_len // original)  # > 1: the window holds the original
        return (
            f"--seq-len {args.seq_len}: longer than the {window} tokens {source}'s positions "
            f"cover (max_position_embeddings, or its rope scaling's); stretch them with "
            f"--rope-factor {factor} (YaRN over {original} tokens: up to {factor * original})"
        )
    return config


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _link(profile: Mapping[str, Any]) -> str:
    d2h, h2d = profile["d2h_gbps"], profile["h2d_gbps"]
    return f"link={d2h:g} GB/s" if d2h == h2d else f"link={d2h:g}/{h2d:g} GB/s (d2h/h2d)"


def _loss_head(plan: Mapping[str, Any]) -> str:
    """``full``, ``chunked:<tokens per chunk>`` or ``trl``."""
    size = plan.get("loss_head_chunk_size")
    return plan["loss_head"] if size is None else f"{plan['loss_head']}:{size}"


def _lora(plan: Mapping[str, Any]) -> str:
    """`` lora_rank=R`` for a LoRA step's plan; nothing for a full fine-tune's."""
    rank = plan.get("lora_rank")
    return "" if rank is None else f" lora_rank={rank}"


def settings_line(plan: Mapping[str, Any]) -> str:
    profile = plan["profile"]
    margin = (
        ""
        if plan.get("swap_hide_margin") is None
        else f" swap_hide_margin={plan['swap_hide_margin']:g}"
    )
    kernel = "" if plan["attn_kernel"] is None else f" attn_kernel={plan['attn_kernel']}"
    shards = "" if plan["state_shards"] == 1 else f" state_shards={plan['state_shards']}"
    chosen = " (chosen)" if plan.get("swap_offload_lag_chosen") else ""
    autocast = f"autocast_dtype={plan['autocast_dtype']} " if plan.get("autocast_dtype") else ""
    return (
        f"seq_len={plan['seq_len']} batch_size={plan['batch_size']} dtype={plan['dtype']} "
        f"{autocast}device={plan['device']} "
        f"attn_implementation={plan['attn_implementation']}{kernel} "
        f"tp_size={plan['tp_size']} loss_head={_loss_head(plan)}{_lora(plan)} "
        f"activation_swap={plan['activation_swap']} "
        f"policy={plan['policy']} profile={profile['name']} {_link(profile)} "
        f"compute={profile['tflops']:g} TFLOP/s hbm={profile['hbm_gbps']:g} GB/s "
        f"swap_offload_lag={plan['swap_offload_lag']}{chosen} "
        f"swap_prefetch_depth={plan['swap_prefetch_depth']}"
        f"{shards}{margin} attention_timing={'+'.join(plan['attention_timing']) or 'every score'}"
    )


def format_layers(plan: Mapping[str, Any]) -> list[str]:
    """The settings and the per-layer table: bytes, each copy against its window and the
    stall it causes, the verdict; for ``layer`` and ``auto`` also which saves (by index
    in the layer's forward) move. For ``auto``, what it chose, in one line."""
    swap = plan["activation_swap"]
    moved = "swapped" if swap in ("auto", "budget") else "swappable"
    saves = swap in ("layer", "auto", "budget")
    budget = swap == "budget"
    header = (
        f"{'layer':<22} {'saved':>11} {moved:>11} {'kept':>11} "
        + (f"{'recomputed':>11} {'recomp ms':>9} " if budget else "")
        + f"{'copy ms':>8} "
        f"{'fwd win':>8} {'fwd stall':>9} {'reload ms':>9} {'bwd win':>8} {'bwd stall':>9}  "
        + ("verdict         swapped saves (#)" if saves else "verdict")
    )
    lines = [settings_line(plan), header, "-" * len(header)]
    for layer in plan["layers"]:
        indices = ",".join(str(s["index"]) for s in layer.get("swapped_saves", ())) or "-"
        verdict = layer["verdict"]
        lines.append(
            f"{layer['name']:<22} {format_bytes(layer['saved_bytes']):>11} "
            f"{format_bytes(layer['swappable_bytes']):>11} "
            f"{format_bytes(layer['kept_bytes']):>11} "
            + (
                f"{format_bytes(layer['recomputed_bytes']):>11} "
                f"{_ms(layer['recompute_seconds']):>9} "
                if budget
                else ""
            )
            + f"{_ms(layer['copy_seconds']):>8} "
            f"{_ms(layer['forward_window']):>8} {_ms(layer['forward_stall']):>9} "
            f"{_ms(layer['reload_seconds']):>9} {_ms(layer['backward_window']):>8} "
            f"{_ms(layer['backward_stall']):>9}  "
            + (f"{verdict:<14}  {indices}" if saves else verdict)
        )
    lines.append("-" * len(header))
    if swap == "auto":
        lines.append(auto_verdict(plan))
    if budget:
        lines.append(budget_verdict(plan))
    return lines


def budget_verdict(plan: Mapping[str, Any]) -> str:
    """One line on what ``budget`` chose, and the options it weighed."""
    recompute = " and ".join(plan["recompute"]) or "nothing"
    weighed = "; ".join(
        f"{' + '.join(o['recompute']) or 'no recompute'} with {o['swap']}: peak "
        f"{format_bytes(o['peak_bytes'])}, ratio {o['step_ratio']:.4f}"
        for o in plan["budget_options"]
    )
    return (
        f"budget {format_bytes(plan['activation_memory_budget'])}: recompute {recompute} "
        f"({format_bytes(plan['recomputed_bytes'])} dropped), swap {plan['budget_swap']} "
        f"({format_bytes(plan['swapped_bytes'])}), keep the rest; weighed: {weighed}"
    )


def auto_verdict(plan: Mapping[str, Any]) -> str:
    """One line on what ``auto`` chose; says so, and why, when it swaps nothing."""
    margin = plan.get("swap_hide_margin") or 0.0
    profile = plan["profile"]
    if plan["swapped_bytes"] == 0:
        smallest = plan.get("smallest_swappable")
        if smallest is None:
            return "auto swaps nothing: no layer saves a tensor the swap could move"
        layer = next(x for x in plan["layers"] if x["name"] == smallest["layer"])
        copy = smallest["nbytes"] / (profile["d2h_gbps"] * 1e9)
        return (
            f"auto swaps nothing: the smallest swappable tensor "
            f"({format_bytes(smallest['nbytes'])}, {smallest['layer']}) copies in "
            f"{_ms(copy)} ms at {profile['d2h_gbps']:g} GB/s, more than {1 - margin:.0%} of "
            f"its windows (forward {_ms(layer['forward_window'])} ms, backward "
            f"{_ms(layer['backward_window'])} ms at {profile['tflops']:g} TFLOP/s), and so "
            "does every other: every tensor stays on device; a faster link "
            "(swap_bandwidth_gbps) or slower compute (swap_tflops) would let copies hide, "
            "activation_swap: layer swaps regardless"
        )
    return (
        f"auto swaps {format_bytes(plan['swapped_bytes'])} of the "
        f"{format_bytes(plan['layer_swappable_bytes'])} that layer swap would move; no copy "
        f"fills more than {1 - margin:.0%} of its window, forward or backward, and the "
        "replayed step stalls nowhere"
    )


def _phase_stalls(plan: Mapping[str, Any]) -> tuple[float, float]:
    layers = plan["layers"]
    return (
        sum(layer["forward_stall"] for layer in layers),
        sum(layer["backward_stall"] for layer in layers),
    )


def _peak(timeline: Mapping[str, Any]) -> str:
    return (
        f"{format_bytes(timeline['peak_bytes'])} (at {timeline['peak_label']}, "
        f"{timeline['peak_seconds'] * 1e3:.1f} ms into the step)"
    )


def step_lines(plan: Mapping[str, Any]) -> list[str]:
    """The predicted step and its peak, with swap and without."""
    timeline, baseline = plan["timeline"], plan["baseline"]
    forward, backward = _phase_stalls(plan)
    swap = plan["activation_swap"]
    return [
        f"step: {timeline['step_seconds'] * 1e3:.2f} ms with {swap} swap, "
        f"{baseline['step_seconds'] * 1e3:.2f} ms without: ratio {plan['step_ratio']:.4f} "
        f"(stalls {timeline['stall_seconds'] * 1e3:.3f} ms: forward {forward * 1e3:.3f}, "
        f"backward {backward * 1e3:.3f}; compute {timeline['compute_seconds'] * 1e3:.2f} ms)",
        f"device peak with {swap} swap: {_peak(timeline)}",
        f"device peak without swap: {_peak(baseline)}",
        f"held before the step (parameters, buffers, AdamW state): "
        f"{format_bytes(timeline['base_bytes'])}",
        *host_lines(plan),
    ]


def host_lines(plan: Mapping[str, Any]) -> list[str]:
    """Pinned host memory against the pool's budget; what the budget kept on device."""
    if plan["activation_swap"] == "none":
        return []
    line = (
        f"pinned host memory per rank: {format_bytes(plan['host_peak_bytes'])} at the pool's "
        f"peak, budget {format_bytes(plan['max_host_bytes'])}"
    )
    if plan["refused_bytes"]:
        line += (
            f"; {format_bytes(plan['refused_bytes'])} chosen for swap stays on device (the "
            "pool is full; the peak above counts it)"
        )
    return [line]


def format_plan(plan: Mapping[str, Any]) -> str:
    """``plan-memory``'s text: the table, the step, the saved activations, the assumptions."""
    hide = "yes" if plan["all_hide"] else "NO"
    lines = [
        *format_layers(plan),
        *step_lines(plan),
        f"saved activations: {format_bytes(plan['total_saved_bytes'])}, of which swap takes "
        f"{format_bytes(plan['swapped_bytes'])} off the device (end of forward "
        f"{format_bytes(plan['end_of_forward_with_swap_bytes'])}); outside the layers: "
        f"embedding {format_bytes(plan['embed_saved_bytes'])}, head (final norm, lm_head, "
        f"loss) {format_bytes(plan['head_saved_bytes'])}; every copy hides: {hide}",
        "assumptions:",
        *(f"  - {text}" for text in plan["assumptions"]),
    ]
    return "\n".join(lines)


def format_auto_report(auto: Mapping[str, Any]) -> str:
    """What ``graphswap train`` prints for ``activation_swap: auto`` or ``budget``: the
    settings the plan was made for, the link when measured, and the per-layer choice."""
    lines = [f"activation_swap: {auto['plan']['activation_swap']}, planned for {auto['made_for']}"]
    measured = auto.get("measured_bandwidth")
    if measured is not None:
        lines.append(
            f"swap_bandwidth_gbps: measure: device->host {measured['device_to_host_gbps']:.1f} "
            f"GB/s, host->device {measured['host_to_device_gbps']:.1f} GB/s; planned with the "
            "slower"
        )
    return "\n".join([*lines, *format_layers(auto["plan"])])


def format_fit(fit: Mapping[str, Any]) -> str:
    """``plan-memory --fit``: the state on one rank, then per mode the longest sequence."""
    memory = fit["memory_bytes"]
    shards = fit["state_shards"]
    lines = [
        f"fit in {format_bytes(memory)} ({fit['profile']['name']}), "
        f"batch_size {fit['batch_size']}, "
        f"sequences in steps of {fit['seq_step']} up to {fit['max_seq']}, state_shards {shards}"
        + ("" if fit.get("lora_rank") is None else f", LoRA rank {fit['lora_rank']}"),
        f"per rank before activations: parameters {format_bytes(fit['parameter_bytes'])} + "
        f"gradients {format_bytes(fit['gradient_bytes'])} + AdamW state "
        f"{format_bytes(fit['optimizer_state_bytes'])} + buffers "
        f"{format_bytes(fit['buffer_bytes'])} = {format_bytes(fit['state_bytes'])}",
    ]
    if fit.get("lora_rank") is not None:
        lines.append("gradients and AdamW state: the LoRA adapters' only (base weights frozen)")
    if not fit["state_fits"]:
        needed = fit["shards_needed"]
        fix = (
            f"shard them: --state-shards {needed} or more (FSDP-style over that many ranks; "
            "state_shards in the planner)"
            if needed
            else "no sharding helps: the buffers alone fill it"
        )
        lines.append(
            f"parameters, gradients and AdamW state alone do not fit in "
            f"{format_bytes(memory)}: no sequence fits; {fix}"
        )
        return "\n".join(lines)
    lines.append(
        f"host pool budget per rank: {format_bytes(fit['max_host_bytes'])} "
        f"({fit['profile']['name']}: node of {format_bytes(fit['profile']['host_memory_bytes'])} "
        f"over {fit['profile']['ranks_per_node']} ranks, half of it pinned at most)"
    )
    ratio = fit.get("max_step_ratio")
    within = "" if ratio is None else f" {f'at <= {ratio:g}':>12}"
    header = (
        f"{'mode':<10} {'longest seq':>12}{within} {'step ratio':>10} {'peak':>11}  "
        f"{'peak at':<10}{'stalls ms':>10} {'host peak':>11}"
    )
    lines += [header, "-" * len(header)]
    for mode in fit["modes"]:
        plan = mode["plan"]
        if mode.get("refused"):
            lines.append(f"{mode['activation_swap']:<10} {'refused':>12}  {mode['refused']}")
            continue
        if plan is None:
            lines.append(
                f"{mode['activation_swap']:<10} {'none fits':>12}  (not even {fit['seq_step']})"
            )
            continue
        timeline = plan["timeline"]
        seq = f">= {mode['seq_len']}" if mode["capped"] else str(mode["seq_len"])
        lines.append(
            f"{mode['activation_swap']:<10} {seq:>12}{_within(fit, mode)} "
            f"{plan['step_ratio']:>10.4f} "
            f"{format_bytes(timeline['peak_bytes']):>11}  {timeline['peak_label']:<10}"
            f"{timeline['stall_seconds'] * 1e3:>10.3f} "
            f"{format_bytes(plan.get('host_peak_bytes', 0)):>11}"
        )
    lines.append("-" * len(header))
    for mode in fit["modes"]:
        if len(mode["fits"]) > 1:
            runs = ", ".join(
                f"{first}-{last}" if first != last else str(first) for first, last in mode["fits"]
            )
            lines.append(
                f"{mode['activation_swap']}: the lengths that fit are not one interval: {runs} "
                "(the longest sequence is where the first ends; the lengths between do not fit)"
            )
    if ratio is not None:
        lines.append(
            f"at <= {ratio:g}: the longest sequence that fits (every shorter one too) and runs"
            f" at a step ratio of at most {ratio:g}"
        )
    lines.append(
        f"{_planned(fit)}, {len(fit['traced'])} traced: {', '.join(map(str, fit['traced']))}"
        + (
            "; >= N: fits even at the model's window (max_position_embeddings, or its rope "
            "scaling's)"
            if any(m["capped"] for m in fit["modes"])
            else ""
        )
    )
    return "\n".join(lines)


def _planned(fit: Mapping[str, Any]) -> str:
    """The lengths the fit planned: the whole grid, or up to where nothing can fit."""
    step, planned = fit["seq_step"], fit["planned"]
    if planned == fit["max_seq"] // step or all(m["refused"] for m in fit["modes"]):
        return f"every multiple of {step} up to {fit['max_seq']} planned ({planned} lengths)"
    floor = (
        f"the state and what the embedding and the head save, which no mode moves, exceed "
        f"{format_bytes(fit['memory_bytes'])}"
    )
    if planned == 0:
        return f"no length planned: at {step} already {floor}"
    return (
        f"every multiple of {step} up to {planned * step} planned ({planned} lengths; past it, "
        f"to {fit['max_seq']}, {floor})"
    )


def _within(fit: Mapping[str, Any], mode: Mapping[str, Any]) -> str:
    """The ``--max-step-ratio`` column of one mode's row: empty when not asked."""
    if fit.get("max_step_ratio") is None:
        return ""
    seq = mode["seq_len_at_max_step_ratio"]
    text = "none" if seq is None else f">= {seq}" if seq == fit["max_seq"] else str(seq)
    return f" {text:>12}"


def plot_timeline(plan: MemoryPlan, path: Path) -> None:
    """Device memory through one step, with and without swap."""
    import matplotlib  # optional (the plot extra): needed only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = float(1 << 30)
    fig, ax = plt.subplots(figsize=(10.0, 4.5))
    for timeline, label in (
        (plan.baseline, "without swap"),
        (plan.timeline, f"{plan.activation_swap} swap"),
    ):
        xs, ys = _steps(timeline.memory)
        ax.plot([x * 1e3 for x in xs], [y / gib for y in ys], label=label)
    ax.set_xlabel("time in the step [ms]")
    ax.set_ylabel("device memory [GiB]")
    kernel = "" if plan.attn_kernel is None else f" ({plan.device} {plan.attn_kernel})"
    ax.set_title(
        f"seq_len={plan.seq_len} batch_size={plan.batch_size} {plan.dtype} "
        f"{plan.attn_implementation}{kernel} tp_size={plan.tp_size} on {plan.profile.name}"
    )
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def plot_fit(fit: Mapping[str, Any], path: Path) -> None:
    """Per mode, the step's device peak (top) and step ratio (bottom) at every length the
    fit planned; the memory it fits in as a line."""
    import matplotlib  # optional (the plot extra): needed only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = float(1 << 30)
    fig, (peaks, ratios) = plt.subplots(2, 1, sharex=True, figsize=(10.0, 7.0))
    for mode in fit["modes"]:
        seqs = [point["seq_len"] for point in mode["points"]]
        name = mode["activation_swap"]
        peaks.plot(seqs, [point["peak_bytes"] / gib for point in mode["points"]], label=name)
        ratios.plot(seqs, [point["step_ratio"] for point in mode["points"]], label=name)
    peaks.axhline(fit["memory_bytes"] / gib, color="black", linestyle="--", label="memory")
    peaks.set_ylabel("device peak [GiB]")
    ratios.set_ylabel("step ratio (to none)")
    ratios.set_xlabel("sequence length [tokens]")
    peaks.set_title(
        f"{fit['profile']['name']}, batch_size {fit['batch_size']}, "
        f"state_shards {fit['state_shards']}, "
        f"host budget {format_bytes(fit['max_host_bytes'])} per rank"
    )
    peaks.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _steps(memory: Sequence[tuple[float, int]]) -> tuple[list[float], list[int]]:
    """A step plot's points: each level held until the next change."""
    xs: list[float] = []
    ys: list[int] = []
    for seconds, nbytes in memory:
        if ys:
            xs.append(seconds)
            ys.append(ys[-1])
        xs.append(seconds)
        ys.append(nbytes)
    return xs, ys
