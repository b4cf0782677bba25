"""The names the swap's settings had before one spelling (issue 41, item 2) work until
0.3, each with a ``DeprecationWarning`` at the caller's line naming the new one, and do
what the new one does: the runtime's ``prefetch_depth``/``offload_lag`` keywords and
properties, ``host_budget``, a ``SwapManager`` pickled with the old option keys, and the
planner's flat calls of ``replay`` and ``fit_sequence``."""

from __future__ import annotations

import itertools
import pickle
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import graphswap.runtime
from graphswap.errors import GraphswapDeprecationWarning
from graphswap.hf.presets import preset_config, qwen3_moe_config
from graphswap.passes.swap import apply_swap, verify_swap
from graphswap.planning import PlanSettingError, fit_sequence
from graphswap.planning.saved_tensors import build_meta_model
from graphswap.planning.trace import (
    StepShape,
    SwapSchedule,
    layer_candidates,
    replay,
    swap_choice,
    trace_step,
)
from graphswap.runtime import SwapManager, SwapStats, default_max_host_bytes, swap_wrapper
from graphswap.runtime.policy import size_threshold_policy
from graphswap.runtime.profile import device_profile

pytestmark = pytest.mark.compat


@contextmanager
def one_warning(*names: str) -> Iterator[list[warnings.WarningMessage]]:
    """Exactly one ``GraphswapDeprecationWarning``, at this file's line, naming each of
    ``names``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    assert len(caught) == 1, [str(w.message) for w in caught]
    (warning,) = caught
    assert warning.category is GraphswapDeprecationWarning and warning.filename == __file__
    assert "removed in 0.3" in str(warning.message)
    for name in names:
        assert name in str(warning.message)


@contextmanager
def no_warning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        yield


def test_the_managers_old_keywords_warn_naming_the_new_ones_and_set_them() -> None:
    with one_warning("SwapManager(prefetch_depth=...)", "use swap_prefetch_depth="):
        deep = SwapManager(prefetch_depth=3)
    with one_warning("SwapManager(offload_lag=...)", "use swap_offload_lag="):
        lagged = SwapManager(offload_lag=0)
    with no_warning():
        assert (deep.swap_prefetch_depth, deep.swap_offload_lag) == (3, 1)
        assert (lagged.swap_prefetch_depth, lagged.swap_offload_lag) == (1, 0)
    with pytest.raises(TypeError, match="offload_lag"):
        SwapManager(offload_lag=2, swap_offload_lag=2)


@pytest.mark.parametrize(("old", "new"), [("prefetch_depth", 3), ("offload_lag", 2)])
def test_the_managers_old_properties_warn_and_read_the_new_ones(old: str, new: int) -> None:
    manager = SwapManager(**{f"swap_{old}": new})
    with one_warning(f"SwapManager.{old} is deprecated: use SwapManager.swap_{old}"):
        assert getattr(manager, old) == new


def test_apply_swap_and_verify_swap_take_the_old_keywords_with_a_warning(
    tiny_model: Callable[..., torch.nn.Module],
) -> None:
    model = tiny_model(num_hidden_layers=2)
    with one_warning("apply_swap(prefetch_depth=...)", "use swap_prefetch_depth="):
        report = apply_swap(model, prefetch_depth=2, swap_offload_lag=2)
    assert report.manager.swap_prefetch_depth == 2 and report.manager.swap_offload_lag == 2
    with one_warning("verify_swap(prefetch_depth=...)", "use swap_prefetch_depth="):
        verify_swap(model, report, prefetch_depth=2)


def test_the_host_pools_old_names_warn_and_are_the_new_ones() -> None:
    with one_warning("graphswap.runtime.host_budget is deprecated", "default_max_host_bytes"):
        old = graphswap.runtime.host_budget
    assert old is default_max_host_bytes
    h200 = device_profile("h200")
    with one_warning("DeviceProfile.host_budget_bytes is deprecated", "default_max_host_bytes"):
        assert h200.host_budget_bytes == h200.default_max_host_bytes == 128 << 30
    stats = SwapManager(max_host_bytes=1 << 20).stats
    with one_warning("SwapStats.host_budget_bytes is deprecated", "SwapStats.max_host_bytes"):
        assert stats.host_budget_bytes == stats.max_host_bytes == 1 << 20
    assert "max_host_bytes" in stats.to_dict() and "host_budget_bytes" not in stats.to_dict()
    assert isinstance(stats, SwapStats)


def _toy_swapped(manager: SwapManager) -> torch.nn.Sequential:
    model = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3))
    )
    for i, block in enumerate(model):
        swap_wrapper(block, manager=manager, policy=size_threshold_policy(0), name=f"b{i}")
    for earlier, later in itertools.pairwise(model):
        manager.link(earlier, later)
    return model


def test_a_manager_pickled_with_the_old_option_keys_loads_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model saved before the rename: its manager's options say ``prefetch_depth`` and
    ``offload_lag``. It loads with the options it had; saved again, it loads silently."""
    model = _toy_swapped(SwapManager(swap_prefetch_depth=2, swap_offload_lag=0))
    new_state = SwapManager.__getstate__

    def old_state(manager: SwapManager) -> dict[str, Any]:
        state = new_state(manager)
        options = state["options"]
        options["prefetch_depth"] = options.pop("swap_prefetch_depth")
        options["offload_lag"] = options.pop("swap_offload_lag")
        return state

    monkeypatch.setattr(SwapManager, "__getstate__", old_state)
    saved = pickle.dumps(model)
    monkeypatch.undo()
    assert b"swap_prefetch_depth" not in saved
    with one_warning("pickled with its options' old names", "save the loaded model again"):
        loaded = pickle.loads(saved)
    manager = graphswap.runtime.swap_manager_of(loaded[0])
    assert manager is not None
    assert (manager.swap_prefetch_depth, manager.swap_offload_lag) == (2, 0)
    assert manager.links == [("b0", "b1"), ("b1", "b2")]
    with no_warning():
        again = pickle.loads(pickle.dumps(loaded))
    x = torch.randn(4, 8)
    again(x).sum().backward()  # it still trains


