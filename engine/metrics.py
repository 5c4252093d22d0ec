"""Prometheus metrics of the API server (`GET /metrics`), named as vLLM's under `stepscope:`.

Latency histograms are observed here, in the API process, from each request's timeline; gauges
and engine counters come from the engine core through a utility call at scrape time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKENS_PER_STEP_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            cumulative += n
            lines.append(f'{self.name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum{{{labels}}} {self.total}")
        lines.append(f"{self.name}_count{{{labels}}} {self.count}")
        return lines


class ServerMetrics:
    """Prometheus text for /metrics. With several API servers (`api_server` given), every series
    says which one answered: counters and latencies are that process's own; the engine gauges
    are the whole engine's, and with DP > 1 one series per rank (`engine="R"`)."""

    def __init__(self, model_name: str, api_server: int | None = None) -> None:
        self.labels = f'model_name="{model_name}"'
        if api_server is not None:
            self.labels += f',api_server="{api_server}"'
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished: dict[str, int] = {}
        self.rejected_queue_full = 0
        self.ttft = Histogram(
            "stepscope:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "stepscope:inter_token_latency_seconds", "Time between output tokens.", LATENCY_BUCKETS
        )
        self.e2e = Histogram(
            "stepscope:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS
        )
        self.queue = Histogram(
            "stepscope:request_queue_time_seconds", "Time spent waiting.", LATENCY_BUCKETS
        )

    def observe_finished(
        self,
        finish_reason: str,
        prompt_tokens: int,
        output_tokens: int,
        queue_s: float | None,
        ttft_s: float | None,
        e2e_s: float,
    ) -> None:
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += output_tokens
        self.requests_finished[finish_reason] = self.requests_finished.get(finish_reason, 0) + 1
        if queue_s is not None:
            self.queue.observe(queue_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)

    def render(self, stats: dict, num_in_flight: int, dropped_spans: int = 0) -> str:
        lb = self.labels
        lines: list[str] = []

        ranks = stats.get("ranks")  # with DP > 1, each rank's own stats

        def metric(name: str, kind: str, help_: str, value: float, extra: str = "") -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name}{{{lb}{extra}}} {value}")

        def engine_gauge(name: str, help_: str, key: str) -> None:
            if not ranks:
                metric(name, "gauge", help_, stats[key])
                return
            lines.append(f"# HELP {name} {help_} (per DP rank)")
            lines.append(f"# TYPE {name} gauge")
            for rank, rank_stats in enumerate(ranks):
                lines.append(f'{name}{{{lb},engine="{rank}"}} {rank_stats[key]}')

        engine_gauge(
            "stepscope:num_requests_running", "Requests in the running batch.", "num_running"
        )
        engine_gauge(
            "stepscope:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"
        )
        lines.extend(_waiting_by_reason(lb, stats))
        metric(
            "stepscope:num_requests_in_flight",
            "gauge",
            "Requests held by the API server.",
            num_in_flight,
        )
        engine_gauge(
            "stepscope:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", "kv_cache_usage"
        )
        metric(
            "stepscope:prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up.",
            stats["prefix_queries"],
        )
        metric(
            "stepscope:prefix_cache_hits_total",
            "counter",
            "Prompt tokens found cached.",
            stats["prefix_hits"],
        )
        metric(
            "stepscope:num_preemptions_total",
            "counter",
            "Recompute preemptions.",
            stats["num_preemptions"],
        )
        metric(
            "stepscope:prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            self.prompt_tokens,
        )
        metric(
            "stepscope:generation_tokens_total",
            "counter",
            "Generated tokens.",
            self.generation_tokens,
        )
        metric(
            "stepscope:request_rejected_queue_full_total",
            "counter",
            "Requests refused with 503 because the waiting queue was full.",
            self.rejected_queue_full,
        )
        metric(
            "stepscope:trace_spans_dropped_total",
            "counter",
            "Spans lost before storage.",
            dropped_spans,
        )
        lines.append("# HELP stepscope:request_success_total Finished requests by reason.")
        lines.append("# TYPE stepscope:request_success_total counter")
        for reason, n in sorted(self.requests_finished.items()):
            lines.append(f'stepscope:request_success_total{{{lb},finished_reason="{reason}"}} {n}')
        for h in (self.ttft, self.itl, self.e2e, self.queue):
            lines.extend(h.render(lb))
        steps = Histogram(
            "stepscope:tokens_per_step",
            "Tokens scheduled per engine step.",
            TOKENS_PER_STEP_BUCKETS,
        )
        steps.counts = list(stats["step_tokens_counts"])
        steps.total = stats["step_tokens_sum"]
        steps.count = int(stats["num_busy_steps"])
        lines.extend(steps.render(lb))
        return "\n".join(lines) + "\n"


def _waiting_by_reason(labels: str, stats: dict) -> list[str]:
    """`stepscope:num_requests_waiting_by_reason`: the waiting requests each reason held back at
    the latest step (`reason`: budget, max_num_seqs, kv_blocks, preempted, grammar, as
    `trace explain` names them), one series per reason and, with DP > 1, per rank
    (`engine="R"`)."""
    name = "stepscope:num_requests_waiting_by_reason"
    ranks = stats.get("ranks")
    lines = [
        f"# HELP {name} Waiting requests held back at the latest step, by why the head of the "
        f"waiting queue was not admitted{' (per DP rank)' if ranks else ''}.",
        f"# TYPE {name} gauge",
    ]
    for rank, rank_stats in enumerate(ranks) if ranks else [(None, stats)]:
        engine = "" if rank is None else f',engine="{rank}"'
        for reason, count in rank_stats["num_waiting_by_reason"].items():
            lines.append(f'{name}{{{labels}{engine},reason="{reason}"}} {count}')
    return lines
