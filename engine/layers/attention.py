"""Attention backends: write this step's K/V into the paged cache, then attend through block
tables (worker forward, stage 6). Each backend also carries the forward's other ops (RMSNorm,
rotary, SiLU-and-mul, engine/layers/ops.py) as `ops`.

- `cpu`, the CPU default: decodes through a C kernel that reads each request's keys and values
  straight from the paged cache, and each prefill chunk through another that attends its cached
  context and its own keys in one causal pass; RMSNorm (with its residual add) and rotary are C
  kernels too (stepscope.kernels.cpu).
- `torch`: the reference, in torch ops only (each request's context gathered, then SDPA).
- `triton`: the kernels in stepscope.kernels (compiled on CUDA, interpreted on CPU), the CUDA
  default.

Every backend takes a sliding window per call (`forward(..., sliding_window=W)`: a query at
position p sees keys p - W + 1 .. p, as transformers' sliding mask): the same metadata serves the
layers with a window and those without. With a window, none reads the blocks wholly before the
first key its queries see: the KV manager may have freed them and left a null block id there.
Each takes attention logit soft-capping too (`logits_soft_cap=c`: scores become
c * tanh(score / c) before the softmax, Gemma 2 and 3's `attn_logit_softcapping`).

The default is picked here, in the worker (`resolve_attention_backend`), not in the config: only
the process that runs the forward builds and loads the C kernels.
"""

from __future__ import annotations

import logging
import os
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from stepscope.engine.layers.attention_groups import (
    PaddedGroup,
    SeqInfo,
    chunk_group,
    fresh_group,
    host_tables,
    is_fresh_prompt,
    padded_group,
    runs_of_fresh_prompts,
)
from stepscope.engine.layers.ops import CpuForwardOps, ForwardOps, TorchForwardOps, TritonForwardOps

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new token's K/V goes
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    groups: list[PaddedGroup]
    num_decodes: int = 0  # the first rows: one query token each
    max_decode_len: int = 0  # the longest context among them
    # The cpu backend's prefill kernel: (request, its first row, its end row, its context_len)
    # for each request after the decodes.
    prefills: list[tuple[int, int, int, int]] = field(default_factory=list)
    seqs: list[SeqInfo] = field(default_factory=list)
    # The torch backend's groups for a sliding window and/or soft-capped scores, by (window,
    # capped): built at the first layer that asks.
    other_groups: dict[tuple[int | None, bool], list[PaddedGroup]] = field(default_factory=dict)


def _attention(q, k, v, mask, scale: float, soft_cap: float | None) -> torch.Tensor:
    """SDPA of [B, H, Q, D] queries over [B, KVH, K, D] keys (mask [B, 1, Q, K] bool; None:
    causal), or with soft-capped scores, cap * tanh(score / cap), which SDPA cannot do: in
    float32 ops, the scores whole."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, 1) for t in (k, v))
    scores = q.float() @ k.transpose(-1, -2) * scale
    scores = soft_cap * torch.tanh(scores / soft_cap)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).to(q.dtype)


def _one_request(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """One request's rows [tokens, heads, D] as SDPA's batch of one, [1, heads, tokens, D]: a
    view, no copy."""
    return t[rows].transpose(0, 1)[None]


class AttentionBackend(ABC):
    """Builds per-step metadata once, then runs attention for every layer with it."""

    name: str
    ops: ForwardOps

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device

    def build_metadata(self, seqs: list[SeqInfo], slot_mapping: torch.Tensor) -> AttentionMetadata:
        query_start_loc, block_tables = host_tables(seqs)
        seq_lens = torch.tensor([s.seq_len for s in seqs], dtype=torch.int32)
        num_decodes = 0  # the leading rows of one query token each
        while num_decodes < len(seqs) and seqs[num_decodes].query_len == 1:
            num_decodes += 1
        groups = self._build_groups(seqs, num_decodes, query_start_loc, block_tables)
        dev = self.device
        return AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            query_start_loc=query_start_loc.to(dev),
            seq_lens=seq_lens.to(dev),
            block_tables=block_tables.to(dev),
            groups=groups,
            num_decodes=num_decodes,
            max_decode_len=max((s.seq_len for s in seqs[:num_decodes]), default=0),
            seqs=seqs,
        )

    def _build_groups(
        self, seqs, num_decodes, query_start_loc, block_tables, window=None, capped=False
    ) -> list[PaddedGroup]:
        """The prefills a backend attends as padded groups (see the torch backend); none here."""
        return []

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # keys a query sees, its own included; None: all
        logits_soft_cap: float | None = None,  # scores become c * tanh(score / c); None: not
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k and v at meta.slot_mapping, then attend causally over each request's context
        (with a window, over its last sliding_window keys)."""


