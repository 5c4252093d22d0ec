"""The scheduler: one token budget per step, shared by running and waiting requests (stages 3, 4
and 8 of docs/request-path.md).

`schedule()` decides how many tokens each request adds this step; `update_from_output()` takes
the sampled tokens back and checks token-level stop conditions. No tensors here: the worker
owns those.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from stepscope.engine.core.kv_cache_manager import KVCacheManager
from stepscope.engine.core.request import Request, RequestStatus
from stepscope.engine.messages import (
    CachedRequestData,
    EngineCoreOutput,
    Logprob,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
)


@dataclass(slots=True)
class StepStats:
    """What the last `schedule()` decided, for traces and the dashboard."""

    step: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    token_budget: int = 0
    kv_free_before: int = 0
    kv_free_after: int = 0
    prefix_hit_tokens: int = 0
    preempted: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()
    # Why the head of the waiting queue (and so, first come first served, every request behind
    # it) was not admitted: one of WAITING_REASONS, or None when nobody was left waiting.
    waiting_reason: str | None = None
    kv_blocks_short: int = 0  # with "kv_blocks": how many free blocks the head lacked
    # Tokens the step's scheduled requests attend to: each one's KV length once the step has
    # run (computed tokens, prefix hits included, plus the tokens scheduled now), summed.
    num_context_tokens: int = 0
    # Blocks each KV cache group holds once the step is scheduled (one entry per group).
    kv_blocks_by_group: tuple[int, ...] = ()
    # Each group's sliding window, parallel to kv_blocks_by_group (0: the group keeps every
    # block: full attention, or a window with the hybrid manager off).
    kv_group_windows: tuple[int, ...] = ()


# "budget": running requests used the token budget; "max_num_seqs": the running batch is full;
# "kv_blocks": too few free KV blocks for the head; "preempted": the head was preempted and waits
# to be recomputed (and this step, which preempted, admits nobody); "grammar": every request left
# waiting is a structured one whose grammar is still compiling (the others were admitted).
WAITING_REASONS = ("budget", "max_num_seqs", "kv_blocks", "preempted", "grammar")


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.kv = kv_cache_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.finished_req_ids: set[str] = set()
        self.step_index = 0
        self.num_preemptions = 0
        self.last_stats = StepStats()
        # Structured requests in the engine (0: no step pays anything for grammars), and those
        # whose grammar failed to compile, finished here and reported by the engine core.
        self.num_structured = 0
        self.grammar_failed: list[Request] = []

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if request.num_tokens >= self.max_model_len:
            # Checked at the edge already; here it keeps the busy loop from holding a request
            # it could never schedule.
            raise ValueError(
                f"the prompt has {request.num_tokens} tokens, but the context is "
                f"{self.max_model_len} tokens"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.structured_output is not None:
            self.num_structured += 1

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string): free their blocks."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.events.finished = time.time()
        self.kv.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        if request.structured_output is not None:
            self.num_structured -= 1

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        kv_free_before = self.kv.num_free_blocks
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[list[int]]] = {}  # per request, per KV cache group
        preempted: list[Request] = []
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        num_decode = num_prefill = prefix_hit_tokens = num_context = 0
        now = time.time()

        # Pass 1: running requests catch up (a decode needs 1 token, a chunked prefill more).
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            n = min(n, budget, self.max_model_len - request.num_computed_tokens)
            if n <= 0 or self._ends_in_flight(request):
                i += 1
                continue
            while (blocks := self.kv.allocate_slots(request, n)) is None:
                victim = self.running.pop()
                self._preempt(victim, now)
                preempted.append(victim)
                if victim is request:
                    break
            if blocks is None:
                break
            num_scheduled[request.request_id] = n
            new_blocks[request.request_id] = blocks.block_ids()
            scheduled_running.append(request)
            budget -= n
            i += 1

        # Pass 2: admit waiting requests while budget, blocks and max_num_seqs allow. A request
        # whose grammar is still compiling is passed over (it keeps its place in the queue).
        blocked_by, kv_short = None, 0
        skipped: list[Request] = []
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                blocked_by = "max_num_seqs"
                break
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR and not self._grammar_ready(
                request, now
            ):
                self.waiting.popleft()
                if request.structured_output.error is None:
                    skipped.append(request)
                else:
                    self._finish(request, RequestStatus.FINISHED_ABORTED)
                    self.grammar_failed.append(request)
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            n = request.num_tokens - num_hit_tokens
            if not self.enable_chunked_prefill and n > budget:
                blocked_by = "budget"
                break
            n = min(n, budget)
            blocks = self.kv.allocate_slots(request, n, num_hit_tokens, hits)
            if blocks is None:
                blocked_by, kv_short = "kv_blocks", self.kv.last_blocks_short
                break
            self.waiting.popleft()
            self.running.append(request)
            self.kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.events.first_scheduled is None:
                request.events.first_scheduled = now
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            prefix_hit_tokens += num_hit_tokens
            num_scheduled[request.request_id] = n
            scheduled_new.append(request)
            budget -= n

        self.waiting.extendleft(reversed(skipped))
        if self.waiting:
            # A preempted head waits to be recomputed, whatever else holds it (a step that
            # preempts admits nobody); otherwise the guard that ended the loop, or the budget,
            # or (nobody else left) the grammars still compiling.
            if preempted or self.waiting[0].status == RequestStatus.PREEMPTED:
                blocked_by = "preempted"
            elif blocked_by is None:
                blocked_by = "grammar" if len(skipped) == len(self.waiting) else "budget"

        for request in scheduled_running + scheduled_new:
            n = num_scheduled[request.request_id]
            num_context += request.num_computed_tokens + n
            # A step that brings a request level with its known tokens, one at a time, is a
            # decode (its last token may still be in flight); anything longer is (part of) a
            # prefill or recompute.
            if n == 1 and request.num_output_tokens + request.num_output_placeholders > 0:
                num_decode += 1
            else:
                num_prefill += n

        self.last_stats = StepStats(
            step=self.step_index,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_decode_tokens=num_decode,
            num_prefill_tokens=num_prefill,
            token_budget=self.max_num_batched_tokens,
            kv_free_before=kv_free_before,
            kv_free_after=self.kv.num_free_blocks,
            prefix_hit_tokens=prefix_hit_tokens,
            preempted=tuple(r.request_id for r in preempted),
            finished=tuple(sorted(self.finished_req_ids)) if num_scheduled or preempted else (),
            waiting_reason=blocked_by,
            kv_blocks_short=kv_short if blocked_by == "kv_blocks" else 0,
            num_context_tokens=num_context,
            kv_blocks_by_group=tuple(self.kv.num_blocks_by_group),
            kv_group_windows=tuple(
                g.sliding_window if g.frees_outside_window else 0 for g in self.kv.groups
            ),
        )
        if not num_scheduled and not preempted:
            # Nothing to run: no step happens. Requests finished meanwhile (aborts) wait for the
            # next real step to tell the workers, and the step index does not move.
            return SchedulerOutput(
                step=self.step_index,
                scheduled_new_reqs=[],
                scheduled_cached_reqs=CachedRequestData(req_ids=[], new_block_ids=[],
                                                        num_computed_tokens=[]),
                num_scheduled_tokens={},
                total_num_scheduled_tokens=0,
                finished_req_ids=[],
                preempted_req_ids=[],
            )  # fmt: skip

        tables = {r.request_id: self.kv.block_ids_by_group(r.request_id) for r in scheduled_new}
        hybrid = self.kv.num_groups > 1
        output = SchedulerOutput(
            step=self.step_index,
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=r.request_id,
                    token_ids=list(r.all_token_ids),
                    sampling_params=r.sampling_params,
                    block_ids=tables[r.request_id][0],
                    num_computed_tokens=r.num_computed_tokens,
                    num_prompt_tokens=r.num_prompt_tokens,
                    group_block_ids=tables[r.request_id][1:],
                )
                for r in scheduled_new
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in scheduled_running],
                new_block_ids=[new_blocks[r.request_id][0] for r in scheduled_running],
                num_computed_tokens=[r.num_computed_tokens for r in scheduled_running],
                new_group_block_ids=(
                    [new_blocks[r.request_id][1:] for r in scheduled_running] if hybrid else []
                ),
            ),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=sorted(self.finished_req_ids),
            preempted_req_ids=[r.request_id for r in preempted],
        )
        self.finished_req_ids.clear()
        self.step_index += 1
        # Progress is booked when scheduled, so the next schedule() sees these tokens as computed;
        # a step that reaches the request's last token samples the next one: a placeholder until
        # its token comes back, which lets async scheduling schedule the step after it at once.
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
        return output

    def _grammar_ready(self, request: Request, now: float) -> bool:
        """Whether a request waiting for its grammar may be admitted now: it waits no more."""
        if not request.structured_output.ready():
            return False
        request.status = RequestStatus.WAITING
        compiled = request.structured_output.compiled_time
        request.events.grammar_ready = min(max(compiled, request.events.queued), now)
        return True

    def structured_requests_sampling(self, output: SchedulerOutput) -> list[Request]:
        """The structured requests that sample a token in this step (it reaches their last known
        token), in the scheduler output's order: the rows of its grammar bitmask."""
        if not self.num_structured:
            return []
        found = []
        for req_id in output.num_scheduled_tokens:
            request = self.requests[req_id]
            if request.structured_output is not None and request.num_output_placeholders:
                found.append(request)
        return found

    def has_structured_running(self) -> bool:
        """A structured request runs: its next bitmask needs every token it sampled so far."""
        return bool(self.num_structured) and any(
            r.structured_output is not None for r in self.running
        )

    def _ends_in_flight(self, request: Request) -> bool:
        """Async scheduling: the tokens still in flight take the request to `max_tokens` or to the
        context's end, so a step scheduled now would only compute a token to throw away."""
        pending = request.num_output_placeholders
        return pending > 0 and (
            request.num_output_tokens + pending >= request.max_tokens
            or request.num_tokens + pending >= self.max_model_len
        )

    def _preempt(self, request: Request, now: float) -> None:
        """Recompute preemption: free the blocks, forget progress, go to the head of waiting."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.events.preempted.append(now)
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens and stop requests that hit EOS, a stop token or a length limit."""
        outputs: list[EngineCoreOutput] = []
        now = time.time()
        for req_id, chunk in runner_output.prompt_logprobs.items():
            request = self.requests.get(req_id)
            if request is not None:
                _gather_prompt_logprobs(request, chunk)
        for req_id, sampled in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, strict=True
        ):
            request = self.requests.get(req_id)
            if request is None or not sampled:
                # Mid-prefill; or finished meanwhile: aborted, or (async scheduling) stopped by
                # the step before this one, whose extra token is thrown away here.
                continue
            request.num_output_placeholders -= len(sampled)
            new_tokens: list[int] = []
            for token in sampled:
                request.append_output_token(token)
                new_tokens.append(token)
                status = self._check_stop(request, token)
                grammar = request.structured_output
                # A grammar that has ended (its stop token accepted) stops the request.
                if grammar is not None and grammar.accept(token) and status is None:
                    status = RequestStatus.FINISHED_STOPPED
                if status is not None:
                    break
            if request.events.first_token is None:
                request.events.first_token = now
            logprobs = []
            if req_id in runner_output.logprobs:
                logprobs = [
                    Logprob(runner_output.logprob_token_ids[req_id], runner_output.logprobs[req_id])
                ]
            first_tokens = request.num_output_tokens == len(new_tokens)
            prompt_logprobs = request.prompt_logprobs if first_tokens else []
            finish_reason = None
            stop_reason = None
            if status is not None:
                # Preempted while this step ran (async scheduling), it waits to be recomputed.
                queue = self.waiting if request.status == RequestStatus.PREEMPTED else self.running
                queue.remove(request)
                self._finish(request, status)
                finish_reason = request.finish_reason
                stop_reason = token if token in request.sampling_params.stop_token_ids else None
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_tokens,
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                    new_logprobs=logprobs,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    events=request.events.report(now, first_tokens, status is not None),
                    num_preemptions=request.num_preemptions,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        return outputs

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _gather_prompt_logprobs(request: Request, chunk: PromptLogprobs) -> None:
    """Add one step's prompt logprobs to the request's, skipping positions it already has (a
    request preempted mid-prompt computes its prompt again)."""
    have = 1 + len(request.prompt_logprobs)  # position 0 has no logprob
    for i in range(max(have - chunk.start, 0), len(chunk.token_ids)):
        request.prompt_logprobs.append(Logprob(chunk.token_ids[i], chunk.logprobs[i]))
