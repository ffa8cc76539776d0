"""The configuration error type and the helpers every start-up check words its errors with (no other import of
the package: config.py, the heads, the policies and the pools all check settings with them, and config.py imports
those; they import this)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SECTION = "adaspec"  # additional_config[SECTION]: the plugin's settings


class AdaspecConfigError(ValueError):
    """A bad `adaspec` setting, a bad speculative config, or an unsupported model."""


# --- numbers: finite, in a stated range -------------------------------------------------------------------------

@dataclass(frozen=True)
class Interval:
    """A closed, open or half-open range of numbers, printed the way errors state it: [0, 1), (0, 1e6]."""
    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, v) -> bool:  # v: an int (compared exactly, however large) or a finite float
        return (self.lo < v if self.lo_open else self.lo <= v) and (v < self.hi if self.hi_open else v <= self.hi)

    def __str__(self) -> str:
        return f"{'(' if self.lo_open else '['}{_fmt(self.lo)}, {_fmt(self.hi)}{')' if self.hi_open else ']'}"


def _fmt(x: float) -> str:
    if isinstance(x, int) or float(x).is_integer() and abs(x) < 1e5:
        return str(int(x))
    return format(x, "g").replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


def show(value: Any, limit: int = 80) -> str:
    """A value as an error shows it (its repr), never more than `limit` characters and never an exception (a
    5000-digit int has no repr in Python 3.11, a very deep list none either)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def one_line(e: BaseException) -> str:
    """An exception raised while reading a user's file, as the tail of a one-line error (type: message)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def typed(value: Any) -> str:
    """show(value), with its type unless it is a number: what a type error prints (str '6', bool True, 6)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return show(value)
    return f"{type(value).__name__} {show(value)}"


def is_number(value: Any) -> bool:
    """An int or a finite float; bool is an int subclass, but `true` is never a count or a threshold."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)
