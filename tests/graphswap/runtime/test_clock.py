"""The simulated accelerator's clock (``clock_contract.md``): a step of the real runtime
timed and its memory tracked on a device profile, against figures worked out by hand."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from graphswap import CheckpointPolicy, SwapManager, swap_wrapper
from graphswap.runtime.profile import DeviceProfile, ProfileError
from graphswap.runtime.sim import SimulatedAccelerator
from graphswap.runtime.timeline import OpTape, StepTimeline

ROWS, WIDTH, WIDEN, LAYERS = 512, 16, 2, 4
WIDE_BYTES = ROWS * WIDTH * WIDEN * 4
"""The one tensor each block saves and the swap moves."""
OUT_BYTES = ROWS * WIDTH * 4
"""A block's output (and its input)."""
WEIGHT_BYTES = WIDTH * WIDEN * WIDTH * 4


class Block(torch.nn.Module):
    """``x + widen(x) @ W``: the widened copy is saved for W's gradient but needs none
    itself, so backward allocates little and the step's peak falls at the end of forward."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(WIDTH * WIDEN, WIDTH) / WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.detach().repeat(1, WIDEN)
        return x + wide @ self.weight


def swap_wide(t: torch.Tensor) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SWAP if t.nbytes >= WIDE_BYTES else CheckpointPolicy.MUST_SAVE


def toy_profile(d2h_gbps: float) -> DeviceProfile:
    """Slow enough that a block's matmul is compute-bound; reloads always fit."""
    return DeviceProfile(
        "toy", d2h_gbps=d2h_gbps, h2d_gbps=100.0, tflops=0.01, hbm_gbps=100.0, memory_bytes=10**9
    )


def forward_window(profile: DeviceProfile) -> float:
    """What runs on compute between a block's offload (issued when its matmul saves the
    wide tensor, before the matmul runs) and the next block's start: the matmul and the
    add."""
    flops = 2 * ROWS * WIDTH * WIDEN * WIDTH
    matmul = max(
        flops / (profile.tflops * 1e12),
        (WIDE_BYTES + WEIGHT_BYTES + OUT_BYTES) / (profile.hbm_gbps * 1e9),
    )
    add = 3 * OUT_BYTES / (profile.hbm_gbps * 1e9)
    return matmul + add


def build(engine: SimulatedAccelerator | None) -> tuple[list[Block], torch.Tensor, Any]:
    """A chain of ``LAYERS`` blocks and its input; with ``engine``, swapped and linked (the
    last block kept, ``swap_offload_lag=1``) by the manager returned beside them."""
    torch.manual_seed(0)
    blocks = [Block() for _ in range(LAYERS)]
    manager = None
    if engine is not None:
        manager = SwapManager(engine=engine, swap_offload_lag=1)
        wrapped = [
            swap_wrapper(b, manager=manager, policy=swap_wide, name=f"block{i}")
            for i, b in enumerate(blocks)
        ]
        for earlier, later in itertools.pairwise(wrapped):
            manager.link(earlier, later)
    return blocks, torch.randn(ROWS, WIDTH, requires_grad=True), manager


def step(blocks: list[Block], x: torch.Tensor) -> torch.Tensor:
    """Forward and backward; nothing but autograd holds the output."""
    h = x
    for block in blocks:
        h = block(h)
    loss = h.sum()
    del h
    loss.backward()
    return loss.detach()


def run(
    engine: SimulatedAccelerator, *, swap: bool
) -> tuple[torch.Tensor, list[torch.Tensor], Any, Any]:
    """One clocked step on ``engine``, swapped or not: loss, gradients, manager, clock."""
    blocks, x, manager = build(engine if swap else None)
    base = x.nbytes + LAYERS * WEIGHT_BYTES
    with engine.clock(blocks, base_bytes=base) as clock:
        loss = step(blocks, x)
    grads = [x.grad, *(b.weight.grad for b in blocks)]
    return loss, grads, manager, clock


def timeline(profile: DeviceProfile, *, swap: bool) -> StepTimeline:
    return run(SimulatedAccelerator(profile=profile), swap=swap)[3].timeline


def test_an_offload_longer_than_the_forward_window_stalls_forward_by_the_difference() -> None:
    profile = toy_profile(d2h_gbps=1.0)
    copy = WIDE_BYTES / 1e9
    stall = copy - forward_window(profile)
    assert stall > 0, "the case needs a copy longer than its window"
    plain = timeline(profile, swap=False)
    swapped = timeline(profile, swap=True)
    # Blocks 0..2 are offloaded; each is fenced when the next block begins.
    assert swapped.stalls == {f"F{i}": pytest.approx(stall, rel=1e-9) for i in range(1, LAYERS)}
    assert swapped.d2h_seconds == pytest.approx((LAYERS - 1) * copy, rel=1e-9)
    assert swapped.compute_seconds == plain.compute_seconds
    assert swapped.step_seconds == pytest.approx(
        plain.step_seconds + (LAYERS - 1) * stall, rel=1e-9
    )


def test_an_offload_that_fits_its_forward_window_costs_nothing() -> None:
    profile = toy_profile(d2h_gbps=10.0)
    assert forward_window(profile) > WIDE_BYTES / 1e10, "the case needs a copy that fits"
    plain = timeline(profile, swap=False)
    swapped = timeline(profile, swap=True)
    assert swapped.stalls == {}
    assert swapped.d2h_seconds > 0 and swapped.h2d_seconds > 0
    assert swapped.step_seconds == plain.step_seconds == plain.compute_seconds


