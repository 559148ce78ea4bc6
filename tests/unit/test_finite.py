"""The NaN/Inf check read from IEEE bits: every non-finite pattern caught, no finite one flagged."""

import pytest
import torch

from speculators_v016.checks import finite
from speculators_v016.checks.finite import all_finite, non_finite

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn])
def test_every_bit_pattern_of_small_floats_agrees_with_isfinite(dtype):
    """All 2^8 / 2^16 bit patterns, one element each: the bit test equals torch.isfinite."""
    width = torch.empty((), dtype=dtype).element_size() * 8
    ints = {8: torch.int8, 16: torch.int16}[width]
    patterns = torch.arange(-(1 << (width - 1)), 1 << (width - 1), dtype=torch.int32).to(ints).view(dtype)
    expected = (
        torch.isfinite(patterns.float())
        if dtype in (torch.float8_e5m2, torch.float8_e4m3fn)
        else torch.isfinite(patterns)
    )
    got = torch.tensor([all_finite(patterns[i : i + 1]) for i in range(patterns.numel())])
    assert torch.equal(got, expected)
    assert not expected.all() and expected.any()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_is_found_at_any_position(dtype, bad, monkeypatch):
    """One NaN/Inf anywhere (first, last, slice edges) in a finite tensor fails it; the tensor alone passes."""
    monkeypatch.setattr(finite, "SLICE", 7)  # many slices, with a short last one
    clean = (torch.linspace(-3, 3, 40).reshape(8, 5)).to(dtype)
    assert all_finite(clean)
    for position in range(clean.numel()):
        dirty = clean.clone()
        dirty.view(-1)[position] = bad  # e4m3fn has no infinity: inf becomes NaN, still caught
        assert not all_finite(dirty), (dtype, bad, position)


@pytest.mark.parametrize("dtype", FLOATS)
def test_extreme_finite_values_pass(dtype):
    """The largest and smallest normal and subnormal values, and -0.0, are finite."""
    info = torch.finfo(dtype)
    values = torch.tensor(
        [info.max, -info.max, info.tiny, -info.tiny, info.smallest_normal, 0.0, -0.0], dtype=torch.float64
    ).to(dtype)
    assert all_finite(values)
    assert all_finite(values[::2])  # a strided view is checked too


def test_random_bits_of_wide_floats_agree_with_isfinite():
    """fp32 / fp64 tensors of random bits (some NaN/Inf exponents): same answer as torch.isfinite."""
    gen = torch.Generator().manual_seed(0)
    for dtype, ints in ((torch.float32, torch.int32), (torch.float64, torch.int64)):
        for _ in range(200):
            bits = torch.randint(-(2**31), 2**31 - 1, (3,), generator=gen, dtype=torch.int64).to(ints)
            values = bits.view(dtype)
            assert all_finite(values) == bool(torch.isfinite(values).all())


def test_non_finite_names_the_bad_tensors():
    """Positions of the tensors holding NaN or Inf; integer tensors are always finite."""
    good, bad = torch.zeros(4, 3, dtype=torch.bfloat16), torch.zeros(4, 3, dtype=torch.bfloat16)
    bad[3, 2] = float("nan")
    assert non_finite([good, bad, torch.arange(5), good]) == [1]
    assert non_finite([]) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn])
def test_raw_bytes_of_every_bit_pattern_agree_with_the_tensor_check(dtype):
    """bytes_finite on one element's raw bytes says what all_finite says of that element, for every pattern."""
    width = torch.empty((), dtype=dtype).element_size() * 8
    ints = {8: torch.int8, 16: torch.int16}[width]
    patterns = torch.arange(-(1 << (width - 1)), 1 << (width - 1), dtype=torch.int32).to(ints).view(dtype)
    raw = memoryview(patterns.view(torch.uint8).numpy())
    size = width // 8
    got = [finite.bytes_finite(raw[i * size : (i + 1) * size], dtype) for i in range(patterns.numel())]
    assert got == [all_finite(patterns[i : i + 1]) for i in range(patterns.numel())]
    assert finite.bytes_finite(raw[:0], dtype)  # an empty chunk holds nothing bad


@pytest.mark.parametrize("dtype", FLOATS)
def test_raw_bytes_with_one_non_finite_value_anywhere_fail(dtype):
    """One NaN at any position of a buffer of raw bytes fails bytes_finite; the clean buffer passes."""
    clean = torch.linspace(-3, 3, 40).to(dtype)
    assert finite.bytes_finite(memoryview(clean.view(torch.uint8).numpy()), dtype)
    for position in range(clean.numel()):
        dirty = clean.clone()
        dirty[position] = float("nan")
        assert not finite.bytes_finite(memoryview(dirty.view(torch.uint8).numpy()), dtype), (dtype, position)


def test_raw_bytes_of_a_float_type_without_a_bit_test_are_still_checked(monkeypatch):
    """A float type missing from the bit table gets torch.isfinite on its bytes, never no check."""
    monkeypatch.delitem(finite._TESTS, torch.float32)
    values = torch.linspace(-3, 3, 40)
    assert finite.bytes_finite(memoryview(values.view(torch.uint8).numpy()), torch.float32)
    values[17] = float("inf")
    assert not finite.bytes_finite(memoryview(values.view(torch.uint8).numpy()), torch.float32)
