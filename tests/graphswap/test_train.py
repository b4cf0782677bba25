import json

import pytest

from graphswap.config import TrainerConfig
from graphswap.train import format_summary, token_batches, train, write_summary

FAST = {"num_layers": 2, "seq_len": 256, "steps": 3}


@pytest.mark.parametrize(
    ("attn_implementation", "seq_len"),
    [("sdpa", 512), ("eager", 256)],
)
def test_swap_changes_no_loss_and_lowers_resident_activations(
    attn_implementation: str, seq_len: int
) -> None:
    # The shortest sequence at which each attention saves tensors of the 1 MiB swap threshold.
    run = {**FAST, "attn_implementation": attn_implementation, "seq_len": seq_len}
    none = train(TrainerConfig(**run), progress=False)
    swap = train(TrainerConfig(activation_swap="attention", **run), progress=False)
    assert swap.losses == none.losses
    offloaded = swap.swap["per_group"]["model.layers.0.self_attn"]["offloaded_bytes"] / 3
    assert offloaded > 0
    assert none.peak_memory_bytes - swap.peak_memory_bytes == pytest.approx(offloaded, rel=0.01)
    assert swap.applied_passes == ["swap"] and none.applied_passes == []


def test_summary_is_side_by_side_and_written(tmp_path) -> None:
    results = [train(TrainerConfig(**{**FAST, "steps": 1}), progress=False)]
    text = format_summary(results)
    assert "loss first" in text and "tokens/s" in text
    path = write_summary(results, str(tmp_path / "out"))
    assert json.loads(path.read_text())[0]["activation_swap"] == "none"


def test_text_data_is_read_byte_level(tmp_path) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text("graphswap " * 100)
    batch = next(token_batches(TrainerConfig(data=str(data), seq_len=16), 512, "cpu"))
    assert batch.shape == (2, 16)
    assert set(batch.flatten().tolist()) <= set(b"graphswap ")


def test_missing_or_short_data_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="data"):
        next(token_batches(TrainerConfig(data=str(tmp_path / "nope.txt")), 512, "cpu"))
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ValueError, match="seq_len"):
        next(token_batches(TrainerConfig(data=str(short), seq_len=16), 512, "cpu"))
