"""The offline entry point: `LLM(...).generate(prompts, params)`.

One setting, `executor`, chooses both where the engine core runs and where the worker runs
(vLLM chooses them apart; see docs/request-path.md, section 1). `"uni"` (the default) runs the
whole request path in this process: an in-process engine-core client with the worker inside the
engine core, no ZMQ boundary, as vLLM does with VLLM_ENABLE_V1_MULTIPROCESSING=0. `"mp"` runs the
engine core in its own process over ZMQ (`SyncMPClient`, vLLM's offline default) and one worker
process per tensor-parallel rank.

`data_parallel_size=N` (N > 1) runs N engine cores, each in its own process with its own
scheduler and KV pool, and a DP coordinator process; each request goes to the least-loaded rank.
With `executor="uni"` each rank's worker runs inside its engine core; with `"mp"` each rank has
its own worker processes.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import signal
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from stepscope.engine.config import DEFAULT_MODEL, Endpoints, EngineConfig
from stepscope.engine.core.engine_core import EngineCore
from stepscope.engine.engine_args import check_engine_kwargs
from stepscope.engine.frontend.core_client import InprocClient, SyncMPClient
from stepscope.engine.frontend.frontend import Frontend
from stepscope.engine.frontend.input_processor import PromptType
from stepscope.engine.messages import ProcessInfo
from stepscope.engine.outputs import RequestOutput
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import names
from stepscope.traces import setup as tracing
from stepscope.traces.backend.client import CollectorClient
from stepscope.traces.backend.collector_process import (
    describe_summary,
    start_collector_process,
    stop_collector_process,
)
from stepscope.traces.backend.store import DuckDBSpanExporter
from stepscope.traces.setup import (
    flush_tracing,
    init_process_tracing,
    init_tracing,
    shutdown_tracing,
)

Conversation = list[dict[str, str]]

logger = logging.getLogger(__name__)


class LLM:
    """Offline inference: in this process (`executor="uni"`) or across processes (`"mp"`).

    Keywords are the engine options (`EngineConfig`'s fields by their flat names, the same as
    `stepscope serve`'s flags: `max_num_seqs`, `tensor_parallel_size`, `trace_db`, ...); an
    unknown one is refused with the nearest valid name."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_options: Any) -> None:
        check_engine_kwargs(engine_options)
        config = EngineConfig.create(model=model, offline=True, **engine_options)
        trace_db = config.observability_config.trace_db
        self.trace_db = None if trace_db is None else Path(trace_db)
        self._trace_store = None
        self._collector = None
        self._closed = False
        self._tracing = False
        self.endpoints = Endpoints()
        # One callable per LLM, so that it can be registered again (below).
        self._at_exit = partial(_shutdown_at_exit, weakref.ref(self))
        self._tracing = self._start_tracing(config)
        # "uni" with one DP rank: the engine core runs right here; otherwise in its own
        # processes over ZMQ, sending their spans to this run's collector.
        in_process = _in_process(config)
        self.frontend = Frontend(
            config,
            InprocClient if in_process else partial(SyncMPClient, endpoints=self.endpoints),
        )
        self.config = self.frontend.config
        p = self.config.parallel_config
        if self._tracing and "ray" in (p.data_parallel_backend, p.executor):
            # Ray registered its exit hook as its cluster started, after ours: it would run first
            # and stop the actors before they flush their spans. Ours again, to run before it.
            atexit.unregister(self._at_exit)
            atexit.register(self._at_exit)
        m = self.config.model_config
        logger.info("weights %s; dtype %s (%s)", m.weight_format, m.dtype, m.dtype_reason)
        self.client: InprocClient | SyncMPClient = self.frontend.client
        self.tokenizer = self.frontend.tokenizer
        self.processor = self.frontend.processor
        self._ids = itertools.count()

    def _start_tracing(self, cfg: EngineConfig) -> bool:
        """In-process, this process writes the trace file itself; across processes a collector
        process owns it and every process (this one too) sends it spans.

        However the script ends (returns, raises, Ctrl-C, SIGTERM or SIGHUP where the script
        set no handler of its own), `shutdown` runs at exit: the engine's processes stop and
        flush, then the trace file is closed."""
        otlp, steps = cfg.observability_config.otlp_endpoint, cfg.observability_config.trace_steps
        if self.trace_db is None and otlp is None:
            return False
        _exit_cleanly_on_termination()
        if self.trace_db is not None:
            self.trace_db.parent.mkdir(parents=True, exist_ok=True)
        if _in_process(cfg):
            exporters = []
            if self.trace_db is not None:
                exporter = DuckDBSpanExporter(self.trace_db)
                self._trace_store = exporter.store
                exporters.append(exporter)
            init_tracing(
                names.SERVICE_OFFLINE,
                exporters=exporters,
                otlp_endpoint=otlp,
                trace_steps=steps,
            )
            atexit.register(self._at_exit)
            return True
        if self.trace_db is not None:
            self._collector, url = start_collector_process(str(self.trace_db))
            self.endpoints = Endpoints(collector=url)
        init_process_tracing(
            names.SERVICE_API, collector_endpoint=self.endpoints.collector, otlp_endpoint=otlp,
            trace_steps=steps,
        )  # fmt: skip
        # Registered after the collector's own finalizer: at exit this runs first, and stops
        # the collector last.
        atexit.register(self._at_exit)
        return True

    def query_traces(self, sql: str) -> pd.DataFrame:
        """Run SQL on this LLM's trace (the `spans` table and its views) while it runs."""
        if self.trace_db is None:
            raise ValueError("this LLM records no trace: pass trace_db=PATH")
        flush_tracing()
        if self._trace_store is not None:
            return self._trace_store.df(sql)
        self.client.call_utility("flush_traces")  # the engine core and its workers
        client = CollectorClient(self.endpoints.collector)
        client.flush()
        return client.df(sql)

    # ---- public API -------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: the checkpoint's
        generation_config.json values (temperature, top_p, top_k, repetition_penalty) where it
        sets them, SamplingParams' defaults elsewhere."""
        return self.processor.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        arrival_time = time.time()  # every prompt arrives now, before it is tokenized
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        token_lists = [self.processor.tokenize(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(texts, token_lists, sampling_params, use_tqdm, arrival_time)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        arrival_time = time.time()
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [self.processor.apply_chat_template(list(c)) for c in conversations]
        texts = [self.tokenizer.decode(t) for t in token_lists]
        return self._run(
            texts, token_lists, sampling_params, use_tqdm, arrival_time, texts_are_prompts=False
        )

    @property
    def engine_core(self) -> EngineCore:
        """The in-process engine core (executor="uni", one DP rank), for inspection."""
        if not isinstance(self.client, InprocClient):
            raise AttributeError(
                "the engine core runs in another process (executor='mp' or data_parallel_size > 1)"
            )
        return self.client.core

    def reset_prefix_cache(self) -> bool:
        return self.client.call_utility("reset_prefix_cache")

    def get_stats(self) -> dict[str, float]:
        return self.client.call_utility("get_stats")

    def processes(self) -> list[ProcessInfo]:
        """Every process serving this LLM: role ("api", "dp_coordinator", "engine_core",
        "worker"), rank (DP rank of an engine core, TP rank of a worker), pid and DP rank."""
        return self.client.processes()

    def shutdown(self) -> None:
        """Stop the engine's processes; flush the trace and close its file (the collector
        last, once every other process has flushed), then say how many spans it holds."""
        if self._closed:
            return
        self._closed = True
        client = getattr(self, "client", None)  # None: __init__ failed after tracing started
        if client is not None:
            client.shutdown()
        if not self._tracing:
            return
        self._tracing = False
        state = tracing.state
        shutdown_tracing()
        summary = None
        if self._trace_store is not None and state is not None:
            # In-process: this process wrote the file, and its exporter counted.
            (to_file,) = [p for p in state.processors if p.exports_to(DuckDBSpanExporter)]
            summary = {"spans": to_file.ended - to_file.dropped, "processes": 1,
                       "lost": to_file.dropped, "lost_by": {}, "silent": []}  # fmt: skip
            self._trace_store = None
        if self._collector is not None:
            summary = stop_collector_process(self._collector)
            self._collector = None
        if self.trace_db is not None:
            print(f"stepscope: trace saved to {self.trace_db}: {describe_summary(summary)}",
                  file=sys.stderr, flush=True)  # fmt: skip

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
        arrival_time: float,
        texts_are_prompts: bool = True,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(token_lists)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(token_lists):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(token_lists)} prompts"
                )
        # Validate everything before the first request enters the engine: all or nothing.
        # n > 1 fans out into n engine-core requests, merged back below (as in AsyncLLM).
        frontend = self.frontend
        parents = [
            frontend.make_request(str(next(self._ids)), tokens, params, arrival_time)
            for tokens, params in zip(token_lists, params_list, strict=True)
        ]
        operation = names.OPERATION_TEXT_COMPLETION if texts_are_prompts else names.OPERATION_CHAT
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=sum(len(p.children) for p in parents), desc="generate", disable=not use_tqdm
        )
        try:
            for text, parent in zip(texts, parents, strict=True):
                self.send(parent, operation, text)
            while frontend.output_processor.has_unfinished_requests():
                for out in self.collect():
                    finished[out.request_id] = out
                    bar.update(1)
        except BaseException:
            self.abort_unfinished()
            raise
        finally:
            bar.close()
            frontend.release_all()
        return [parent.merge([finished[i] for i in parent.child_ids]) for parent in parents]

    # ---- the steps of `_run`, for a driver that adds requests as they arrive (trace replay) ----
    def send(self, parent: Any, operation: str, prompt: str | None = None) -> None:
        """Track a request made by `frontend.make_request` and send each of its children to
        the engine core, under the child's span."""
        frontend = self.frontend
        flight = frontend.track(parent, operation=operation, stream=False, prompt=prompt)
        for child, state in zip(parent.children, flight.states, strict=True):
            with state.span.current():
                frontend.sent_to(state, self.client.add_request(child))

    def collect(self) -> list[RequestOutput]:
        """One round of the engine core's outputs, stop strings applied (and the requests they
        stopped aborted): the outputs of the requests that finished."""
        frontend = self.frontend
        processed = frontend.output_processor.process_outputs(self.client.get_output().outputs)
        if processed.reqs_to_abort:
            self.client.abort_requests(processed.reqs_to_abort)
        frontend.delivered(processed.request_outputs)
        return processed.request_outputs

    def abort_unfinished(self) -> None:
        """Forget every request in flight and abort them in the engine core (unless it died)."""
        unfinished = self.frontend.release_all()
        if not isinstance(self.client, SyncMPClient) or self.client.dead_reason is None:
            self.client.abort_requests(unfinished)


def _in_process(config: EngineConfig) -> bool:
    """ "uni" with one DP rank: the engine core runs in this process; else over ZMQ."""
    p = config.parallel_config
    return p.executor == "uni" and p.data_parallel_size == 1


def _shutdown_at_exit(ref: weakref.ref[LLM]) -> None:
    llm = ref()
    if llm is not None:
        llm.shutdown()


def _exit_cleanly_on_termination() -> None:
    """SIGTERM and SIGHUP, where the script set no handler of its own, end it as an exception
    does (atexit hooks run: the trace is saved) rather than on the spot. Ctrl-C already does."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _exit_on_signal)


def _exit_on_signal(signum: int, frame: object) -> None:
    for other in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(other, signal.SIG_IGN)  # let the shutdown run to its end
    raise SystemExit(128 + signum)
