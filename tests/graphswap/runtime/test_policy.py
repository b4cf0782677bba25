import pytest
import torch

from graphswap.runtime.policy import (
    MIN_SWAP_TENSOR_BYTES,
    CheckpointPolicy,
    policy_name,
    size_threshold_policy,
    swap_large_activations,
)

SWAP, SAVE = CheckpointPolicy.MUST_SWAP, CheckpointPolicy.MUST_SAVE


def grad_tensor(nbytes: int) -> torch.Tensor:
    assert nbytes % 4 == 0
    return torch.zeros(nbytes // 4 // 2, 2, requires_grad=True) * 1.0


def test_threshold_is_one_mebibyte() -> None:
    assert MIN_SWAP_TENSOR_BYTES == 1024 * 1024


def test_exactly_threshold_swaps() -> None:
    assert swap_large_activations(grad_tensor(MIN_SWAP_TENSOR_BYTES)) is SWAP


def test_one_byte_below_threshold_is_saved() -> None:
    one_byte_dtype = torch.float8_e4m3fn
    below = torch.zeros(1, MIN_SWAP_TENSOR_BYTES - 1, dtype=one_byte_dtype).requires_grad_()
    at = torch.zeros(1, MIN_SWAP_TENSOR_BYTES, dtype=one_byte_dtype).requires_grad_()
    assert swap_large_activations(below) is SAVE
    assert swap_large_activations(at) is SWAP


def test_view_of_larger_tensor_is_saved() -> None:
    big = grad_tensor(4 * MIN_SWAP_TENSOR_BYTES)
    half = big[: big.shape[0] // 2]
    assert half.numel() * 4 >= MIN_SWAP_TENSOR_BYTES
    assert swap_large_activations(half) is SAVE


def test_full_view_of_owned_storage_swaps() -> None:
    """A transpose covers its whole storage: moving it frees all of it."""
    t = grad_tensor(2 * MIN_SWAP_TENSOR_BYTES)
    assert swap_large_activations(t.t()) is SWAP


def test_no_grad_is_saved() -> None:
    assert swap_large_activations(torch.zeros(1024, 1024)) is SAVE


def test_one_dimensional_is_saved() -> None:
    t = torch.zeros(4 * MIN_SWAP_TENSOR_BYTES // 4, requires_grad=True) * 1.0
    assert swap_large_activations(t) is SAVE


def test_parameter_and_its_transpose_are_saved() -> None:
    p = torch.nn.Parameter(torch.zeros(1024, 1024))
    assert swap_large_activations(p) is SAVE
    assert swap_large_activations(p.t()) is SAVE


def test_factory_threshold_and_name() -> None:
    policy = size_threshold_policy(4096)
    assert policy(grad_tensor(4096)) is SWAP
    assert policy(grad_tensor(4092)) is SAVE
    assert policy_name(policy) == "size_threshold_policy(4096)"
    assert policy_name(swap_large_activations) == "swap_large_activations"


def test_factory_rejects_negative_threshold() -> None:
    with pytest.raises(ValueError, match="min_bytes"):
        size_threshold_policy(-1)


@pytest.mark.parametrize("value", ["1MiB", 1.5, True, None])
def test_factory_says_what_the_threshold_takes(value: object) -> None:
    with pytest.raises(TypeError) as info:
        size_threshold_policy(value)  # type: ignore[arg-type]
    assert str(info.value) == (
        "min_bytes must be an int number of bytes (e.g. 1 << 20 for 1 MiB),"
        f" got {type(value).__name__} {value!r}"
    )
