"""Shared fixtures: tiny models built from a config (never downloaded), and console-script
runs started in the background."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist


def pytest_configure(config: pytest.Config) -> None:
    """Under ``make test``'s two xdist workers on two cores, each computes on one thread:
    two threads each would oversubscribe the cores, and OpenMP's barriers then make a
    step many times slower."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_model() -> Callable[..., torch.nn.Module]:
    """Factory: a seeded fp32 ``Qwen3MoeForCausalLM`` from the ``tiny`` preset."""
    from graphswap.hf.checkpoints import build_model
    from graphswap.hf.presets import qwen3_moe_config

    def make(seed: int = 0, device: str = "cpu", **overrides: Any) -> torch.nn.Module:
        torch.manual_seed(seed)
        return build_model(qwen3_moe_config("tiny", **overrides), device=device)

    return make


@pytest.fixture
def family_config() -> Callable[[str, str], Any]:
    """Factory: the Hugging Face config of a model preset with ``attn`` attention, or a
    skip when this transformers lacks the preset's family or cannot build its config
    (the floor's may), or its model does not run ``attn``."""
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from graphswap.hf.presets import PRESETS, preset_config

    def make(preset: str, attn: str) -> Any:
        model_type = PRESETS[preset].model_type
        if model_type not in CONFIG_MAPPING_NAMES:
            pytest.skip(f"this transformers has no {model_type!r} models")
        try:
            config = preset_config(preset, attn_implementation="eager")
        except Exception as error:
            # OLMoE's config on 5.4 fails its own field validation; on the versions CI
            # runs the families on (5.17, the latest) every config builds.
            if Version(transformers.__version__) >= Version("5.17"):
                raise
            pytest.skip(f"this transformers cannot build a {model_type!r} config: {error}")
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
        if attn == "sdpa" and not model_class._supports_sdpa:
            pytest.skip(f"{model_class.__name__} runs eager attention only")
        config._attn_implementation = attn
        return config

    return make


_TOUR_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}

TOUR_FAMILIES: dict[str, dict[str, Any]] = {
    "jamba": {
        **_TOUR_COMMON,
        "num_experts": 2,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "mamba_d_state": 4,
    },
    "qwen3_next": {
        **_TOUR_COMMON,
        "head_dim": 16,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "linear_num_value_heads": 2,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
    },
    "bamba": {
        **_TOUR_COMMON,
        "attn_layer_indices": [1, 3],
        "mamba_n_heads": 4,
        "mamba_d_head": 32,
        "mamba_d_state": 8,
        "mamba_n_groups": 1,
    },
    "nemotron_h": {
        **_TOUR_COMMON,
        "hybrid_override_pattern": "M*M*",
        "mamba_num_heads": 4,
        "mamba_head_dim": 32,
        "ssm_state_size": 8,
        "n_groups": 1,
        "head_dim": 16,
    },
    "gpt_neox": {
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 128,
    },
    "jetmoe": {
        **_TOUR_COMMON,
        "num_hidden_layers": 2,
        "kv_channels": 16,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
    },
    "gpt2": {
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "vocab_size": 128,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
    "mamba": {"hidden_size": 64, "num_hidden_layers": 2, "state_size": 4, "vocab_size": 128},
}
"""Families graphswap has no preset for, as small as they build: hybrid stacks (Mamba or
linear attention beside attention), attention under another name than ``self_attn``,
and models without a ``layers`` list."""


@pytest.fixture
def tour_config() -> Callable[..., Any]:
    """Factory: the tiny config of a :data:`TOUR_FAMILIES` family (eager attention), or a
    skip when this transformers lacks the family or cannot build it that small."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    def make(model_type: str, **overrides: Any) -> Any:
        if model_type not in CONFIG_MAPPING_NAMES:
            pytest.skip(f"this transformers has no {model_type!r} models")
        values = {**TOUR_FAMILIES[model_type], **overrides}
        try:
            return AutoConfig.for_model(model_type, attn_implementation="eager", **values)
        except (TypeError, ValueError) as error:
            pytest.skip(f"this transformers cannot build a tiny {model_type!r}: {error}")

    return make


@pytest.fixture
def plans_built(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every pass plan built from here on (``graphswap.passes.pass_plan``,
    ``PassPlan.from_names``): a run builds its pass plan once and passes it along."""
    from graphswap.passes import PassPlan

    built: list[PassPlan] = []
    post_init = PassPlan.__post_init__

    def counted(plan: PassPlan) -> None:
        built.append(plan)
        post_init(plan)

    monkeypatch.setattr(PassPlan, "__post_init__", counted)
    return built


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models on one thread: they are too small for more, and on a loaded machine
    OpenMP's barriers make a step of two threads many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[None]:
    """A one-process gloo world, so that sharding APIs and distributed passes can run in
    this process."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


class ConsoleRun:
    """``python -m graphswap.train.cli ARGV`` in ``cwd``, running in the background."""

    def __init__(self, argv: Sequence[str], cwd: Path) -> None:
        self.argv = list(argv)
        self.cwd = cwd
        # At a low priority in a serial run: it takes the cycles the suite leaves idle, not
        # its threads'. An xdist worker waits on it, so there it runs at the worker's.
        nice = [] if XDIST_WORKER else ["nice", "-n", "10"]
        self._process = subprocess.Popen(
            [*nice, sys.executable, "-m", "graphswap.train.cli", *argv],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def done(self, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Wait for the command to end; what it left."""
        out, err = self._process.communicate(timeout=timeout)
        return subprocess.CompletedProcess(self.argv, self._process.returncode, out, err)

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.communicate()


XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
"""This process is one of ``make test``'s xdist workers."""


def _console_modules(items: Sequence[pytest.Item]) -> dict[str, Any]:
    """The test modules that name a console-script run (``CONSOLE_ARGV``, checked by
    their test ``CONSOLE_TEST``) whose test is among ``items``."""
    modules: dict[str, Any] = {}
    for item in items:
        module = getattr(item, "module", None)
        test = getattr(module, "CONSOLE_TEST", None)
        if test is not None and test == getattr(item, "originalname", None):
            modules[module.__name__] = module
    return modules


@pytest.fixture(scope="session", autouse=True)
def console_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ConsoleRun]]:
    """The console-script run of every test module that names one and whose test is
    selected, started before the first test: a new interpreter spends seconds importing
    torch and transformers, which this way run on the core the in-process tests leave
    idle. An xdist worker is not told in advance which modules it will run, and two
    workers keep both cores busy: it starts a module's run as the module begins
    (:func:`_console_run_of_module`), so that no run is made twice."""
    runs: dict[str, ConsoleRun] = {}
    if not XDIST_WORKER:
        for name, module in _console_modules(request.session.items).items():
            runs[name] = ConsoleRun(module.CONSOLE_ARGV, tmp_path_factory.mktemp("console"))
    try:
        yield runs
    finally:
        for run in runs.values():
            run.stop()


