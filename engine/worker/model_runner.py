"""The model runner: per-request state kept across steps, input preparation, forward, sampling
(worker, stage 6). It applies the scheduler's diffs and knows nothing of queues.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

from stepscope.engine.config import EngineConfig
from stepscope.engine.core.kv_cache_utils import kv_cache_groups_for, kv_cache_layout, kv_group_size
from stepscope.engine.layers.attention import AttentionMetadata, SeqInfo, make_attention_backend
from stepscope.engine.messages import ModelRunnerOutput, PromptLogprobs, SchedulerOutput
from stepscope.engine.models.config import read_model_shape
from stepscope.engine.models.loader import load_weights, resolve_config
from stepscope.engine.models.registry import model_class
from stepscope.engine.sampling_params import SamplingParams
from stepscope.engine.worker.sampler import Sampler, apply_grammar_bitmask
from stepscope.traces import names
from stepscope.traces.spans import child_span

CPU_KV_CACHE_MAX_BYTES = 2 * 2**30  # default cap of the CPU KV pool, as vLLM's CPU backend caps it
PROMPT_SCORING_ROWS = 256  # prompt positions scored at once (256 x vocab float32 logits)


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    block_ids: list[list[int]]  # its block table in each KV cache group
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    num_prompt_tokens: int = 0


@dataclass(slots=True)
class _Batch:
    """One step's inputs, flattened across requests."""

    order: list[str]  # request ids in batch order
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metas: list[AttentionMetadata]  # one per KV cache group: its slots and block tables
    sample_rows: list[int]  # flat row of the last token of each request that samples
    sample_states: list[CachedRequestState]
    # Requests that score their prompt: (state, flat row of the chunk's first token, its position)
    prompt_scoring: list[tuple[CachedRequestState, int, int, int]]