class TorchAttentionBackend(AttentionBackend):
    """Gathers each request's keys through its block table and runs batched SDPA.

    Requests are padded into groups of similar shape: decodes (one query each) apart from
    prefill chunks, and within each, requests of similar context length together, so that a
    long context does not pad every short one to its length. The model runner sorts the batch
    by (prefill, context length), so each group is a contiguous run of rows.
    """

    name = "torch"

    # A group grows while its longest member is at most this many times its first (shortest)
    # member's length: padding wastes under half of its work, and a batch of similar requests
    # still makes one SDPA call.
    MAX_PAD_RATIO = 2.0
    # Below this many tokens of padded work in all, splitting costs more calls than it saves.
    MIN_SPLIT_TOKENS = 4096
    # Groups of whole prompts attend their own keys with a causal SDPA: no gather, no mask.
    CAUSAL_PROMPTS = True
    # On a CPU each whole prompt attends alone, as its rows lie: SDPA's CPU kernel gains nothing
    # from a batch dimension that a prompt's heads and query blocks do not already give it, and
    # padding to the group's longest prompt costs its square. Four to five prompts of 100-768
    # tokens took 1.3-1.8x longer padded into one call than one call each (docs/benchmarks.md).
    FRESH_PROMPTS_ALONE_ON_CPU = True
    # A prompt chunk after cached context, alone in its group, attends that context and its own
    # keys in two SDPA calls without a mask, merged by their log-sum-exps (CPU only: the merge
    # needs the log-sum-exp that only the CPU flash kernel returns). With one mask over both,
    # SDPA computes every (query, key) pair of the chunk's own keys, the masked half included.
    SPLIT_CHUNKS = True
    DECODES_IN_KERNEL = False  # the cpu backend attends decodes in its kernel, not in groups

    def __init__(self, block_size: int, device: torch.device) -> None:
        super().__init__(block_size, device)
        self.ops = TorchForwardOps()
        # Gathered keys and values are written into buffers reused across layers and steps:
        # a fresh multi-MB allocation per layer costs more in page faults than the copy itself.
        self._bufs: dict[str, torch.Tensor] = {}

    def _build_groups(
        self,
        seqs: list[SeqInfo],
        num_decodes: int,
        query_start_loc: torch.Tensor,
        block_tables: torch.Tensor,
        window: int | None = None,
        capped: bool = False,
    ) -> list[PaddedGroup]:
        """The groups of a step, for the layers with a sliding `window` or (None) without, and
        with soft-capped scores or without."""
        if any(s.query_len == 1 for s in seqs[num_decodes:]):
            raise ValueError("decode requests must come before prefills in the batch")
        groups = []
        on_cpu = self.device.type == "cpu"
        # A window masks the cached context too: the split's unmasked half would not hold; and
        # its flash kernel cannot cap scores.
        split_chunks = self.SPLIT_CHUNKS and on_cpu and window is None and not capped
        prompts_alone = self.FRESH_PROMPTS_ALONE_ON_CPU and on_cpu
        bs, dev = self.block_size, self.device
        kinds = ((0, num_decodes), (num_decodes, len(seqs)))
        for kind in kinds[1:] if self.DECODES_IN_KERNEL else kinds:
            for first, last in self._split(seqs, *kind):
                for a, b in runs_of_fresh_prompts(seqs, first, last):
                    rows = seqs[a:b]
                    if self.CAUSAL_PROMPTS and is_fresh_prompt(rows[0]):
                        bounds = [(i, i + 1) for i in range(a, b)] if prompts_alone else [(a, b)]
                        for lo, hi in bounds:
                            groups.append(fresh_group(lo, hi, seqs, query_start_loc, dev, window))
                    elif split_chunks and b - a == 1 and 1 < rows[0].query_len < rows[0].seq_len:
                        groups.append(chunk_group(a, seqs, query_start_loc, block_tables, bs, dev))
                    else:
                        groups.append(
                            padded_group(a, b, seqs, query_start_loc, block_tables, bs, dev, window)
                        )
        return groups

    def _groups(self, meta: AttentionMetadata, window: int | None, capped: bool):
        """meta.groups, or where a window hides some key from some query or scores are capped,
        their own (built at the first layer that asks, then kept in meta)."""
        if window is not None and all(s.seq_len <= window for s in meta.seqs):
            window = None
        if window is None and not capped:
            return meta.groups
        groups = meta.other_groups.get((window, capped))
        if groups is None:
            query_start_loc, block_tables = host_tables(meta.seqs)
            groups = meta.other_groups[window, capped] = self._build_groups(
                meta.seqs, meta.num_decodes, query_start_loc, block_tables, window, capped
            )
        return groups

    def _split(self, seqs: list[SeqInfo], first: int, last: int) -> list[tuple[int, int]]:
        """Cut rows [first, last) into runs whose padded query and key lengths stay within
        MAX_PAD_RATIO of their first row's (the rows come sorted by context length)."""
        if first == last:
            return []
        padded = (last - first) * max(s.query_len * s.seq_len for s in seqs[first:last])
        if padded < self.MIN_SPLIT_TOKENS:
            return [(first, last)]
        runs, start = [], first
        for i in range(first + 1, last):
            head, s = seqs[start], seqs[i]
            if (
                s.seq_len > self.MAX_PAD_RATIO * head.seq_len
                or s.query_len > self.MAX_PAD_RATIO * head.query_len
            ):
                runs.append((start, i))
                start = i
        runs.append((start, last))
        return runs

    def _gather(self, cache: torch.Tensor, which: str, g: PaddedGroup) -> torch.Tensor:
        n = g.kv_blocks.numel()
        block_numel = cache[0].numel()
        buf = self._bufs.get(which)
        if buf is None or buf.dtype != cache.dtype or buf.numel() < n * block_numel:
            buf = self._bufs[which] = torch.empty(
                n * block_numel, dtype=cache.dtype, device=cache.device
            )
        out = buf[: n * block_numel].view(n, *cache.shape[1:])
        torch.index_select(cache, 0, g.kv_blocks, out=out)
        batch = n // g.max_blocks
        # [B, max_blocks * block_size, KVH, D] -> [B, KVH, keys, D]
        return out.view(batch, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)

    def forward(
        self, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None, logits_soft_cap=None
    ):
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        args = (q, k, v, k_cache, v_cache, meta, scale, out)
        self._attend_groups(*args, sliding_window, logits_soft_cap)
        return out

    def _attend_groups(self, q, k, v, k_cache, v_cache, meta, scale, out, window, cap) -> None:
        for g in self._groups(meta, window, cap is not None):
            if g.context_len:
                out[g.rows] = self._attend_chunk(q, k, v, k_cache, v_cache, g, scale)
                continue
            if g.max_blocks == 0:  # whole prompts: their own keys, causally (or a window's mask)
                alone = g.q_index.shape[0] == 1  # one prompt: its rows as they lie, no padding
                if alone:
                    qg, kg, vg = (_one_request(t, g.rows) for t in (q, k, v))
                else:
                    qg, kg, vg = (t[g.q_index].transpose(1, 2) for t in (q, k, v))
                og = _attention(qg, kg, vg, g.mask, scale, cap)
                out[g.rows] = og[0].transpose(0, 1) if alone else og.transpose(1, 2)[g.q_valid]
                continue
            kg = self._gather(k_cache, "k", g)
            vg = self._gather(v_cache, "v", g)
            if g.q_index is None:  # one query per request: [B, H, 1, D]
                qg = q[g.rows][:, :, None, :]
            else:
                qg = q[g.q_index].transpose(1, 2)  # [B, H, Qmax, D]
            og = _attention(qg, kg, vg, g.mask, scale, cap)
            if g.q_index is None:
                out[g.rows] = og[:, :, 0, :]
            else:
                out[g.rows] = og.transpose(1, 2)[g.q_valid]

    def _attend_chunk(self, q, k, v, k_cache, v_cache, g: PaddedGroup, scale: float):
        """softmax over [context keys | own keys] from the two halves: each half's output o_i
        and log-sum-exp l_i of its scores weigh in by exp(l_i - l), l = log(e^l_1 + e^l_2)."""
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        qg = _one_request(q, g.rows)  # [1, H, Q, D]
        kc = self._gather(k_cache, "k", g)[:, :, : g.context_len]  # [1, KVH, context, D]
        vc = self._gather(v_cache, "v", g)[:, :, : g.context_len]
        o_ctx, lse_ctx = flash(qg, kc, vc, 0.0, False, scale=scale)
        kn, vn = (_one_request(t, g.rows) for t in (k, v))
        o_own, lse_own = flash(qg, kn, vn, 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_ctx, lse_own)[..., None]  # [1, H, Q, 1] float32
        o = o_ctx.float() * torch.exp(lse_ctx[..., None] - lse)
        o += o_own.float() * torch.exp(lse_own[..., None] - lse)
        return o[0].transpose(0, 1).to(q.dtype)  # [Q, H, D]


