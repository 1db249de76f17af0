"""Byte sizes: `parse_bytes` reads a positive whole number of bytes or raises `InputError` (never a
bool, a truncated fraction or an `OverflowError`); `format_bytes` refuses what is not a finite number."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvchain.errors import BudgetError, InputError, KVChainError
from kvchain.units import format_bytes, parse_bytes, zeros


@pytest.mark.parametrize("text", [1.5, "1.9", "1e-3GiB", "0.3KiB ", "1.5b", 2.5e9 + 0.5])
def test_a_fractional_byte_count_is_refused_not_truncated(text):
    with pytest.raises(InputError, match="is not a whole number of bytes") as e:
        parse_bytes(text)
    assert repr(text) in str(e.value)


@pytest.mark.parametrize("text", [True, False, np.bool_(True), None, [1], b"1GiB"])
def test_what_is_not_a_size_is_refused(text):
    with pytest.raises(InputError, match="byte size") as e:
        parse_bytes(text)
    assert repr(text) in str(e.value)


@pytest.mark.parametrize("text", ["1e400", "1e400GiB", float("inf"), float("nan")])
def test_a_size_past_any_float_is_an_input_error(text):
    with pytest.raises(InputError) as e:
        parse_bytes(text)
    assert isinstance(e.value, KVChainError) and repr(text) in str(e.value)


@pytest.mark.parametrize(("text", "value"), [
    ("80GiB", 80 * 2**30), ("1.5GiB", 3 * 2**29), ("1.1GB", 1_100_000_000), ("1e9", 10**9), ("1.5e9", 1_500_000_000),
    ("0.001KB", 1), ("512", 512), (512, 512), (np.int64(512), 512), (2.0, 2), (np.float64(1024.0), 1024),
    (" 2 MiB ", 2 * 2**20), ("1PiB", 2**50),
])
def test_whole_sizes_still_parse(text, value):
    out = parse_bytes(text)
    assert out == value and type(out) is int


@pytest.mark.parametrize("text", [0, -1, "0.5", "0"])
def test_below_one_byte_is_still_refused(text):
    with pytest.raises(InputError, match="at least one byte"):
        parse_bytes(text)


@pytest.mark.parametrize("n", ["x", "1", None, True, float("nan"), float("inf"), -float("inf"), [1]])
def test_format_bytes_refuses_what_is_not_a_finite_number(n):
    with pytest.raises(InputError, match="format_bytes") as e:
        format_bytes(n)
    assert repr(n) in str(e.value)


def test_format_bytes_of_numbers_is_unchanged():
    assert format_bytes(80 * 2**30) == "80.00 GiB"
    assert format_bytes(np.int64(512)) == "512 B"
    assert format_bytes(1536.0) == "1.50 KiB"
    assert format_bytes(-2048) == "-2.00 KiB"
    assert format_bytes(2**60) == "1048576.00 TiB"


def test_an_allocation_past_what_an_int64_counts_is_a_budget_error():
    """A host budget of 10**30 bytes sized a host pool torch could not unpack (a TypeError from its
    C++ layer); what no device holds is refused before torch."""
    with pytest.raises(BudgetError, match=r"cannot allocate a pool: .* more bytes than any device holds"):
        zeros((10**30, 4), torch.uint8, what="a pool")
    assert zeros((2, 3), torch.float32, what="a pool").shape == (2, 3)
