"""Structured outputs in the engine core: each request's grammar compiled, its matcher advanced
by the tokens it accepts, and the token bitmask of a step built (stages 3, 4 and 8 of
docs/request-path.md), as vLLM V1's `vllm/v1/structured_output/` does it (`StructuredOutputManager`
in `__init__.py`, `backend_xgrammar.py`, `request.py`), with xgrammar as the one backend.

A request that asks for a grammar is queued at once, but it waits (`WAITING_FOR_GRAMMAR`, vLLM's
`WAITING_FOR_FSM`) until its grammar has compiled on this manager's thread pool; the scheduler
skips it meanwhile, so nobody else waits on a compile (xgrammar releases the GIL while it
compiles). Compiled grammars are kept by (kind, spec): the n children of one request, or many
requests with one schema, compile once. At each step the engine core asks for the bitmask of the
structured requests that sample in it: one row of `ceil(vocab / 32)` int32 words per request, a
set bit for each token the grammar allows next; it crosses to the worker in `SchedulerOutput`,
and the worker masks the logits with it before sampling (engine/worker/sampler.py).

xgrammar (and the tokenizer it reads) load on the pool at the first structured request, so an
engine that never sees one never imports it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepscope.engine.sampling_params import (
    StructuredOutputsParams,
    grammar_error,
    json_schema_for_xgrammar,
)

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse; the oldest finished one goes when a new one would pass this.
GRAMMAR_CACHE_SIZE = 256


def choice_as_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are `choices`, each as an escaped string literal."""

    def literal(text: str) -> str:
        escaped = text.replace("\\", "\\\\").replace('"', '\\"')
        return '"' + escaped.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t") + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


def grammar_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, spec): what is compiled, and the key of the compiled grammar's cache."""
    kind = params.kind
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        return kind, choice_as_ebnf(params.choice or [])
    return kind, getattr(params, kind)


@dataclass(slots=True, eq=False)
class StructuredOutputRequest:
    """One request's grammar: compiling (`grammar` not done), failed (its exception), or ready,
    with the matcher that follows the tokens the request has accepted."""

    grammar: Future[tuple[Any, float]]  # (xgrammar.CompiledGrammar, time.time() it finished)
    matcher: Any = None  # xgrammar.GrammarMatcher, made once the grammar is ready

    @property
    def error(self) -> str | None:
        """Why the grammar could not be compiled; None while compiling or once compiled."""
        if not self.grammar.done() or self.grammar.exception() is None:
            return None
        return grammar_error(self.grammar.exception())

    def ready(self) -> bool:
        """True once the grammar compiled (the matcher is made by the first call that sees it)."""
        if self.matcher is not None:
            return True
        if not self.grammar.done() or self.grammar.exception() is not None:
            return False
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(self.grammar.result()[0])
        return True

    @property
    def compiled_time(self) -> float:
        """When the grammar finished compiling (time.time()); only once `ready()`."""
        return self.grammar.result()[1]

    def accept(self, token: int) -> bool:
        """Advance the matcher by one sampled token; True when the grammar has ended (its stop
        token accepted). A token the grammar refuses means the mask was not applied: a bug."""
        if not self.matcher.accept_token(token):
            logger.error("the grammar refused sampled token %d: was its bitmask applied?", token)
        return self.matcher.is_terminated()


# Added to the compile threads' nice value. On a machine with few cores a compile takes a core
# the forward's threads were using: measured on 2 cores (docs/benchmarks.md), 16 plain streams'
# inter-token latency rose from 58 to 181 ms while a 2,000-property schema compiled at the
# engine core's priority, and stayed at 67 ms with this (the compile took 9.2 s instead of 5.2).
COMPILE_NICENESS = 10


