"""The runtime's tests: a toy transformer whose attentions they swap, on one thread.

The manager sees only the tensors a wrapped module saves, so a few ``Linear`` layers
saving what an attention saves show every runtime behaviour in a fraction of a Hugging
Face model's time; a few tests keep the tiny Qwen3-MoE to prove the model path.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from graphswap import SwapManager, swap_wrapper
from graphswap.runtime import CopyEngine, NoOpAccelerator
from graphswap.runtime._engines import Copy
from graphswap.runtime.policy import SwapPolicy, swap_large_activations

VOCAB, WIDTH, HEADS = 512, 32, 4
"""The tiny Qwen3-MoE's vocabulary, so that both models take the same ids. At batch 2
and seq 256 a layer's attention saves 2 MiB of probabilities, above the 1 MiB of
``swap_large_activations``, and its input, queries, keys and values at 64 KiB each,
below it."""


class ToyAttention(torch.nn.Module):
    """Saves what an eager attention saves: its input (by the three projections), its
    per-head queries, keys and values (as the batched matmuls copy them), the ``seq x
    seq`` probabilities (by softmax and by the matmul with values; it also returns them,
    as ``output_attentions=True`` does) and the input of its output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, HEADS, WIDTH // HEADS).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        probs = (q @ k.transpose(-2, -1) / math.sqrt(WIDTH // HEADS)).softmax(-1)
        out = (probs @ v).transpose(1, 2).reshape(batch, seq, WIDTH)
        return self.o_proj(out), probs


class ToyLayer(torch.nn.Module):
    """An attention (the module tests wrap) and an unwrapped tanh MLP after it; like a
    decoder layer it drops the attention's probabilities unless asked for them."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = ToyAttention()
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Tanh(), torch.nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(
        self, x: torch.Tensor, output_attentions: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attended, probs = self.attn(x)
        h = x + attended
        return h + self.mlp(h), probs if output_attentions else None


@dataclass
class ToyOutput:
    """What a causal LM returns, by the names of Hugging Face's outputs."""

    logits: torch.Tensor
    loss: torch.Tensor | None
    attentions: list[torch.Tensor] | None


class ToyModel(torch.nn.Module):
    """Embedding, ``layers`` toy layers, a head and a cross-entropy loss."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(ToyLayer() for _ in range(layers))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> ToyOutput:
        h = self.embed(input_ids)
        attentions: list[torch.Tensor] = []
        for layer in self.layers:
            h, probs = layer(h, output_attentions)
            if probs is not None:
                attentions.append(probs)
        logits = self.head(h)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return ToyOutput(logits, loss, attentions if output_attentions else None)

    def swap_attention(
        self, manager: SwapManager, policy: SwapPolicy | Sequence[SwapPolicy]
    ) -> None:
        """Wrap every attention as ``layers.{i}.attn`` with ``policy`` (or the layer's
        own), linked in order, as the ``qwen3_attn_swap`` rule does for a real model."""
        policies = [policy] * len(self.layers) if callable(policy) else list(policy)
        attns = [
            swap_wrapper(layer.attn, manager=manager, name=f"layers.{i}.attn", policy=p)
            for i, (layer, p) in enumerate(zip(self.layers, policies, strict=True))
        ]
        for earlier, later in itertools.pairwise(attns):
            manager.link(earlier, later)


class _Read(Copy):
    """A reload handed to the manager: its unpack's read is recorded."""

    __slots__ = ("engine", "host", "inner")

    def __init__(self, engine: RecordingEngine, inner: Copy, host: torch.Tensor) -> None:
        self.engine = engine
        self.inner = inner
        self.host = host

    def done(self) -> bool:
        return self.inner.done()

    def fence(self) -> None:
        self.inner.fence()

    def synchronize(self) -> None:
        self.inner.synchronize()

    def release_source(self) -> weakref.ref[torch.UntypedStorage] | None:
        return self.inner.release_source()

    def result(self) -> torch.Tensor:
        return self.inner.result()

    def fenced_result(self) -> torch.Tensor:
        self.engine.calls.append(("read", self.host))
        return self.inner.fenced_result()


def _inner(copies: Sequence[Copy]) -> list[Copy]:
    return [copy.inner if type(copy) is _Read else copy for copy in copies]


class RecordingEngine(CopyEngine):
    """A copy engine that records, in order, what the manager asks of it and passes each
    call on to the engine it wraps (default: the no-op device, CPU's own): the public
    seam through which tests see the order of the runtime's copies, not its methods.

    ``calls``: ``("offload", host)``, ``("reload", host)`` per reload of a batch,
    ``("read", host)`` when an unpack reads its reload, ``("boundary", None)``,
    ``("host_buffer", nbytes)`` and ``("free_host_buffer", host)``; ``host`` is the host
    copy of one storage (one object per storage and step)."""

    def __init__(self, inner: CopyEngine | None = None) -> None:
        self.inner = NoOpAccelerator() if inner is None else inner
        self.pin = self.inner.pin
        self.calls: list[tuple[str, object]] = []

    def offload(self, src: torch.Tensor, host: torch.Tensor, after: Sequence[Copy]) -> Copy:
        self.calls.append(("offload", host))
        return self.inner.offload(src, host, _inner(after))

    def reloads(
        self, device: torch.device, items: Sequence[tuple[torch.Tensor, Sequence[Copy]]]
    ) -> list[Copy]:
        copies = self.inner.reloads(device, [(host, _inner(after)) for host, after in items])
        self.calls.extend(("reload", host) for host, _ in items)
        return [_Read(self, copy, host) for copy, (host, _) in zip(copies, items, strict=True)]

    def host_buffer(self, device: torch.device, nbytes: int) -> torch.Tensor:
        self.calls.append(("host_buffer", nbytes))
        return self.inner.host_buffer(device, nbytes)

    def free_host_buffer(self, device: torch.device, host: torch.Tensor) -> None:
        self.calls.append(("free_host_buffer", host))
        self.inner.free_host_buffer(device, host)

    def tick(self) -> None:
        self.inner.tick()

    def capturing(self) -> bool:
        return self.inner.capturing()

    def boundary(self) -> bool:
        self.calls.append(("boundary", None))
        return self.inner.boundary()


@pytest.fixture
def recording_engine() -> type[RecordingEngine]:
    """``RecordingEngine``, for tests to make one (over another engine if they pass it)."""
    return RecordingEngine


@pytest.fixture
def toy_model() -> Callable[..., ToyModel]:
    """Factory: a seeded ``ToyModel`` of ``layers`` layers (4, as the tiny Qwen3-MoE);
    given a manager, its attentions are swap-wrapped with ``policy`` and linked."""

    def make(
        seed: int = 0,
        *,
        layers: int = 4,
        manager: SwapManager | None = None,
        policy: SwapPolicy | Sequence[SwapPolicy] = swap_large_activations,
    ) -> ToyModel:
        torch.manual_seed(seed)
        model = ToyModel(layers)
        if manager is not None:
            model.swap_attention(manager, policy)
        return model

    return make


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every runtime test on one thread: its tensors are too small for more, and on a
    loaded machine two threads make their steps several times slower."""
