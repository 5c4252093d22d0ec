""" "Why this long" draws every part of a request's end-to-end time in its own colour, so a reader
sees where the queue ends and prefill starts (queue and prefill were once the same orange)."""

from __future__ import annotations

from itertools import combinations

from stepscope.traces.backend.explain import PARTS
from stepscope.viz.path_page import PART_LABELS
from stepscope.viz.ui import PART_COLORS


def _rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


def test_every_part_has_a_colour_of_its_own():
    assert list(PART_COLORS) == list(PARTS)
    for (a, ca), (b, cb) in combinations(PART_COLORS.items(), 2):
        # Far apart, not merely unequal: a distance under 80 in RGB reads as one colour.
        distance = sum((x - y) ** 2 for x, y in zip(_rgb(ca), _rgb(cb), strict=True)) ** 0.5
        assert distance > 80, (a, ca, b, cb)


def test_the_bar_and_its_legend_take_the_palette():
    assert list(PART_LABELS) == list(PARTS)
    assert {part: color for part, (_, color) in PART_LABELS.items()} == PART_COLORS
    assert len({label for label, _ in PART_LABELS.values()}) == len(PARTS)
