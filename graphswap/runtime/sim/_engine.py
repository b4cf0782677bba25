"""The copy engine over the simulated device: the engine a GPU runs, with every ordering
hazard checked and, given a device profile, a clock (invariants I11 and I13)."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from graphswap.errors import SwapSetupError
from graphswap.runtime._device import Device
from graphswap.runtime._engines import AcceleratorCopyEngine, CopyEngine
from graphswap.runtime.profile import DeviceProfile, device_profile
from graphswap.runtime.sim._device import Clock, SimDevice, SimStream
from graphswap.runtime.timeline import step_labels

__all__ = ["SimulatedAccelerator"]


class SimulatedAccelerator(AcceleratorCopyEngine):
    """The accelerator engine over a simulated device on CPU tensors.

    ``lag``: a copy completes when the device reaches it, ``lag`` ticks (module
    boundaries) after it was issued (0: at once), in issue order per stream and after
    what it waits for, or earlier when a compute stream waits for it. Sources are held
    until the manager releases them. Every ordering hazard raises ``HazardError``: a
    source released before the stream that allocated it waited for its copy (or the
    host saw it completed), a reload read before the reading stream waited for it, a
    copy that reads bytes its stream has not waited for (a tensor written on another
    stream, a host buffer before its offload filled it), a host buffer rewritten while
    a reload still reads it, and any copy, query or wait while ``capture()`` is active.

    User code makes streams with ``stream()`` and runs on one under ``with stream:``,
    as it would with ``torch.Stream``; ``current_stream()`` is the one it runs on.

    ``profile``: a device profile (a preset name such as ``"h200"``, with figures
    optionally replaced, or a ``DeviceProfile``); with one, ``clock()`` measures a step.
    """

    pin = False

    def __init__(self, lag: int = 0, profile: str | DeviceProfile | None = None) -> None:
        if not isinstance(lag, int) or isinstance(lag, bool) or lag < 0:
            raise SwapSetupError(f"lag must be an int >= 0, got {lag!r}")
        super().__init__()
        self.lag = lag
        """Module boundaries a copy trails the host by."""
        self.profile = None if profile is None else device_profile(profile)
        """What the clock costs work with (None: no clock)."""
        self._sim = SimDevice(lag, self.profile)
        """The one simulated device, whatever ``torch.device`` its tensors name."""

    def __repr__(self) -> str:
        if self.profile is None:
            return f"SimulatedAccelerator(lag={self.lag})"
        return f"SimulatedAccelerator(lag={self.lag}, profile={self.profile.name!r})"

    def __reduce__(self) -> tuple[type, tuple[int, DeviceProfile | None]]:  # type: ignore[override]
        """A copy is a fresh device with the same lag and profile, nothing in flight."""
        return SimulatedAccelerator, (self.lag, self.profile)

    def _open(self, device: torch.device) -> Device[Any, Any]:
        return self._sim

    def tick(self) -> None:
        super().tick()
        self._sim.tick()

    def capturing(self) -> bool:
        return self._sim.is_capturing()

    boundary = CopyEngine.boundary  # its own ``capturing`` and ``tick``

    @property
    def calls(self) -> collections.Counter[tuple[str, str]]:
        """Accelerator calls made so far, by (kind, what they serve): what a GPU would be
        asked, counted (``SimDevice.calls`` lists the kinds)."""
        return self._sim.calls

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Behave as if the current stream captured a graph."""
        with self._sim.capture():
            yield

    def stream(self) -> SimStream:
        """A new stream for user code (``torch.Stream()`` on a GPU)."""
        return self._sim.compute_stream()

    def current_stream(self) -> SimStream:
        """The stream operators run on now (``torch.accelerator.current_stream()``)."""
        return self._sim.current

    @contextlib.contextmanager
    def clock(
        self, layers: Sequence[torch.nn.Module] = (), *, base_bytes: int = 0
    ) -> Iterator[Clock]:
        """Measure one step run inside: ``clock.timeline`` is filled when it ends.

        ``layers``: the decoder layers, in forward order, that label the timeline
        (``F<i>``, ``B<i>``); ``base_bytes``: device memory already held when the step
        begins (parameters, gradients, optimizer state), counted in every figure of
        memory. ``clock.label("optimizer")`` names what runs next.
        """
        if self.profile is None:
            raise SwapSetupError(
                "SimulatedAccelerator(profile=None) keeps no clock; pass a device profile,"
                " e.g. SimulatedAccelerator(profile='h200') or a DeviceProfile"
            )
        if not isinstance(base_bytes, int) or isinstance(base_bytes, bool) or base_bytes < 0:
            raise SwapSetupError(f"base_bytes must be an int >= 0, got {base_bytes!r}")
        clock = self._sim.start_clock(base_bytes)
        try:
            with clock.tape, step_labels(layers, clock.tape):
                yield clock
        finally:
            self._sim.stop_clock()