class CpuAttentionBackend(TorchAttentionBackend):
    """Attends through the C kernels, straight from the paged cache: decodes all in one call,
    each prefill chunk in one call of its own.

    A decode reads every key and value of its context once: gathering them into a padded
    batch first, as `torch` does, writes and reads them all a second and a third time, and
    decode attention is bound by that memory traffic. A prefill chunk attends its cached
    context and its own keys in one causal pass (query i at position context_len + i), where
    SDPA needs two calls and a merge after a prefix; its register-tiled products ran 1.3-2x
    faster than SDPA's flash kernel on this CPU (docs/benchmarks.md).
    """

    name = "cpu"
    DECODES_IN_KERNEL = True

    def __init__(self, block_size: int, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError("the cpu attention backend runs on the CPU only")
        super().__init__(block_size, device)
        from stepscope.kernels.cpu import build, ops

        build.load()  # builds the kernels on first use; a missing compiler fails here
        self._decode = ops.decode_attention
        self._prefill = ops.prefill_attention
        self.ops = CpuForwardOps()

    def build_metadata(self, seqs: list[SeqInfo], slot_mapping: torch.Tensor) -> AttentionMetadata:
        meta = super().build_metadata(seqs, slot_mapping)
        rows = meta.query_start_loc.tolist()
        meta.prefills = [
            (i, rows[i], rows[i + 1], s.seq_len - s.query_len)
            for i, s in enumerate(seqs)
            if i >= meta.num_decodes
        ]
        return meta

    def _build_groups(
        self, seqs, num_decodes, query_start_loc, block_tables, window=None, capped=False
    ) -> list[PaddedGroup]:
        return []  # no padded groups: every request goes to a kernel

    def _attend_groups(self, q, k, v, k_cache, v_cache, meta, scale, out, window, cap) -> None:
        nd = meta.num_decodes
        if nd:
            self._decode(
                q[:nd].contiguous(),
                k_cache,
                v_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                scale,
                max_len=meta.max_decode_len,
                out=out[:nd],
                sliding_window=window,
                logits_soft_cap=cap,
            )
        for i, first, last, context_len in meta.prefills:
            self._prefill(
                q[first:last].contiguous(),
                k_cache,
                v_cache,
                meta.block_tables[i],
                context_len,
                scale,
                out=out[first:last],
                sliding_window=window,
                logits_soft_cap=cap,
            )


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels: KV write by slot mapping, then one paged-attention launch for the
    whole mixed batch; the forward's other ops are kernels too."""

    name = "triton"

    def __init__(self, block_size: int, device: torch.device) -> None:
        super().__init__(block_size, device)
        if device.type == "cpu":
            _enable_triton_interpreter()
        from stepscope.kernels.kv_cache_write import write_kv_cache
        from stepscope.kernels.paged_attention import paged_attention

        self._write = write_kv_cache
        self._attend = paged_attention
        self.ops = TritonForwardOps()

    def forward(
        self, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None, logits_soft_cap=None
    ):
        self._write(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )


def _enable_triton_interpreter() -> None:
    """Triton runs on CPU only through its interpreter, chosen when a kernel is defined."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "stepscope.kernels.paged_attention" in sys.modules:
        raise RuntimeError(
            "the Triton kernels were loaded for a GPU; on CPU set TRITON_INTERPRET=1 "
            "before anything imports them"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def resolve_attention_backend(name: str | None, device: torch.device) -> str:
    """The backend to run: `name` if one was asked for, else `triton` on CUDA and on a CPU `cpu`
    where its C kernels build (they need a C compiler), else `torch`, with a warning."""
    if name is not None:
        return name
    if device.type != "cpu":
        return "triton"
    from stepscope.kernels.cpu.build import available

    why_not = available()
    if why_not is None:
        return "cpu"
    logger.warning("attention backend 'torch', not 'cpu': %s", why_not)
    return "torch"


def make_attention_backend(
    name: str | None, block_size: int, device: torch.device
) -> AttentionBackend:
    """The backend `name` (None: the device's default, see `resolve_attention_backend`)."""
    name = resolve_attention_backend(name, device)
    if name == "torch":
        return TorchAttentionBackend(block_size, device)
    if name == "cpu":
        return CpuAttentionBackend(block_size, device)
    if name == "triton":
        return TritonAttentionBackend(block_size, device)
    raise ValueError(f"unknown attention backend {name!r}: use 'cpu', 'torch' or 'triton'")