def _lower_priority() -> None:
    """Lower this pool thread's priority by COMPILE_NICENESS (Linux gives each thread its own
    nice value; elsewhere, or where it is refused, the thread keeps the process's)."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, nice + COMPILE_NICENESS))


class StructuredOutputManager:
    """Compiles grammars on a thread pool and builds the bitmask of each step (one per engine
    core: each DP rank has its own). `on_compiled` is called, on a pool thread, as each compile
    ends: the engine-core process wakes its busy loop with it."""

    def __init__(
        self,
        model_dir: Path,
        tokenizer: str | None,
        vocab_size: int,
        on_compiled: Callable[[], None] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: the logits' width, not the tokenizer's length
        self.on_compiled = on_compiled
        # Half the cores, as vLLM sizes its pool: compiles must not starve the forward.
        self.num_threads = max(1, min((os.cpu_count() or 2) // 2, 8))
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._grammars: dict[tuple[str, str], Future[tuple[Any, float]]] = {}
        self._bitmask: Any = None  # torch int32 [rows, words], grown as needed

    # ---- compiling ------------------------------------------------------------------------------
    def start(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Begin (or reuse) the compile of this grammar; the request waits until `ready()`."""
        key = grammar_key(params)
        future = self._grammars.get(key)
        if future is None or (future.done() and future.exception() is not None):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.num_threads, thread_name_prefix="grammar", initializer=_lower_priority
                )
            future = self._pool.submit(self._compile, *key)
            if self.on_compiled is not None:
                future.add_done_callback(lambda _: self.on_compiled())
            self._remember(key, future)
        return StructuredOutputRequest(future)

    def _remember(self, key: tuple[str, str], future: Future[tuple[Any, float]]) -> None:
        self._grammars[key] = future
        if len(self._grammars) > GRAMMAR_CACHE_SIZE:
            oldest = next((k for k, f in self._grammars.items() if f.done()), None)
            if oldest is not None:
                del self._grammars[oldest]

    def _compile(self, kind: str, spec: str) -> tuple[Any, float]:
        compiler = self._get_compiler()
        if kind == "json":
            # No unbounded whitespace (vLLM's disable_any_whitespace): a small model could
            # otherwise pad a JSON value with blanks up to its token limit.
            schema = json_schema_for_xgrammar(spec)  # length bounds as patterns (see there)
            grammar = compiler.compile_json_schema(schema, any_whitespace=False)
        elif kind == "json_object":
            # Any JSON object (not any JSON value, as xgrammar's built-in JSON grammar allows),
            # with the same bounded whitespace: vLLM compiles it this way too.
            grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        elif kind == "regex":
            grammar = compiler.compile_regex(spec)
        else:  # "grammar" (EBNF), and "choice" as EBNF
            grammar = compiler.compile_grammar(spec)
        return grammar, time.time()

    def _get_compiler(self) -> Any:
        """xgrammar's compiler over this model's tokenizer, made by the first compile."""
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                from stepscope.engine.models.loader import load_generation_config, load_tokenizer

                tok = load_tokenizer(self.model_dir, self.tokenizer)
                eos = load_generation_config(self.model_dir).get("eos_token_id")
                stops = {tok.eos_token_id} | ({eos} if isinstance(eos, int) else set(eos or ()))
                info = xgr.TokenizerInfo.from_huggingface(
                    tok,
                    vocab_size=self.vocab_size,
                    stop_token_ids=sorted(s for s in stops if s is not None),
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.num_threads)
            return self._compiler

    # ---- one step -------------------------------------------------------------------------------
    def grammar_bitmask(self, requests: list[StructuredOutputRequest]) -> bytes:
        """The rows of the tokens each request's grammar allows next, in `requests`' order:
        len(requests) x ceil(vocab / 32) little-endian int32 words (bit j of word w: token
        32 w + j)."""
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < len(requests):
            self._bitmask = xgr.allocate_token_bitmask(max(len(requests), 16), self.vocab_size)
        for i, request in enumerate(requests):
            request.matcher.fill_next_token_bitmask(self._bitmask, i)
        return self._bitmask[: len(requests)].numpy().tobytes()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
