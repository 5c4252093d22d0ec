"""The offline entry point: `LLM(...).generate(prompts, params)` (the whole request path in one
process, with an in-process engine-core client and no ZMQ boundary).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from stepscope.engine.config import EngineConfig
from stepscope.engine.core.engine_core import EngineCore
from stepscope.engine.frontend.core_client import InprocClient, SyncMPClient
from stepscope.engine.frontend.detokenizer import IncrementalDetokenizer
from stepscope.engine.frontend.input_processor import InputProcessor, PromptType
from stepscope.engine.messages import EngineCoreOutput, ProcessInfo
from stepscope.engine.models.loader import DEFAULT_MODEL, load_config, load_tokenizer, resolve_model
from stepscope.engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    prompt_logprobs_of,
)
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import names
from stepscope.traces.collector import (
    CollectorClient,
    start_collector_process,
    stop_collector_process,
)
from stepscope.traces.setup import (
    DuckDBSpanExporter,
    flush_tracing,
    init_process_tracing,
    init_tracing,
    shutdown_tracing,
)
from stepscope.traces.spans import NOOP, request_span

Conversation = list[dict[str, str]]


@dataclass(slots=True)
class _Child:
    """One of the n completions of a request, as the engine core runs it."""

    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None
    span: Any = NOOP  # the request's `stepscope.request` span
    prompt_logprobs: list[dict[int, float] | None] | None = None


class LLM:
    """Offline inference. The engine core runs in this process (`executor="uni"`)."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        device: str = "cpu",
        dtype: str = "float32",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        max_model_len: int | None = None,
        kv_cache_memory_fraction: float | None = None,
        attention_backend: str | None = None,
        seed: int = 0,
        executor: str = "uni",
        tensor_parallel_size: int = 1,
        trace_db: str | os.PathLike[str] | None = None,
        otlp_endpoint: str | None = None,
        trace_steps: str = "all",
    ) -> None:
        self.config = EngineConfig(
            model=model,
            device=device,
            dtype=dtype,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            max_model_len=max_model_len,
            kv_cache_memory_fraction=kv_cache_memory_fraction,
            attention_backend=attention_backend,
            seed=seed,
            offline=True,
            executor=executor,
            tensor_parallel_size=tensor_parallel_size,
            otlp_endpoint=otlp_endpoint,
            trace_steps=trace_steps,
        )
        self.model_dir = resolve_model(model)
        self.trace_db = None if trace_db is None else Path(trace_db)
        self._trace_store = None
        self._collector = None
        self._tracing = self._start_tracing()
        self.tokenizer = load_tokenizer(self.model_dir)
        # "uni": the engine core runs right here; "mp": in its own process, over ZMQ.
        if executor == "uni":
            self.client: InprocClient | SyncMPClient = InprocClient(self.config, self.model_dir)
        else:
            self.client = SyncMPClient(self.config, self.model_dir)
        self.processor = InputProcessor(
            self.tokenizer,
            self.client.max_model_len,
            load_config(self.model_dir)["vocab_size"],
        )
        self._ids = itertools.count()

    def _start_tracing(self) -> bool:
        """In-process, this process writes the trace file itself; with executor="mp" a collector
        process owns it and every process (this one too) sends it spans."""
        cfg = self.config
        if self.trace_db is None and cfg.otlp_endpoint is None:
            return False
        if self.trace_db is not None:
            self.trace_db.parent.mkdir(parents=True, exist_ok=True)
        if cfg.executor == "uni":
            exporters = []
            if self.trace_db is not None:
                exporter = DuckDBSpanExporter(self.trace_db)
                self._trace_store = exporter.store
                exporters.append(exporter)
            init_tracing(
                names.SERVICE_OFFLINE,
                exporters=exporters,
                otlp_endpoint=cfg.otlp_endpoint,
                trace_steps=cfg.trace_steps,
            )
            return True
        if self.trace_db is not None:
            self._collector, cfg.collector_endpoint = start_collector_process(str(self.trace_db))
        init_process_tracing(
            names.SERVICE_API,
            collector_endpoint=cfg.collector_endpoint,
            otlp_endpoint=cfg.otlp_endpoint,
            trace_steps=cfg.trace_steps,
        )
        return True

    def query_traces(self, sql: str) -> pd.DataFrame:
        """Run SQL on this LLM's trace (the `spans` table and its views) while it runs."""
        if self.trace_db is None:
            raise ValueError("this LLM records no trace: pass trace_db=PATH")
        flush_tracing()
        if self._trace_store is not None:
            return self._trace_store.df(sql)
        self.client.call_utility("flush_traces")  # the engine core and its workers
        client = CollectorClient(self.config.collector_endpoint)
        client.flush()
        return client.df(sql)

    # ---- public API -------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        token_lists = [self.processor.tokenize(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(texts, token_lists, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [self.processor.apply_chat_template(list(c)) for c in conversations]
        texts = [self.tokenizer.decode(t) for t in token_lists]
        return self._run(texts, token_lists, sampling_params, use_tqdm, texts_are_prompts=False)

    @property
    def engine_core(self) -> EngineCore:
        """The in-process engine core (executor="uni" only), for inspection."""
        if not isinstance(self.client, InprocClient):
            raise AttributeError("the engine core runs in another process with executor='mp'")
        return self.client.core

    def reset_prefix_cache(self) -> bool:
        return self.client.call_utility("reset_prefix_cache")

    def get_stats(self) -> dict[str, float]:
        return self.client.call_utility("get_stats")

    def processes(self) -> list[ProcessInfo]:
        """Every process serving this LLM: role ("api", "engine_core", "worker"), rank, pid."""
        return self.client.processes()

    def shutdown(self) -> None:
        """Stop the engine's processes; flush the trace and close its file."""
        self.client.shutdown()
        if self._tracing:
            self._tracing = False
            shutdown_tracing()
            self._trace_store = None
        if self._collector is not None:
            stop_collector_process(self._collector)
            self._collector = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- the loop -----------------------------------------------------------------------------
    def _run(
        self,
        texts: list[str | None],
        token_lists: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        texts_are_prompts: bool = True,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(token_lists)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(token_lists):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(token_lists)} prompts"
                )
        # Validate everything before the first request enters the engine: all or nothing.
        request_ids = [str(next(self._ids)) for _ in token_lists]
        core_requests = []
        children: dict[str, tuple[int, _Child]] = {}
        results: list[list[_Child]] = []
        for i, (rid, tokens, params) in enumerate(
            zip(request_ids, token_lists, params_list, strict=True)
        ):
            kids = []
            for k in range(params.n):
                child_params = params
                if params.n > 1:
                    seed = None if params.seed is None else params.seed + k
                    child_params = _replace(params, n=1, seed=seed)
                child_id = rid if params.n == 1 else f"{rid}-{k}"
                core_requests.append(self.processor.process(child_id, tokens, child_params))
                child = _Child(k, IncrementalDetokenizer(self.tokenizer, tokens, child_params))
                kids.append(child)
                children[child_id] = (i, child)
            results.append(kids)
        operation = names.OPERATION_TEXT_COMPLETION if texts_are_prompts else names.OPERATION_CHAT
        for req in core_requests:
            _, child = children[req.request_id]
            child.span = request_span(
                req.request_id,
                model=self.config.model,
                operation=operation,
                max_tokens=req.sampling_params.max_tokens,
                temperature=req.sampling_params.temperature,
                top_p=req.sampling_params.top_p,
                input_tokens=len(req.prompt_token_ids),
                server=False,
                start_ns=int(req.arrival_time * 1e9),
            )
            with child.span.current():
                self.client.add_request(req)
        pending = set(children)
        bar = tqdm(total=len(children), desc="generate", disable=not use_tqdm)
        try:
            while pending:
                for out in self.client.get_output().outputs:
                    _, child = children[out.request_id]
                    if self._absorb(child, out):
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            if not isinstance(self.client, SyncMPClient) or self.client.dead_reason is None:
                self.client.abort_requests(list(pending))
            raise
        finally:
            bar.close()
            for _, child in children.values():
                child.span.end()
        return [
            self._request_output(rid, texts[i], token_lists[i], results[i])
            for i, rid in enumerate(request_ids)
        ]

    def _absorb(self, child: _Child, out: EngineCoreOutput) -> bool:
        """Take one step's output for a child; True once it has finished."""
        for lp in out.new_logprobs:
            child.logprobs.append(dict(zip(lp.token_ids, lp.logprobs, strict=True)))
        if child.metrics is None:
            child.metrics = RequestMetrics(arrival_time=out.events.get("queued", 0.0))
        m = child.metrics
        m.update(out.events, out.num_cached_tokens, out.num_preemptions)
        if out.prompt_logprobs:
            child.prompt_logprobs = prompt_logprobs_of(out.prompt_logprobs)
        child.span.observe(out)
        finished = out.finish_reason is not None
        stop = child.detokenizer.update(out.new_token_ids, finished)
        if stop is not None and not finished:
            # A stop string is found here, not in the engine core: end the request there too.
            self.client.abort_requests([out.request_id])
        if stop is not None:
            child.finish_reason, child.stop_reason = "stop", stop
        elif finished:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
        if child.finish_reason is not None:
            m.finished_time = out.events.get("finished", time.time())
            child.span.finish(
                output_tokens=len(child.detokenizer.token_ids), finish_reasons=[child.finish_reason]
            )
            child.span.end()
            return True
        return False

    @staticmethod
    def _request_output(
        rid: str, prompt: str | None, prompt_ids: list[int], kids: list[_Child]
    ) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=c.index,
                text=c.detokenizer.output_text,
                token_ids=c.detokenizer.token_ids,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                logprobs=c.logprobs or None,
            )
            for c in kids
        ]
        metrics = kids[0].metrics
        return RequestOutput(
            request_id=rid,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            outputs=outputs,
            finished=True,
            metrics=metrics,
            num_cached_tokens=metrics.num_cached_tokens if metrics else 0,
            children_metrics=[c.metrics for c in kids if c.metrics],
            prompt_logprobs=next((c.prompt_logprobs for c in kids if c.prompt_logprobs), None),
        )


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, **changes)
