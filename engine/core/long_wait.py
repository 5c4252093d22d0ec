"""A word when a request has waited too long in the waiting queue (stage 3), in the engine core.

After each schedule, every request still waiting for longer than `long_wait_warning_s` (since it
was queued, or since its last preemption) is named once: a warning line in this process's log,
with the reason the scheduler recorded for the head of the waiting queue (first come, first
served: the head's reason holds back every request behind it), and a notice to the API side
(an `EngineCoreOutput` with no tokens and a `LongWait`), which puts a `long_wait` event on the
request's span. Neither needs tracing: the line is logged with tracing off too. A step that
finds many such requests at once names the first `MAX_LINES` and counts the rest in one more
line; an offline engine (`LLM`, whose `generate` queues a whole batch by design) logs nothing and
keeps only the span events.
"""

from __future__ import annotations

import logging

from stepscope.engine.core.request import Request
from stepscope.engine.core.scheduler import Scheduler, StepStats
from stepscope.engine.messages import EngineCoreOutput, LongWait
from stepscope.traces.names import RequestEvent

logger = logging.getLogger(__name__)

MAX_LINES = 3  # requests named one by one per step; the rest are counted in one line

# What each of `WAITING_REASONS` means, for the warning line.
_WHY = {
    "budget": "the token budget of a step (max_num_batched_tokens={budget}) is used up",
    "max_num_seqs": "the running batch is full (max_num_seqs={max_num_seqs})",
    "kv_blocks": "too few free KV blocks: the head of the queue lacks {short}",
    "preempted": "a preempted request waits at the head of the queue to be recomputed",
    "grammar": "the requests left waiting wait for their grammars to compile",
}


class LongWaitWatch:
    """Names each request that waits past `threshold_s`, once; None: never."""

    def __init__(self, threshold_s: float | None, where: str = "", log: bool = True) -> None:
        self.threshold_s = threshold_s
        self.where = where  # e.g. " (DP rank 1)", for the warning line
        self.log = log  # False: span events only (an offline engine)
        self._warned: set[str] = set()  # request ids already named, while they are in the engine
        self._checked: StepStats | None = None

    def check(self, scheduler: Scheduler, now: float) -> list[EngineCoreOutput]:
        """The notices for requests that have newly waited too long, as of the latest
        `schedule()` (nothing when no schedule ran since the last check: its reasons are the
        ones already seen)."""
        stats = scheduler.last_stats
        if self.threshold_s is None or stats is self._checked:
            return []
        self._checked = stats
        if self._warned:
            self._warned.intersection_update(scheduler.requests)  # forget finished requests
        if stats.waiting_reason is None:
            return []
        notices = []
        for request in scheduler.waiting:
            waited = now - _waiting_since(request)
            if waited < self.threshold_s or request.request_id in self._warned:
                continue
            self._warned.add(request.request_id)
            if self.log and len(notices) < MAX_LINES:
                self._log(request, waited, stats, scheduler)
            notices.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    events={RequestEvent.LONG_WAIT: now},
                    num_preemptions=request.num_preemptions,
                    long_wait=LongWait(waited, stats.waiting_reason, stats.kv_blocks_short),
                )
            )
        if self.log and len(notices) > MAX_LINES:
            logger.warning(
                "stepscope: and %d more requests have waited over %g s in the engine core's "
                "queue%s, for the same reason", len(notices) - MAX_LINES, self.threshold_s,
                self.where,
            )  # fmt: skip
        return notices

    def _log(self, request: Request, waited: float, stats: StepStats, s: Scheduler) -> None:
        why = _WHY.get(stats.waiting_reason, stats.waiting_reason or "").format(
            budget=s.max_num_batched_tokens,
            max_num_seqs=s.max_num_seqs,
            short=f"{stats.kv_blocks_short} blocks",
        )
        logger.warning(
            "stepscope: request %s has waited %.2f s in the engine core's queue%s "
            "(long_wait_warning_s=%g): %s, %s; %d waiting, %d running",
            request.request_id, waited, self.where, self.threshold_s, stats.waiting_reason, why,
            len(s.waiting), len(s.running),
        )  # fmt: skip


def _waiting_since(request: Request) -> float:
    """When the request's current wait began: its last preemption, else its arrival in the
    engine core."""
    return request.events.preempted[-1] if request.events.preempted else request.events.queued