def available_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux's madvise advice: back this range with transparent huge pages


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back the whole 2 MiB pages inside t's memory with huge pages (advice, not a
    guarantee: it needs transparent huge pages in "madvise" or "always" mode). True if the
    advice was taken; False elsewhere, or for a tensor too small to hold a whole huge page."""
    global _libc
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return _libc.madvise(start, end - start, MADV_HUGEPAGE) == 0


_libc: ctypes.CDLL | None = None


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_dir,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce=None,
    ) -> None:
        # A no-op where the front end resolved "auto" already.
        self.config = config = resolve_config(config, model_dir)
        m = config.model_config
        self.device = torch.device(m.device)
        self.dtype = m.torch_dtype
        self.block_size = config.cache_config.block_size
        self.shape = read_model_shape(model_dir)
        self.attn = make_attention_backend(m.attention_backend, self.block_size, self.device)
        weights = load_weights(model_dir, m.quantization)
        self.model = model_class(self.shape)(
            self.shape, weights, self.attn, self.device, self.dtype, tp_rank, tp_size, all_reduce,
            quantized_max_tokens=m.quantized_max_tokens, fused_decode=m.fused_decode,
        )  # fmt: skip
        self.tp_size = tp_size
        self.num_kv_heads = self.shape.num_kv_heads // tp_size
        # The engine core forms the same groups from the same shape (engine/core/kv_cache_utils).
        groups = kv_cache_groups_for(
            self.shape, config.cache_config.disable_hybrid_kv_cache_manager
        )
        self.num_kv_groups = len(groups)
        self.kv_group_size = kv_group_size(groups)
        self.kv_group_of_layer, self.kv_pair_of_layer = kv_cache_layout(
            groups, self.shape.num_layers
        )
        self.sampler = Sampler(self.device, m.seed, cpu_kernels=self.attn.name == "cpu")
        self.requests: dict[str, CachedRequestState] = {}
        # Kept between steps for the grammar mask (apply_grammar_bitmask): grown, never shrunk.
        self._grammar_scratch: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- KV cache memory -----------------------------------------------------------------------
    def kv_block_bytes(self) -> int:
        """Bytes of one pool block: keys and values of a group's layers (every layer, with one
        group)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        s = self.shape
        return 2 * self.kv_group_size * self.block_size * self.num_kv_heads * s.head_dim * elem

    def determine_num_kv_blocks(self) -> int:
        cache, p = self.config.cache_config, self.config.parallel_config
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        fraction = cache.kv_cache_memory_fraction
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * (fraction or 0.85))
        else:
            avail = available_memory_bytes()
            budget = int(avail * fraction) if fraction else min(CPU_KV_CACHE_MAX_BYTES, avail // 4)
            # Every TP worker of every DP rank on this CPU shares this host's memory.
            budget //= p.tensor_parallel_size_local * p.data_parallel_ranks_here
        return max(budget // self.kv_block_bytes(), 1)

    def init_kv_cache(self, num_blocks: int) -> None:
        """One (keys, values) pair per layer of a KV cache group; layer l uses the pair of its
        place in its group (every layer its own pair, with one group), as each pool block
        belongs to one group at a time."""
        s = self.shape
        shape = (num_blocks, self.block_size, self.num_kv_heads, s.head_dim)
        # Zeroed, not empty: padded key slots are read (then masked), and garbage could be NaN.
        pairs = [
            (self._zeroed_cache(shape), self._zeroed_cache(shape))
            for _ in range(self.kv_group_size)
        ]
        self.kv_caches = [pairs[j] for j in self.kv_pair_of_layer]

    def _zeroed_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One layer's keys or values, zeroed. On a CPU, on 2 MiB pages where Linux gives them:
        decode attention reads blocks scattered over the whole pool, and on 4 KiB pages nearly
        every block costs a TLB miss or three (float32 decode read 10-20% more GB/s of cold
        cache on huge pages, docs/benchmarks.md). The advice must come before the first touch."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        cache = torch.empty(shape, dtype=self.dtype)
        advise_huge_pages(cache)
        return cache.zero_()

    # ---- one step --------------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            gen = None
            if new.sampling_params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(new.sampling_params.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id,
                list(new.token_ids),
                [list(ids) for ids in new.block_ids_by_group()],
                new.num_computed_tokens,
                new.sampling_params,
                gen,
                new.num_prompt_tokens,
            )
        cached = so.scheduled_cached_reqs
        for i, (req_id, num_computed) in enumerate(
            zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        ):
            state = self.requests[req_id]
            for table, new_blocks in zip(
                state.block_ids, cached.new_block_ids_by_group(i), strict=True
            ):
                table.extend(new_blocks)
            state.num_computed_tokens = num_computed

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        with child_span(names.PREPARE_INPUTS):
            self._update_states(so)
            batch = self._prepare_inputs(so)
        if batch is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        with child_span(names.FORWARD):  # the model, to the logits of the rows that sample
            hidden = self.model.forward(
                batch.input_ids, batch.positions, self.kv_caches, batch.metas,
                self.kv_group_of_layer,
            )  # fmt: skip
            logits = None
            if batch.sample_rows:
                rows = torch.tensor(batch.sample_rows, device=self.device)
                logits = self.model.compute_logits(hidden[rows])
        with child_span(names.SAMPLE):
            if so.grammar_bitmask and logits is not None:
                with child_span(names.APPLY_GRAMMAR_BITMASK):
                    self._apply_grammar(logits, batch.sample_states, so)
            return self._sample(batch, hidden, logits)

    def _prepare_inputs(self, so: SchedulerOutput) -> _Batch | None:
        """Flatten the scheduled tokens of every request into one batch: decodes first, then
        prefill chunks, each sorted by context length, so that attention pads requests of
        similar length together (contiguous rows)."""
        order = [r.req_id for r in so.scheduled_new_reqs] + so.scheduled_cached_reqs.req_ids
        order.sort(
            key=lambda r: (
                so.num_scheduled_tokens[r] > 1,
                self.requests[r].num_computed_tokens + so.num_scheduled_tokens[r],
            )
        )
        if not order:
            return None
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[list[np.ndarray]] = [[] for _ in range(self.num_kv_groups)]  # per group
        seqs: list[list[SeqInfo]] = [[] for _ in range(self.num_kv_groups)]
        sample_rows: list[int] = []  # flat row of the last token of each request that samples
        sample_states: list[CachedRequestState] = []
        prompt_scoring: list[tuple[CachedRequestState, int, int, int]] = []
        for req_id in order:
            st = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            # Rows at positions p < prompt length - 1 predict prompt token p + 1.
            scored_end = min(end, st.num_prompt_tokens - 1)
            if st.sampling_params.prompt_logprobs is not None and start < scored_end:
                prompt_scoring.append((st, len(input_ids), start, scored_end))
            input_ids.extend(st.token_ids[start:end])
            pos = np.arange(start, end)
            positions.append(pos)
            for g, table in enumerate(st.block_ids):
                slots[g].append(np.asarray(table)[pos // bs] * bs + pos % bs)
                seqs[g].append(SeqInfo(n, end, table))
            st.num_computed_tokens = end
            if end == len(st.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_states.append(st)
        dev = self.device
        metas = [
            self.attn.build_metadata(
                group_seqs, torch.from_numpy(np.concatenate(group_slots).astype(np.int64))
            )
            for group_seqs, group_slots in zip(seqs, slots, strict=True)
        ]
        return _Batch(
            order=order,
            input_ids=torch.tensor(input_ids, dtype=torch.long).to(dev),
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            metas=metas,
            sample_rows=sample_rows,
            sample_states=sample_states,
            prompt_scoring=prompt_scoring,
        )

    def _apply_grammar(
        self, logits: torch.Tensor, states: list[CachedRequestState], so: SchedulerOutput
    ) -> None:
        """Mask the logits of the structured requests that sample in this step with the rows of
        the step's grammar bitmask (built by the engine core, one row per request id)."""
        ids = so.structured_output_request_ids
        words = torch.frombuffer(bytearray(so.grammar_bitmask), dtype=torch.int32)
        bitmask = words.view(len(ids), -1)
        row_of = {st.req_id: i for i, st in enumerate(states)}
        masked = [j for j, req_id in enumerate(ids) if req_id in row_of]
        rows = torch.tensor([row_of[ids[j]] for j in masked], device=logits.device)
        scratch = self._grammar_scratch
        if scratch is None or scratch.shape[0] < len(masked) or scratch.dtype != logits.dtype:
            shape = (max(len(masked), 16), logits.shape[1])
            scratch = torch.empty(shape, dtype=logits.dtype, device=logits.device)
            self._grammar_scratch = scratch
        apply_grammar_bitmask(logits, bitmask[masked], rows, scratch)

    def _sample(
        self, batch: _Batch, hidden: torch.Tensor, logits: torch.Tensor | None
    ) -> ModelRunnerOutput:
        sampled: dict[str, list[int]] = {}
        lp_ids: dict[str, list[int]] = {}
        lps: dict[str, list[float]] = {}
        if logits is not None:
            states = batch.sample_states
            out = self.sampler(
                logits,
                [st.sampling_params for st in states],
                [st.generator for st in states],
                # Prompt and output so far (after a preemption too): what penalties count.
                [st.token_ids for st in states],
                [st.num_prompt_tokens for st in states],
            )
            for i, (st, token) in enumerate(zip(states, out.token_ids, strict=True)):
                st.token_ids.append(token)
                sampled[st.req_id] = [token]
                if i in out.logprobs:
                    lp_ids[st.req_id] = out.logprob_token_ids[i]
                    lps[st.req_id] = out.logprobs[i]
        return ModelRunnerOutput(
            req_ids=batch.order,
            sampled_token_ids=[sampled.get(r, []) for r in batch.order],
            logprob_token_ids=lp_ids,
            logprobs=lps,
            prompt_logprobs={
                st.req_id: self._score_prompt(hidden, st, row, start, end)
                for st, row, start, end in batch.prompt_scoring
            },
        )

    def _score_prompt(
        self, hidden: torch.Tensor, st: CachedRequestState, row: int, start: int, end: int
    ) -> PromptLogprobs:
        """Logprobs of prompt tokens start + 1 .. end, from the rows at positions start .. end - 1
        (flat rows from `row`), with each position's top-N; in slices, as a vocabulary-wide
        row of float32 logits per token adds up fast."""
        top_n = st.sampling_params.prompt_logprobs
        targets = torch.tensor(st.token_ids[start + 1 : end + 1], device=self.device)
        ids: list[list[int]] = []
        lps: list[list[float]] = []
        for a in range(0, end - start, PROMPT_SCORING_ROWS):
            b = min(a + PROMPT_SCORING_ROWS, end - start)
            logprobs = self.model.compute_logits(hidden[row + a : row + b]).log_softmax(dim=-1)
            own = logprobs.gather(1, targets[a:b, None])
            if top_n:
                top_vals, top_idx = logprobs.topk(top_n, dim=-1)
                own_ids = torch.cat([targets[a:b, None], top_idx], dim=1)
                own = torch.cat([own, top_vals], dim=1)
            else:
                own_ids = targets[a:b, None]
            ids += own_ids.tolist()
            lps += own.tolist()
        return PromptLogprobs(start + 1, ids, lps)