@pytest.fixture(scope="module", autouse=True)
def _console_run_of_module(
    console_runs: dict[str, ConsoleRun],
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Under xdist: this module's console-script run, started as the module begins."""
    name = request.module.__name__
    if name not in console_runs and name in _console_modules(request.session.items):
        console_runs[name] = ConsoleRun(
            request.module.CONSOLE_ARGV, tmp_path_factory.mktemp("console")
        )


@pytest.fixture
def console(console_runs: dict[str, ConsoleRun], request: pytest.FixtureRequest) -> ConsoleRun:
    """This test module's console-script run."""
    return console_runs[request.module.__name__]


@pytest.fixture
def largest_output() -> type:
    """A dispatch mode that records the most elements any operator's output held while
    it was active (``with largest_output() as seen: ...; seen.largest``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestOutput(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
            return out

    return LargestOutput


@pytest.fixture
def graphswap_cmd(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``graphswap_cmd(*argv, cwd=None)``: ``graphswap ARGV`` in this process, through the
    entry point the console script calls (each command's test module keeps one
    subprocess test of the script itself: the ``console`` fixture); argparse's and
    the commands' exits through ``SystemExit`` become the return code, and what it
    printed the process's output, as if the console script had run."""

    from graphswap.train.cli import main

    def run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(argv), code, out, err)

    return run


@pytest.fixture
def clocked_step() -> Callable[..., Any]:
    """``clocked_step(net, ids, **forward)``: the timeline of ``net``'s second training
    step (forward, backward, AdamW over the parameters that train; the first step made
    AdamW's state) on the clocked simulated H200, as the planner's step runs."""
    from graphswap.hf.checkpoints import decoder_layers
    from graphswap.runtime.profile import device_profile
    from graphswap.runtime.sim import SimulatedAccelerator
    from graphswap.runtime.timeline import OPTIMIZER_LABEL
    from graphswap.train.trainer import state_bytes

    def clocked(net: torch.nn.Module, ids: torch.Tensor, **forward: Any) -> Any:
        trained = [p for p in net.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=1e-3)

        def step() -> None:
            net(input_ids=ids, labels=ids, use_cache=False, **forward).loss.backward()

        step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sim = SimulatedAccelerator(profile=device_profile("h200"))
        with sim.clock(decoder_layers(net)[1], base_bytes=state_bytes(net, optimizer)) as clock:
            step()
            clock.label(OPTIMIZER_LABEL)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return clock.timeline

    return clocked
