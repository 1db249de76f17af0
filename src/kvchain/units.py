"""Byte sizes and dtypes as users write them: `80GiB`, `512MiB`, `1.5e9`, `bfloat16`."""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction

import numpy as np
import torch

from .errors import BudgetError, InputError

_SUFFIX = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "p": 10**15,
    "pb": 10**15,
    "pib": 2**50,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def is_integer(value: object) -> bool:
    """A Python or numpy integer, never a bool (nor a float, even a whole one, nor a string): what
    every count, size and id kvchain takes must be."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_finite_number(value: object) -> bool:
    """A Python or numpy real number, never a bool, a NaN, an infinity or an integer past a float's
    range: what every rate, time and temperature kvchain takes must be."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def parse_bytes(text: str | int | float) -> int:
    """`80GiB` -> 85899345920, `1.5GiB` -> 1610612736. Raises InputError on anything that is not a
    positive whole number of bytes: a bool, a fraction of a byte (`1.5`, `'1e-3GiB'`: refused, not
    truncated), a size past any float (`'1e400'`)."""
    if isinstance(text, (bool, np.bool_)):
        raise InputError(f"not a byte size: {text!r} (try 80GiB, 512MiB or a number of bytes)")
    if isinstance(text, (int, np.integer)):
        value: Fraction | int = int(text)
    elif isinstance(text, (float, np.floating)):
        if not math.isfinite(text):
            raise InputError(f"not a finite byte size: {text!r}")
        value = Fraction(float(text))
    else:
        match = _SIZE.match(str(text))
        if not match or match.group(2).lower() not in _SUFFIX:
            raise InputError(f"not a byte size: {text!r} (try 80GiB, 512MiB or a number of bytes)")
        if not math.isfinite(float(match.group(1))):
            raise InputError(f"not a finite byte size: {text!r}")
        value = Fraction(match.group(1)) * _SUFFIX[match.group(2).lower()]  # exact: '1.1GB' is 1,100,000,000
    if value < 1:
        raise InputError(f"a byte size must be at least one byte, got {text!r}")
    if value.denominator != 1:
        raise InputError(f"{text!r} is not a whole number of bytes ({float(value):,} bytes)")
    return int(value)


def format_bytes(n: int | float) -> str:
    """Human bytes with binary units: 85899345920 -> '80.00 GiB'. Raises InputError for what is not
    a finite number (a string, a bool, NaN or an infinity)."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Real) or not math.isfinite(n):
        raise InputError(f"format_bytes takes a finite number of bytes, got {n!r}")
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
#: the dtype names KV can be stored in (`dtype_name` takes the aliases below too)
DTYPE_NAMES: tuple[str, ...] = tuple(_DTYPES)
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
            "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def count_of(n: int, noun: str) -> str:
    """`n` and its noun, singular for one: "1 token", "2,048 tokens"."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical dtype name ('bfloat16') for a name, an alias or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        for name, value in _DTYPES.items():
            if value == dtype:
                return name
        raise InputError(f"unsupported KV dtype {dtype}")
    name = str(dtype).lower().removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in _DTYPES:
        raise InputError(f"unsupported KV dtype {dtype!r} (use one of {', '.join(_DTYPES)})")
    return name


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return _DTYPES[dtype_name(dtype)]


def dtype_size(dtype: str | torch.dtype) -> int:
    return torch_dtype(dtype).itemsize


def zeros(shape: int | tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu", *,
          what: str, pin_memory: bool = False) -> torch.Tensor:
    """`torch.zeros`, with an allocation the device cannot make refused as one `BudgetError`
    naming `what` and its bytes (a budget larger than the machine's memory is bad input; one past
    what an int64 counts is refused before torch, which would fail to unpack it)."""
    dims = shape if isinstance(shape, tuple) else (shape,)
    n = 1
    for d in dims:
        n *= d
    if n * dtype.itemsize >= 2**63:
        raise BudgetError(f"cannot allocate {what}: {format_bytes(n * dtype.itemsize)} on {device}: "
                          "more bytes than any device holds")
    try:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    except (RuntimeError, MemoryError) as e:  # torch's OutOfMemoryError is a RuntimeError too
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BudgetError(f"cannot allocate {what}: {format_bytes(n * dtype.itemsize)} on {device}: {first}") from None
