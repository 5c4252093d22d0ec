"""The arithmetic and the table of `stepscope bench whatif`: which settings each recorded
workload is changed to, each prediction's error against the replays, the spread between the
replays, and whether the settings rank the same by p90 TTFT predicted and replayed.

A number is within issue 40's target when the prediction is within 20% of the replays' mean, or
within 20 ms where that is larger (times; throughput has only the 20%). The spread is the
replays' range over their mean: how far apart two runs of the same setting came out, the noise a
prediction's error is read against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stepscope.traces.backend.compare import aligned, metric_text
from stepscope.traces.backend.units import format_seconds

METRICS = ("ttft_p50_s", "ttft_p90_s", "tpot_mean_s", "throughput_tok_s")
LABELS = {
    "ttft_p50_s": "ttft p50",
    "ttft_p90_s": "ttft p90",
    "tpot_mean_s": "tpot mean",
    "throughput_tok_s": "throughput",
}
TOLERANCE = 0.20  # of the replayed value
FLOOR_S = 0.020  # for times: the tolerance is never below 20 ms
RANK_BY = "ttft_p90_s"


def cases_for(engine_config: dict[str, Any], recorded_pool: int | None) -> list[tuple[str, dict]]:
    """(label, changes) of the four settings a recorded run is changed to, from its recorded
    configuration: the budget halved and doubled, `max_num_seqs` 8, the KV pool halved
    (`recorded_pool`, the blocks its steps saw, where the configuration left the pool to the
    free memory)."""
    budget = int(engine_config["scheduler_config"]["max_num_batched_tokens"])
    pool = engine_config["cache_config"].get("num_kv_blocks") or recorded_pool
    if pool is None:
        raise ValueError("the recorded run holds no KV pool size (num_kv_blocks or its steps')")
    return [
        ("budget /2", {"max_num_batched_tokens": max(1, budget // 2)}),
        ("budget x2", {"max_num_batched_tokens": budget * 2}),
        ("max_num_seqs 8", {"max_num_seqs": 8}),
        ("pool /2", {"num_kv_blocks": max(1, int(pool) // 2)}),
    ]


def settings_text(changes: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in changes.items())


@dataclass(frozen=True, slots=True)
class MetricCheck:
    """One number of one case: predicted against its replays."""

    key: str  # a key of METRICS
    predicted: float | None
    replays: tuple[float | None, ...]

    @property
    def replayed(self) -> float | None:
        """The replays' mean."""
        values = [v for v in self.replays if v is not None]
        return sum(values) / len(values) if values else None

    @property
    def error(self) -> float | None:
        """(predicted - replayed) / replayed."""
        replayed = self.replayed
        if self.predicted is None or not replayed:
            return None
        return (self.predicted - replayed) / replayed

    @property
    def allowed(self) -> float | None:
        """The largest difference within the target: 20%, or 20 ms for a time if larger."""
        replayed = self.replayed
        if replayed is None:
            return None
        share = TOLERANCE * abs(replayed)
        return share if self.key == "throughput_tok_s" else max(share, FLOOR_S)

    @property
    def within(self) -> bool | None:
        replayed, allowed = self.replayed, self.allowed
        if self.predicted is None or replayed is None or allowed is None:
            return None
        return abs(self.predicted - replayed) <= allowed

    @property
    def range(self) -> float | None:
        """The replays' max - min."""
        values = [v for v in self.replays if v is not None]
        return max(values) - min(values) if len(values) > 1 else None

    @property
    def spread(self) -> float | None:
        """The replays' range over their mean."""
        spread, replayed = self.range, self.replayed
        return None if spread is None or not replayed else spread / abs(replayed)

    def row(self) -> dict[str, Any]:
        return {
            "predicted": self.predicted,
            "replays": list(self.replays),
            "replayed": _round(self.replayed),
            "error": _round(self.error),
            "within": self.within,
            "spread": _round(self.spread),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def check_case(predicted: dict[str, Any], replays: Sequence[dict[str, Any]]) -> list[MetricCheck]:
    """Every number of METRICS: a prediction's table against its replays' tables."""
    return [MetricCheck(k, predicted[k], tuple(r[k] for r in replays)) for k in METRICS]


@dataclass(frozen=True, slots=True)
class Ranking:
    """The settings ordered by p90 TTFT, lowest first, predicted and replayed (the replays'
    mean), and each pair that comes out in opposite orders, with whether the replays tell the
    pair apart: their means differ by more than either setting's replays' range, and by more
    than the workload's pooled spread (the mean over its settings of their replays' range over
    their mean) of the pair's mean. Two replays' range alone understates what runs of one
    setting differ by: on the long-prompt workload two settings 4% apart were ranked by it,
    where the workload's replays differed by 7% on average."""

    predicted: list[str]
    replayed: list[str]
    swapped: list[tuple[str, str, bool]]

    @property
    def same_order(self) -> bool:
        return self.predicted == self.replayed

    @property
    def same_beyond_spread(self) -> bool:
        """No pair the replays tell apart is in the wrong order."""
        return not any(apart for _, _, apart in self.swapped)

    def row(self) -> dict[str, Any]:
        return {
            "predicted": self.predicted,
            "replayed": self.replayed,
            "same_order": self.same_order,
            "swapped": [{"a": a, "b": b, "replays_tell_apart": t} for a, b, t in self.swapped],
        }


def rank(checks: dict[str, MetricCheck]) -> Ranking:
    """`checks`: each setting's RANK_BY check, in the order the settings were run (ties keep
    it)."""
    labels = list(checks)
    huge = float("inf")
    spreads = [c.spread for c in checks.values() if c.spread is not None]
    pooled = sum(spreads) / len(spreads) if spreads else 0.0

    def by(value: float | None) -> float:
        return huge if value is None else value

    predicted = sorted(labels, key=lambda k: by(checks[k].predicted))
    replayed = sorted(labels, key=lambda k: by(checks[k].replayed))
    place = {label: i for i, label in enumerate(replayed)}
    swapped = []
    for i, a in enumerate(predicted):
        for b in predicted[i + 1 :]:
            if place[b] < place[a]:
                swapped.append((a, b, _apart(checks[a], checks[b], pooled)))
    return Ranking(predicted, replayed, swapped)


def _apart(a: MetricCheck, b: MetricCheck, pooled_spread: float = 0.0) -> bool:
    if a.replayed is None or b.replayed is None:
        return False
    typical = pooled_spread * (abs(a.replayed) + abs(b.replayed)) / 2
    noise = max(a.range or 0.0, b.range or 0.0, typical)
    return abs(a.replayed - b.replayed) > noise


# ---- the table ---------------------------------------------------------------------------------
def _pct(value: float | None, signed: bool = True) -> str:
    if value is None:
        return "-"
    return f"{value:+.0%}" if signed else f"{value:.0%}"


def case_table(cases: Sequence[tuple[str, dict[str, Any], list[MetricCheck]]]) -> str:
    """One line per number of each case: predicted, the replays' mean and each replay, the
    error, within the target or not, and the replays' spread."""
    header = ["setting", "number", "predicted", "replayed", "replays", "error", "within",
              "spread"]  # fmt: skip
    rows = []
    for label, changes, checks in cases:
        for i, check in enumerate(checks):
            name = f"{label}: {settings_text(changes)}" if i == 0 else ""
            within = "-" if check.within is None else ("yes" if check.within else "NO")
            rows.append(
                (
                    name,
                    [
                        LABELS[check.key],
                        metric_text(check.key, check.predicted),
                        metric_text(check.key, check.replayed),
                        ", ".join(_value(check.key, v) for v in check.replays),
                        _pct(check.error),
                        within,
                        _pct(check.spread, signed=False),
                    ],
                )
            )
    return aligned(header, rows)


def _value(key: str, value: float | None) -> str:
    text = metric_text(key, value)
    return text.removesuffix(" tok/s")


def ranking_line(ranking: Ranking) -> str:
    def order(labels: list[str]) -> str:
        return " < ".join(labels)

    line = f"ranked by p90 TTFT: predicted {order(ranking.predicted)}"
    if ranking.same_order:
        return f"{line}; replayed the same order"
    why = {True: "the replays tell them apart", False: "within the replays' spread"}
    parts = [f"{a} / {b} swapped ({why[apart]})" for a, b, apart in ranking.swapped]
    return f"{line}; replayed {order(ranking.replayed)}: " + "; ".join(parts)


def tolerance_text() -> str:
    return (
        f"within: |predicted - replayed| <= {TOLERANCE:.0%} of the replayed value, or "
        f"{format_seconds(FLOOR_S)} for a time where that is larger; replayed: the mean of the "
        "replays; spread: their range over that mean"
    )