@pytest.fixture(scope="module")
def tiny_trace() -> Any:
    config = qwen3_moe_config("tiny", num_hidden_layers=2)
    shape = StepShape(seq_len=512, batch_size=2, dtype=torch.float32, device="cpu")
    return trace_step(build_meta_model(config, shape), device_profile("h200"))


def test_replays_old_keywords_warn_naming_the_schedule_and_replay_the_same(
    tiny_trace: Any,
) -> None:
    candidates = layer_candidates(tiny_trace.saved)
    choice = swap_choice(tiny_trace, [candidates[layer.name] for layer in tiny_trace.saved.layers])
    cap = 2 * max(c.nbytes for cs in candidates.values() for c in cs)
    with one_warning(
        "replay(offload_lag=..., prefetch_depth=..., host_budget=...) is deprecated",
        "SwapSchedule(swap_offload_lag=..., swap_prefetch_depth=..., max_host_bytes=...)",
    ):
        old = replay(tiny_trace, choice, offload_lag=2, prefetch_depth=1, host_budget=cap)
    with no_warning():
        new = replay(tiny_trace, choice, SwapSchedule(swap_offload_lag=2, max_host_bytes=cap))
    assert old == new and sum(g.refused_bytes for g in new.groups) > 0
    # host_budget=None was no cap at all: no pool reaches the one it stands for.
    with one_warning(
        "replay(offload_lag=..., prefetch_depth=..., state_shards=...)",
        "SwapSchedule(swap_offload_lag=..., swap_prefetch_depth=..., state_shards=...))",
        "host_budget unset was no cap",
    ):
        uncapped = replay(tiny_trace, choice, offload_lag=1, prefetch_depth=1, state_shards=2)
    roomy = SwapSchedule(state_shards=2, max_host_bytes=sys.maxsize)
    assert uncapped == replay(tiny_trace, choice, roomy)
    with pytest.raises(PlanSettingError) as caught:
        replay(tiny_trace, choice, SwapSchedule(), offload_lag=1)
    assert caught.value.setting == "schedule" and "not both" in caught.value.detail


def _tiny_fit_config() -> Any:
    config = preset_config("tiny-qwen3")
    config.num_hidden_layers = 1
    config.max_position_embeddings = 1024
    return config


def test_fit_sequences_flat_keywords_warn_naming_the_typed_call_and_fit_the_same() -> None:
    """``seq_step`` is the shape's ``seq_len`` now: the fit's first step."""
    config = _tiny_fit_config()
    with one_warning("fit_sequence(seq_step=..., device=..., state_shards=...)", "StepShape("):
        old = fit_sequence(
            config,
            memory_bytes=1 << 30,
            modes=("none",),
            seq_step=256,
            device="cpu",
            state_shards=2,
        )
    with no_warning():
        new = fit_sequence(
            config,
            StepShape(seq_len=256, device="cpu"),
            schedule=SwapSchedule(state_shards=2),
            memory_bytes=1 << 30,
            modes=("none",),
        )
    assert old.to_dict() == new.to_dict()
    assert (new.seq_step, new.state_shards, [p.seq_len for p in new.modes[0].points]) == (
        256,
        2,
        [256, 512, 768, 1024],
    )


def test_fit_sequence_refuses_flat_keywords_beside_a_shape_and_still_refuses_seq_len() -> None:
    config = _tiny_fit_config()
    with pytest.raises(PlanSettingError, match="not both") as caught:
        fit_sequence(config, StepShape(seq_len=256), state_shards=2)
    assert caught.value.setting == "shape"
    with pytest.raises(PlanSettingError) as caught:
        fit_sequence(config, seq_len=4096)
    assert caught.value.setting == "seq_len" and "what the fit searches" in caught.value.detail
    with pytest.raises(PlanSettingError) as caught:
        fit_sequence(config, seq_step=0)
    assert caught.value.setting == "seq_step"
