"""Data parallelism as the API process sees it: which DP rank gets each request
(`LoadBalancer`, vLLM's `DPLBAsyncMPClient`), and one answer from every rank's answer to a utility
call (`merge_utility_results`, `merge_stats`). Used by both MP clients in core_client.py.
"""

from __future__ import annotations

from typing import Any

from stepscope.engine.liveness import DP_RANK_TIMEOUT_S
from stepscope.engine.messages import EngineCoreOutputs


class LoadBalancer:
    """Which DP rank gets the next request (vLLM: `DPLBAsyncMPClient.get_core_engine_for_request`).

    The score of a rank is 4 x waiting + running, as the coordinator last published them, plus
    the requests this client has sent there and not seen finish: the published counts lag by up
    to 100 ms, and a burst must not all land on the rank that looked idle. Ties go to the lower
    rank. Aborts go to the rank that holds the request.
    """

    def __init__(self, size: int) -> None:
        self.published = [(0, 0)] * size
        self.in_flight = [0] * size
        self.rank_of: dict[str, int] = {}

    def update(self, loads: list[list[int]]) -> str | None:
        """Take the coordinator's [waiting, running, lost] per rank; why the engine is dead if
        the coordinator lost a rank (no heartbeat), else None."""
        if len(loads) != len(self.published):
            return None
        self.published = [(w, r) for w, r, _ in loads]
        lost = [rank for rank, (_, _, gone) in enumerate(loads) if gone]
        if lost:
            return (
                f"the engine core of DP rank {lost[0]} stopped reporting to the DP coordinator "
                f"(no heartbeat for {DP_RANK_TIMEOUT_S:.0f} s): its machine or process is gone"
            )
        return None

    def choose(self, request_id: str) -> int:
        size = len(self.in_flight)
        if size == 1:
            rank = 0
        else:
            rank = min(
                range(size),
                key=lambda i: 4 * self.published[i][0] + self.published[i][1] + self.in_flight[i],
            )
        self.rank_of[request_id] = rank
        self.in_flight[rank] += 1
        return rank

    def finished(self, request_id: str) -> None:
        rank = self.rank_of.pop(request_id, None)
        if rank is not None:
            self.in_flight[rank] -= 1

    def by_rank(self, request_ids: list[str]) -> dict[int, list[str]]:
        """The ranks holding `request_ids` (unknown ids, already finished, are left out)."""
        groups: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.rank_of.get(rid)
            if rank is not None:
                groups.setdefault(rank, []).append(rid)
        return groups

    def observe(self, outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            if out.finish_reason is not None:
                self.finished(out.request_id)


def merge_utility_results(method: str, results: list[Any]) -> Any:
    """One answer from every rank's answer to a utility call."""
    if len(results) == 1:
        return results[0]
    if method == "reset_prefix_cache":
        return all(results)
    if method == "get_stats":
        return merge_stats(results)
    return results


def merge_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Engine statistics summed over DP ranks; ratios recomputed; each rank's own under
    `"ranks"`."""
    merged: dict[str, Any] = {}
    for stats in per_rank:
        for key, value in stats.items():
            if isinstance(value, list):
                old = merged.get(key, [0] * len(value))
                merged[key] = [a + b for a, b in zip(old, value, strict=True)]
            elif isinstance(value, int | float) and key != "crossing_median_s":
                merged[key] = merged.get(key, 0) + value
    total = merged.get("num_kv_blocks", 0)
    if total:
        merged["kv_cache_usage"] = 1 - merged["num_free_blocks"] / total
    medians = [s["crossing_median_s"] for s in per_rank if "crossing_median_s" in s]
    if medians:
        merged["crossing_median_s"] = max(medians)
    merged["ranks"] = per_rank
    return merged
