"""Times and numbers as people read them, in every table the trace CLI prints: seconds or
milliseconds with at most four significant digits, never scientific notation."""

from __future__ import annotations

import io
import math

import pandas as pd
import pytest

from stepscope.traces.backend import cli
from stepscope.traces.backend.units import format_number, format_seconds, format_table


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0 s"),
        (0.0, "0 s"),
        (0.000123, "0.123 ms"),
        (12.345, "12.35 s"),
        (34280, "34280 s"),
        (34284.6, "34280 s"),
        (None, "-"),
        (math.nan, "-"),
        (0.2853, "285.3 ms"),
        (0.5, "500 ms"),
        (1.5, "1.5 s"),
        (0.9999996, "1 s"),  # rounds up into seconds, not '1000 ms'
        (0.0009999996, "1 ms"),
        (9999.6, "10000 s"),
        (-0.0123, "-12.3 ms"),
        (1e-9, "0.000001 ms"),
        (1234567.8, "1235000 s"),
    ],
)
def test_format_seconds(seconds, text):
    assert format_seconds(seconds) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (3, "3"),
        (3.0, "3"),  # a count that went through a float column
        (123456.0, "123456"),
        (1234.5678, "1235"),
        (0.000012345, "0.00001234"),
        (1e20, "100000000000000000000"),
        (None, "-"),
        (math.nan, "-"),
        ("x", "x"),
    ],
)
def test_format_number(value, text):
    assert format_number(value) == text


def test_format_table_prints_time_columns_with_their_unit():
    frame = pd.DataFrame(
        {
            "request_id": ["a", "b"],
            "e2e_ms": [34_280_000.0, 0.5],
            "p99_us": [12.0, None],
            "p50": [2.5, 0.01],
            "tokens": [1.0, math.nan],
        }
    )
    text = format_table(frame, seconds=("p50",))
    header, first, second = text.splitlines()
    assert header.split() == ["request_id", "e2e", "p99", "p50", "tokens"]
    assert first.split() == ["a", "34280", "s", "0.012", "ms", "2.5", "s", "1"]
    assert second.split() == ["b", "0.5", "ms", "-", "10", "ms", "-"]
    assert "e+" not in text and "e-" not in text
    assert format_table(frame.iloc[0:0]) == "  (none)"


def test_trace_slowest_and_explain_print_no_e_notation(traced_offline_run):
    for print_table in (
        lambda out: cli.trace_slowest(traced_offline_run, 10, out=out),
        lambda out: cli.trace_explain(traced_offline_run, out=out),
        lambda out: cli.trace_summary(traced_offline_run, out=out),
    ):
        out = io.StringIO()
        print_table(out)
        text = out.getvalue()
        assert text and "e+" not in text and "e-0" not in text, text
