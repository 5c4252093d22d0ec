"""Pandas values as the dashboard shows them: numeric columns as float arrays, counts and
durations as text. No Panel or Bokeh here, so the pages' data modules (`engine_data`) import
these without them; `ui` hands them on to the pages."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd


def float_columns(frame: pd.DataFrame, columns: list[str]) -> dict[str, np.ndarray]:
    """Numeric columns as float arrays (NULL -> NaN), as Bokeh wants them."""
    return {c: pd.to_numeric(frame[c], errors="coerce").astype(float).to_numpy() for c in columns}


def fmt_ms(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or pd.isna(value):
        return "-"
    return f"{value * 1e3:.{digits}f} ms"


def int_text(value: Any) -> str:
    return "-" if value is None or pd.isna(value) else str(int(value))