class Recorder:
    """A tape listener that only adds up the operators' times."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def on_op(self, func: Any, seconds: float) -> None:
        self.seconds += seconds

    def on_alloc(self, key: int, nbytes: int) -> None:
        pass

    def on_free(self, key: int, nbytes: int) -> None:
        pass


def test_compute_is_the_sum_of_the_operators_roofline_times_with_or_without_swap() -> None:
    profile = toy_profile(d2h_gbps=1.0)
    recorder = Recorder()
    blocks, x, _ = build(None)
    with OpTape("cpu", profile, recorder):
        step(blocks, x)
    assert recorder.seconds > 0
    assert timeline(profile, swap=False).compute_seconds == recorder.seconds
    assert timeline(profile, swap=True).compute_seconds == recorder.seconds


def test_the_peak_is_the_peak_without_swap_less_what_swap_freed() -> None:
    """Without swap, the last block's add holds every block's wide tensor, its input, the
    matmul's output and its own output. With swap, every block but the kept last one has
    left device memory by then (``swap_offload_lag=1``: block i's at block i + 1's start)."""
    profile = toy_profile(d2h_gbps=1.0)
    base = ROWS * WIDTH * 4 + LAYERS * WEIGHT_BYTES
    plain = timeline(profile, swap=False)
    swapped = timeline(profile, swap=True)
    assert plain.base_bytes == swapped.base_bytes == base
    assert plain.peak_bytes == base + LAYERS * WIDE_BYTES + 3 * OUT_BYTES
    assert plain.peak_label == f"F{LAYERS - 1}"
    assert swapped.peak_bytes == plain.peak_bytes - (LAYERS - 1) * WIDE_BYTES
    assert swapped.peak_label.startswith("F")
    assert max(b for _, b in swapped.memory) == swapped.peak_bytes


def test_losses_and_gradients_are_bitwise_equal_with_and_without_swap_on_the_clock() -> None:
    profile = toy_profile(d2h_gbps=1.0)
    loss, grads, _, _ = run(SimulatedAccelerator(profile=profile), swap=False)
    swapped_loss, swapped_grads, manager, _ = run(
        SimulatedAccelerator(lag=2, profile=profile), swap=True
    )
    assert manager is not None
    stats = manager.stats
    assert stats.offloaded_bytes == stats.reloaded_bytes == (LAYERS - 1) * WIDE_BYTES
    assert stats.prefetch_misses == 0
    assert torch.equal(swapped_loss, loss)
    for got, expected in zip(swapped_grads, grads, strict=True):
        assert torch.equal(got, expected)


def test_a_clocked_step_is_deterministic() -> None:
    profile = toy_profile(d2h_gbps=1.0)
    first = timeline(profile, swap=True)
    second = timeline(profile, swap=True)
    assert first == second
    assert first.memory == second.memory


def test_the_host_sees_a_copy_done_once_compute_reached_its_end() -> None:
    """1 MB over a 1 GB/s link ends at 1 ms; each ``a + a`` moves 600 kB through 1 GB/s
    of device memory, 0.6 ms of compute."""
    profile = DeviceProfile(
        "slow", d2h_gbps=1.0, h2d_gbps=1.0, tflops=1.0, hbm_gbps=1.0, memory_bytes=10**9
    )
    engine = SimulatedAccelerator(profile=profile)
    src, host, a = torch.ones(250_000), torch.empty(250_000), torch.ones(50_000)
    with engine.clock() as clock:
        offload = engine.offload(src, host, ())
        assert not offload.done()
        a + a
        assert not offload.done()
        a + a
        assert offload.done()
        offload.release_source()
    assert clock.timeline.d2h_seconds == pytest.approx(1e-3)
    assert clock.timeline.compute_seconds == pytest.approx(1.2e-3)
    assert clock.timeline.stalls == {}
    with engine.clock() as clock:
        offload = engine.offload(src, host, ())
        a + a
        offload.fence()
        clock.label("optimizer")
        a + a
    assert clock.timeline.stalls == {"embed": pytest.approx(0.4e-3)}
    assert clock.timeline.step_seconds == pytest.approx(1.6e-3)
    assert torch.equal(host, src)


@pytest.mark.parametrize(
    ("profile", "match"),
    [
        ("h300", r"unknown device profile 'h300'; presets: h100, h200"),
        ("h200,link_gbps=0", r"d2h_gbps must be a finite number > 0, got 0"),
        ("h200,tflops=-1", r"tflops must be a finite number > 0, got -1"),
        ("h200,hbm_gbps=fast", r"hbm_gbps must be a number, got 'fast'"),
        ("h200,pcie=5", r"unknown device profile figure 'pcie'; figures: link_gbps"),
        (42, r"a preset name or a DeviceProfile, got 42"),
    ],
)
def test_a_bad_profile_is_refused_naming_key_value_and_choices(profile: Any, match: str) -> None:
    with pytest.raises(ProfileError, match=match):
        SimulatedAccelerator(profile=profile)


def test_a_clock_needs_a_profile_and_a_sane_base() -> None:
    with pytest.raises(ValueError, match=r"profile=None\) keeps no clock.*profile='h200'"):
        SimulatedAccelerator().clock().__enter__()
    with pytest.raises(ValueError, match="base_bytes must be an int >= 0"):
        SimulatedAccelerator(profile="h200").clock(base_bytes=-1).__enter__()
