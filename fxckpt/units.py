"""Quantities in options and environment variables: bytes (``"12GiB"``), bandwidths
(``"25GB/s"``) and durations (``"50us"``), parsed exactly, with an :class:`OptionsError` that
names the option on bad input. Imports no torch."""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction
from typing import Any

from fxckpt.errors import OptionsError

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_UNIT_NAMES = "B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)"
# The exponent is bounded so that "1e999999999" cannot make Fraction build a huge integer.
_QUANTITY = re.compile(r"([+-]?)(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d{1,2}))?\s*([A-Za-z]*)")
_BYTES_ACCEPTED = 'an int number of bytes or a string such as "12GiB", "800MB"'


def _quantity(text: str) -> tuple[Fraction, str]:
    """Parse ``"1.5 GiB"`` into (exact number of bytes, unit as written); ValueError says why."""
    match = _QUANTITY.fullmatch(text.strip())
    if match is None:
        raise ValueError("not a number of bytes")
    sign, digits, exponent, unit = match.groups()
    if unit.lower() not in _UNITS:
        raise ValueError(f"unknown unit {unit!r}; use one of {_UNIT_NAMES}")
    number = Fraction(digits) * Fraction(10) ** int(exponent or 0)
    if sign == "-" and number != 0:
        raise ValueError("negative")
    return number * _UNITS[unit.lower()], unit


def parse_bytes(value: Any, option: str, *, allow_none: bool = False) -> int | None:
    """Return ``value`` as a whole number of bytes, or raise :class:`OptionsError` naming ``option``.

    Accepts non-negative ints, integral floats such as ``1e9``, and strings such as ``"12GiB"``,
    ``"800MB"``, ``"12 GB"``, ``"1024"``. A fractional count of a larger unit rounds down to whole
    bytes (``"1.3GiB"``); a fractional count of plain bytes is an error. ``None`` is accepted only
    with ``allow_none``.
    """
    accepted = ("None or " if allow_none else "") + _BYTES_ACCEPTED
    if value is None:
        if allow_none:
            return None
        raise OptionsError(option, value, accepted)
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, float, str)):
        raise OptionsError(option, value, accepted, f"a {type(value).__name__} is not accepted")
    if isinstance(value, numbers.Integral):
        if value < 0:
            raise OptionsError(option, value, accepted, "negative")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0 or not value.is_integer():
            raise OptionsError(option, value, accepted, "not a whole, non-negative number")
        return int(value)
    try:
        number, unit = _quantity(value)
    except ValueError as e:
        raise OptionsError(option, value, accepted, str(e)) from None
    if unit.lower() in ("", "b") and number.denominator != 1:
        raise OptionsError(option, value, accepted, "not a whole number of bytes")
    return math.floor(number)


def parse_bandwidth(value: Any, option: str) -> float | None:
    """Return a positive bandwidth in bytes per second, or ``None`` (measure it or use a table).

    Accepts positive numbers and strings such as ``"25GB/s"``, ``"12 GiB/s"`` or ``"25GB"``.
    """
    accepted = 'None, a positive number of bytes per second, or a string such as "25GB/s"'
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, float, str)):
        raise OptionsError(option, value, accepted, f"a {type(value).__name__} is not accepted")
    try:
        if isinstance(value, str):
            rate = float(_quantity(re.sub(r"\s*/\s*s$", "", value, flags=re.IGNORECASE))[0])
        else:
            rate = float(value)
    except ValueError as e:
        raise OptionsError(option, value, accepted, str(e)) from None
    except OverflowError:
        rate = math.inf  # rejected just below, with the rest of the non-finite rates
    if not math.isfinite(rate) or rate <= 0:
        raise OptionsError(option, value, accepted, "must be positive and finite")
    return rate


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d{1,2}))?\s*(ms|us|µs|s)?",
                       re.IGNORECASE)
_MS_PER = {"ms": 1.0, "us": 1e-3, "µs": 1e-3, "s": 1e3, None: 1.0}


def parse_duration_ms(value: Any, option: str) -> float:
    """Return a duration in milliseconds: a non-negative number (ms) or a string such as
    ``"0.05ms"``, ``"50us"`` or ``"0.001s"``."""
    accepted = 'a number of milliseconds >= 0, or a string such as "0.05ms", "50us", "0.001s"'
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise OptionsError(option, value, accepted, f"a {type(value).__name__} is not accepted")
    if isinstance(value, str):
        match = _DURATION.fullmatch(value.strip())
        if match is None:
            raise OptionsError(option, value, accepted, "not a duration")
        digits, exponent, unit = match.groups()
        ms = float(digits) * 10 ** int(exponent or 0) * _MS_PER[unit and unit.lower()]
    else:
        ms = float(value)
    if not math.isfinite(ms) or ms < 0:
        raise OptionsError(option, value, accepted, "must be finite and >= 0")
    return ms


# Options whose values are bytes, and those that are bytes per second (shown in human units).
BYTE_OPTIONS = frozenset({"memory_budget", "host_budget", "min_offload_bytes"})
BANDWIDTH_OPTIONS = frozenset({"bandwidth", "offload_dir_bandwidth"})


def option_value(name: str, value: Any) -> str:
    """An option's value as a user would write it: bytes as ``"12.0 GiB"``, bandwidths as
    ``"25 GB/s"``, anything else as its ``repr``."""
    if name in BYTE_OPTIONS and isinstance(value, int) and not isinstance(value, bool):
        return repr(format_bytes(value))
    if name in BANDWIDTH_OPTIONS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(f"{value / 1e9:.3g}GB/s")
    return repr(value)


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: powers of 1024, one decimal, as budgets are written."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
