"""Numbers as people read them, for every table and sentence the trace CLI prints.

Times are seconds or milliseconds with at most four significant digits, never scientific
notation (`format_seconds(34284.6)` is "34280 s", not "3.428e+04"); other numbers keep four
significant digits the same way. `format_table` prints a DataFrame with both: a column whose name
ends in `_s`, `_ms` or `_us` holds times in that unit, printed with the unit and named without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

DIGITS = 4
MISSING = "-"
# A column named with one of these suffixes holds times in that unit (seconds per unit).
TIME_SUFFIXES = {"_s": 1.0, "_ms": 1e-3, "_us": 1e-6}


def _missing(value: Any) -> bool:
    if value is None:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def _round(value: float, digits: int = DIGITS) -> tuple[float, int]:
    """`value` rounded to `digits` significant digits, and the decimals that keeps."""
    if value == 0 or not math.isfinite(value):
        return value, 0
    decimals = digits - 1 - math.floor(math.log10(abs(value)))
    rounded = round(value, decimals)
    if rounded != 0 and math.floor(math.log10(abs(rounded))) > digits - 1 - decimals:
        decimals -= 1  # rounding carried into a new digit (9999.6 -> 10000)
        rounded = round(value, decimals)
    return rounded, max(decimals, 0)


def _plain(value: float, digits: int = DIGITS) -> str:
    """Fixed-point text with at most `digits` significant digits, trailing zeros dropped."""
    rounded, decimals = _round(value, digits)
    if not math.isfinite(rounded):
        return str(rounded)
    text = f"{rounded:.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def format_seconds(seconds: float | None) -> str:
    """'34280 s', '12.35 s', '285.3 ms', '0.123 ms', '0 s'; '-' for a missing value."""
    if _missing(seconds):
        return MISSING
    seconds = float(seconds)
    if seconds == 0:
        return "0 s"
    if abs(_round(seconds)[0]) >= 1 or not math.isfinite(seconds):
        return f"{_plain(seconds)} s"
    return f"{_plain(seconds * 1e3)} ms"


def format_number(value: Any) -> str:
    """A whole number as it is; any other with at most four significant digits, never in
    e-notation."""
    if _missing(value):
        return MISSING
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if hasattr(value, "item"):  # a numpy scalar
            return format_number(value.item())
        return str(value)
    if isinstance(value, int):
        return str(value)
    if value.is_integer():  # a count that went through a float column
        return str(int(value))
    return _plain(value)


def time_unit(column: str) -> float | None:
    """Seconds per unit of a column named `..._s`, `..._ms` or `..._us`; None for any other."""
    for suffix, scale in TIME_SUFFIXES.items():
        if column.endswith(suffix) and len(column) > len(suffix):
            return scale
    return None


def format_table(frame: pd.DataFrame, seconds: Sequence[str] = (), indent: str = "  ") -> str:
    """`frame` as aligned text: time columns (by suffix, or named in `seconds`, which hold
    seconds) as `format_seconds` prints them and named without their unit, every other number as
    `format_number` prints it. '(none)' for an empty frame."""
    if frame.empty:
        return f"{indent}(none)"
    shown = {}
    for column in frame.columns:
        name = str(column)
        scale = 1.0 if name in seconds else time_unit(name)
        values = frame[column]
        if scale is not None:
            stripped = name if name in seconds else name[: name.rindex("_")]
            if stripped in frame.columns or stripped in shown:
                stripped = name
            shown[stripped] = [
                format_seconds(None if _missing(v) else float(v) * scale) for v in values
            ]
        elif pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values):
            shown[name] = [format_number(v) for v in values]
        else:
            shown[name] = [MISSING if _missing(v) else str(v) for v in values]
    text = pd.DataFrame(shown).to_string(index=False)
    return "\n".join(indent + line for line in text.splitlines())
