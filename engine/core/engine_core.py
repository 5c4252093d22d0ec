"""The engine core: schedule -> execute -> update, one step at a time (stages 3 to 8), or with
async scheduling two steps at a time (vLLM's `EngineCore.step_with_batch_queue`).

In-process here (offline `LLM`); the busy loop and ZMQ sockets wrap this same object when the
core runs in its own process.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry.trace import SpanContext

from stepscope.engine.config import Endpoints, EngineConfig, check_no_chunk_budget
from stepscope.engine.core.kv_cache_manager import KVCacheManager
from stepscope.engine.core.kv_cache_utils import (
    KVCacheGroupSpec,
    cdiv,
    kv_cache_groups_for,
    needs_null_block,
)
from stepscope.engine.core.long_wait import LongWaitWatch
from stepscope.engine.core.request import Request, RequestStatus
from stepscope.engine.core.scheduler import WAITING_REASONS, Scheduler
from stepscope.engine.core.structured_output import StructuredOutputManager
from stepscope.engine.executor.abstract import Executor
from stepscope.engine.executor.uniproc_executor import UniProcExecutor
from stepscope.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelRunnerOutput,
    ProcessInfo,
    SchedulerOutput,
)
from stepscope.engine.metrics import TOKENS_PER_STEP_BUCKETS, Histogram
from stepscope.engine.models.config import read_model_shape
from stepscope.engine.models.loader import load_config
from stepscope.traces import names
from stepscope.traces.setup import dropped_spans, flush_tracing
from stepscope.traces.spans import child_span, ended_child_span, request_link, step_span

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Batch:
    """A step scheduled and sent to the executor whose output has not been processed yet."""

    scheduler_output: SchedulerOutput
    runner_output: Future[ModelRunnerOutput]
    span: Any  # the step's span (or NOOP), open until its update is done
    execute: Any  # its `execute` child, open until the output is back


def _done(output: ModelRunnerOutput) -> Future[ModelRunnerOutput]:
    future: Future[ModelRunnerOutput] = Future()
    future.set_result(output)
    return future


def make_executor(config: EngineConfig, model_dir: Path, endpoints: Endpoints) -> Executor:
    if config.parallel_config.executor == "mp":
        from stepscope.engine.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config, model_dir, endpoints)
    if config.parallel_config.executor == "ray":
        from stepscope.engine.executor.ray_distributed_executor import RayDistributedExecutor

        return RayDistributedExecutor(config, model_dir, endpoints)
    return UniProcExecutor(config, model_dir)


def max_model_len_for(config: EngineConfig, model_dir: Path) -> int:
    limit = load_config(model_dir).get("max_position_embeddings", 2048)
    asked = config.model_config.max_model_len
    if asked is None:
        return limit
    if asked > limit:
        raise ValueError(f"max_model_len {asked} exceeds the model's limit of {limit} positions")
    return asked


def request_blocks(
    num_blocks: int, groups: list[KVCacheGroupSpec] | None, block_size: int, max_chunk: int
) -> int:
    """The most blocks a request of `num_blocks` blocks of tokens holds at once, over every
    group: all of them in a full-attention group; in a group that frees what its window left
    behind, those its window and a chunk of up to `max_chunk` tokens span (vLLM's
    `SlidingWindowSpec.max_memory_usage_bytes`), never more than all of them."""
    if not groups:
        return num_blocks
    total = 0
    for g in groups:
        if g.frees_outside_window:
            span = cdiv(g.sliding_window - 1 + max_chunk, block_size) + 1
            total += min(num_blocks, span)
        else:
            total += num_blocks
    return total


def fit_max_model_len(
    model_len: int,
    num_kv_blocks: int,
    block_size: int,
    explicit: int | None,
    groups: list[KVCacheGroupSpec] | None = None,
    max_chunk: int | None = None,
) -> int:
    """The longest request the KV pool can hold alone, as the engine's context length.

    A request longer than the pool could never be admitted (or, grown there by decoding, never
    re-admitted after preempting itself), and the busy loop would spin on it for good. As vLLM
    does, a context the user asked for is refused; the model's own default is lowered to fit.
    With several KV cache groups a request holds `request_blocks` (a sliding-window group only
    what its window and the largest chunk, `max_chunk` tokens, span; None: the whole request in
    one chunk), and the null block is not usable.
    """
    reserved = int(bool(groups) and needs_null_block(groups))
    usable = max(num_kv_blocks - reserved, 0)
    chunk = model_len if max_chunk is None else max_chunk

    def fits(n: int) -> bool:
        return request_blocks(n, groups, block_size, chunk) <= usable

    low, high = 0, cdiv(model_len, block_size)  # the most whole blocks that fit: binary search
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    capacity = min(low * block_size, model_len)
    if model_len <= capacity:
        return model_len
    if explicit is not None:
        least = request_blocks(cdiv(explicit, block_size), groups, block_size, chunk) + reserved
        raise ValueError(
            f"max_model_len {explicit} does not fit in the KV cache: {num_kv_blocks} blocks of "
            f"{block_size} tokens hold {capacity} tokens; raise num_kv_blocks to at least "
            f"{least} (--num-kv-blocks) or lower max_model_len to {capacity}"
        )
    logger.warning(
        "the KV cache holds %d tokens (%d blocks of %d), fewer than the model's %d positions: "
        "max_model_len lowered to %d (raise --num-kv-blocks for longer contexts)",
        capacity, num_kv_blocks, block_size, model_len, capacity,
    )  # fmt: skip
    return capacity


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        executor: Executor | None = None,
        endpoints: Endpoints | None = None,
    ) -> None:
        """`endpoints`: where this engine's worker processes send spans (mp executor)."""
        self.config = config
        cache, sched = config.cache_config, config.scheduler_config
        self.block_size = cache.block_size
        model_len = max_model_len_for(config, model_dir)
        self.executor = executor or make_executor(config, model_dir, endpoints or Endpoints())
        self.num_kv_blocks = self.executor.determine_num_kv_blocks()
        self.kv_cache_groups = kv_cache_groups_for(
            read_model_shape(model_dir), cache.disable_hybrid_kv_cache_manager
        )
        self.max_model_len = fit_max_model_len(
            model_len, self.num_kv_blocks, cache.block_size,
            explicit=config.model_config.max_model_len, groups=self.kv_cache_groups,
            max_chunk=sched.max_num_batched_tokens if sched.enable_chunked_prefill else None,
        )  # fmt: skip
        try:
            check_no_chunk_budget(sched, self.max_model_len)  # the length the model allows
        except ValueError:
            self.executor.shutdown()
            raise
        self.executor.init_kv_cache(self.num_kv_blocks)
        self.kv_cache_manager = KVCacheManager(
            self.num_kv_blocks, cache.block_size, cache.enable_prefix_caching, self.kv_cache_groups
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=sched.enable_chunked_prefill,
        )
        self.structured_output_manager = StructuredOutputManager(
            model_dir, config.model_config.tokenizer, load_config(model_dir)["vocab_size"]
        )
        # With nothing else to run, wait here for a grammar to compile (in one process nothing
        # else could arrive meanwhile); the engine-core process turns this off and is woken by
        # the manager's `on_compiled` instead, so that new requests are not held up.
        self.wait_for_grammars = True
        # Steps sent to the executor and not yet updated from, newest first: at most one, or two
        # with async scheduling (vLLM's batch queue, sized by `max_concurrent_batches`).
        self.async_scheduling = sched.async_scheduling
        self.batch_queue_size = 2 if sched.async_scheduling else 1
        self.batch_queue: deque[_Batch] = deque()
        # Request span contexts, so that each step span links to the requests it served.
        self.request_links: dict[str, SpanContext] = {}
        # core -> worker -> core time per step, less the worker's own execute (mp executor only).
        self.crossing_seconds: deque[float] = deque(maxlen=10_000)
        self.last_step_ran = False
        self.step_tokens = Histogram(
            "stepscope:tokens_per_step", "Tokens scheduled per step.", TOKENS_PER_STEP_BUCKETS
        )
        p = config.parallel_config
        self.long_waits = LongWaitWatch(
            config.observability_config.long_wait_warning_s,
            f" (DP rank {p.data_parallel_rank})" if p.data_parallel_size > 1 else "",
            log=not config.offline,
        )

    def add_request(self, request: EngineCoreRequest, queued_time: float | None = None) -> None:
        """Queue a request. `queued_time` is when this process received it (default: now): the
        `queued` event, where stage 3 starts."""
        link = request_link(request.trace_context)
        if link is not None:
            self.request_links[request.request_id] = link
        params = request.sampling_params
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=params,
                eos_token_id=request.eos_token_id,
                block_size=self.block_size,
                arrival_time=request.arrival_time,
                queued_time=time.time() if queued_time is None else queued_time,
                structured_output=None
                if params.structured_outputs is None
                else self.structured_output_manager.start(params.structured_outputs),
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for req_id in request_ids:
            self.request_links.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Schedule a step and send it to the executor; then, once `batch_queue_size` steps
        are out (or nothing more can be scheduled), wait for the oldest one's output and update
        from it. With one step at a time that is schedule -> execute -> update. With async
        scheduling the next step is scheduled, and this one's outputs processed, while the
        workers run the step after it; the scheduler counts the tokens still in flight as
        placeholders (vLLM: `AsyncScheduler`).

        A step that schedules nothing does not happen: no executor call, no span;
        `last_step_ran` says whether this call scheduled or updated anything. Once every request
        has finished, a step may still be in `batch_queue` (its tokens are thrown away): the
        next call, or the busy loop, collects it. Whatever it returns carries the notices of
        requests that have waited too long (`_outputs`).

        Structured outputs run one step at a time, async scheduling or not: a running structured
        request's next bitmask needs the token of the step in flight, so that step is finished
        first (the simple choice; vLLM instead builds the bitmask once the tokens are in)."""
        self.last_step_ran = False
        queue = self.batch_queue
        if queue and self.scheduler.has_structured_running():
            self.last_step_ran = True
            return self._outputs(self._update(queue.pop()))
        if len(queue) < self.batch_queue_size and self.scheduler.has_unfinished_requests():
            batch = self._schedule()
            if batch is None and not queue and self.wait_for_grammars:
                batch = self._schedule_once_grammars_compile()
            if batch is not None:
                queue.appendleft(batch)
                self.last_step_ran = True
                if len(queue) < self.batch_queue_size:
                    return self._outputs([])
        if not queue:
            return self._outputs([])
        self.last_step_ran = True
        return self._outputs(self._update(queue.pop()))

    def _outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """A step's outputs, plus a notice for each request that has newly waited past
        `long_wait_warning_s` (long_wait.py), and the end of each whose grammar failed."""
        outputs.extend(self.long_waits.check(self.scheduler, time.time()))
        outputs.extend(self._grammar_failures())
        return EngineCoreOutputs(outputs=outputs, timestamp=time.time())

    def _grammar_failures(self) -> list[EngineCoreOutput]:
        """Requests whose grammar did not compile (the front end checks what it can cheaply;
        this is what only the compile finds), ended with `abort` and logged: the engine goes on."""
        failed, self.scheduler.grammar_failed = self.scheduler.grammar_failed, []
        outputs = []
        for request in failed:
            logger.error(
                "request %s aborted: its grammar did not compile: %s",
                request.request_id, request.structured_output.error,
            )  # fmt: skip
            self.request_links.pop(request.request_id, None)
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason="abort",
                    events=request.events.report(time.time(), False, True),
                )
            )
        return outputs

    def _schedule_once_grammars_compile(self) -> _Batch | None:
        """Nothing could be scheduled: wait for the grammars still compiling, one at a time, and
        schedule again, until a step runs or no request waits for its grammar."""
        while True:
            compiling = [
                r.structured_output.grammar
                for r in self.scheduler.waiting
                if r.status == RequestStatus.WAITING_FOR_GRAMMAR
            ]
            if not compiling:
                return None
            wait(compiling, return_when=FIRST_COMPLETED)
            batch = self._schedule()
            if batch is not None:
                return batch

    def _schedule(self) -> _Batch | None:
        """Schedule a step and send it to the executor (without waiting, under async
        scheduling), in its step span: open until `_update`, so that with async scheduling it
        overlaps the step before it."""
        t0 = time.time_ns()
        scheduler_output = self.scheduler.schedule()
        t1 = time.time_ns()
        if not (scheduler_output.total_num_scheduled_tokens or scheduler_output.preempted_req_ids):
            return None
        structured = self.scheduler.structured_requests_sampling(scheduler_output)
        if structured:
            scheduler_output.structured_output_request_ids = [r.request_id for r in structured]
            scheduler_output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                [r.structured_output for r in structured]
            )
        t2 = time.time_ns()
        span = step_span(step=scheduler_output.step, start_ns=t0)
        with span.attached():
            ended_child_span(names.SCHEDULE, t0, t1)
            if structured:
                ended_child_span(names.GRAMMAR_BITMASK, t1, t2)
            span.record(
                self.scheduler.last_stats,
                scheduler_output.num_scheduled_tokens,
                links=self.request_links,
                kv_total_blocks=self.num_kv_blocks,
            )
            execute = child_span(names.EXECUTE)
            with execute.attached():
                if self.async_scheduling:
                    runner_output = self.executor.execute_model(scheduler_output, non_block=True)
                else:
                    runner_output = _done(self.executor.execute_model(scheduler_output))
        return _Batch(scheduler_output, runner_output, span, execute)

    def _update(self, batch: _Batch) -> list[EngineCoreOutput]:
        """Wait for a step's output, then update the scheduler from it; ends the step's span."""
        with batch.span:
            with batch.execute:
                runner_output = batch.runner_output.result()
            with child_span(names.UPDATE):
                outputs = self.scheduler.update_from_output(batch.scheduler_output, runner_output)
        self._observe_step(batch.scheduler_output.total_num_scheduled_tokens, outputs)
        return outputs

    def _observe_step(self, num_tokens: int, outputs: list[EngineCoreOutput]) -> None:
        """Step statistics (tokens, crossing time); finished requests need no step link."""
        if num_tokens:
            self.step_tokens.observe(num_tokens)
        if self.executor.last_crossing_seconds is not None:
            self.crossing_seconds.append(self.executor.last_crossing_seconds)
        for out in outputs:
            if out.finish_reason is not None:
                self.request_links.pop(out.request_id, None)

    def flush_traces(self) -> bool:
        """Export every span this process and its workers have ended so far."""
        self.executor.flush_traces()
        return flush_tracing()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def get_config(self) -> list[EngineConfig]:
        """The configuration as it arrived in each process: this engine core's, then each
        worker rank's."""
        return [self.config, *self.executor.worker_configs()]

    def get_stats(self) -> dict:
        """Counters for /metrics and the dashboard."""
        s, kv = self.scheduler, self.kv_cache_manager
        return {
            "trace_spans_dropped": dropped_spans(),  # by this process's exporters
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_waiting_by_reason": self._waiting_by_reason(),
            "kv_cache_usage": kv.usage,
            "num_kv_blocks": self.num_kv_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "prefix_queries": kv.prefix_queries,
            "prefix_hits": kv.prefix_hits,
            "num_preemptions": s.num_preemptions,
            "num_steps": s.step_index,
            "num_busy_steps": self.step_tokens.count,
            "step_tokens_counts": self.step_tokens.counts,
            "step_tokens_sum": self.step_tokens.total,
            **(
                {"crossing_median_s": statistics.median(self.crossing_seconds)}
                if self.crossing_seconds
                else {}
            ),
        }

    def _waiting_by_reason(self) -> dict[str, int]:
        """How many waiting requests each reason held back at the latest step: first come,
        first served, the head's reason holds back all of them (explain.py reads the same).
        Those that left the queue since are not counted; those that arrived since wait for the
        running step and have no reason yet."""
        s = self.scheduler
        stats = s.last_stats
        held = min(stats.num_waiting, len(s.waiting))
        return {reason: held if reason == stats.waiting_reason else 0 for reason in WAITING_REASONS}

    def processes(self) -> list[ProcessInfo]:
        """This process (the engine core) and the worker processes of a multiprocess executor
        (none when the worker runs in here)."""
        dp = self.config.parallel_config.data_parallel_rank
        workers = [
            ProcessInfo(role, rank, pid, dp) for role, rank, pid in self.executor.processes()
        ]
        return [ProcessInfo("engine_core", dp, os.getpid(), dp), *workers]

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()
