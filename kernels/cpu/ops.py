"""The CPU kernels as torch functions, each beside its PyTorch reference.

Triton runs on a CPU only through its interpreter, far too slowly to serve, so the CPU path has
kernels of its own in C (as vLLM's CPU backend has C++ ones): decode attention straight from
the paged KV cache (`attention.c`), prefill attention from it too (`prefill_attention.c`, whose
reference is SDPA with the causal mask aligned at the chunk's end), RMSNorm with its residual
add (`norm.c`), rotary embedding (`rotary.c`) and the sampler's top-k / top-p (`sampling.c`,
whose reference is the sampler's sorted one). Each function checks its tensors, calls the
kernel with their data pointers on torch's threads, and returns torch tensors; float32 and
bfloat16 only (the sampler's logits are float32).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from stepscope.kernels.cpu.build import load

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _kernel(name: str, dtype: torch.dtype, library: dict | None = None) -> Callable[..., int]:
    """The kernel for this dtype, called with its arguments named as in kernels.h."""
    if dtype not in _SUFFIX:
        raise TypeError(f"the CPU kernels take float32 or bfloat16, got {dtype}")
    return (library or load())[f"{name}_{_SUFFIX[dtype]}"].call


ATTENTION_PATHS = {1: "avx512", 2: "avx512_bf16"}


def decode_attention_paths(library: dict | None = None) -> set[str]:
    """The CPU-specific routines decode attention was compiled with: "avx512" (the block
    routines for head_dim 64), "avx512_bf16" (bfloat16 dot products); none: portable loops."""
    paths = ctypes.c_int64()
    (library or load())["decode_attention_paths"].call(paths=ctypes.addressof(paths))
    return {name for bit, name in ATTENTION_PATHS.items() if paths.value & bit}


def _check(*tensors: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("every tensor must be contiguous and on the CPU")
        if dtype is not None and t.dtype != dtype:
            raise TypeError(f"expected {dtype}, got {t.dtype}")


# ---- decode attention -------------------------------------------------------------------------
def decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, >= blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the query token
    scale: float,
    max_len: int | None = None,
    out: torch.Tensor | None = None,
    library: dict | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of one query per request over its context, read through its block table
    (the query's own key and value are already in the cache). `max_len` bounds seq_lens
    (default: their maximum). `library`: another build's kernels (build.load_library).
    `sliding_window` W: each query sees only its last W keys, its own included; the table's
    blocks wholly before them are never read. `logits_soft_cap` c: scores become
    c * tanh(score / c) before the softmax."""
    _check(q, k_cache, v_cache, dtype=q.dtype)
    _check(block_tables, seq_lens, dtype=torch.int32)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")  # fmt: skip
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if max_len is None:
        max_len = int(seq_lens.max()) if num_seqs else 1
    threads = torch.get_num_threads()
    # Per thread: the scores, query rows and accumulators of every head, and one widened block.
    per_thread = num_heads * (max_len + 2 * head_dim) + block_size * num_kv_heads * head_dim
    scratch = torch.empty(threads * per_thread, dtype=torch.float32)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError("out must be shaped and typed like q")
    _check(out)
    status = _kernel("decode_attention", q.dtype, library)(
        q=q.data_ptr(), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
        block_tables=block_tables.data_ptr(), bt_stride=block_tables.stride(0),
        seq_lens=seq_lens.data_ptr(), num_seqs=num_seqs, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, scale=scale,
        out=out.data_ptr(), scratch=scratch.data_ptr(), window=_window(sliding_window),
        soft_cap=_soft_cap(logits_soft_cap), max_len=max_len, num_threads=threads,
    )  # fmt: skip
    if status:
        raise ValueError("every seq_len must be between 1 and max_len")
    return out


def _window(sliding_window: int | None) -> int:
    """The kernels' window argument: 0 for none."""
    if sliding_window is None:
        return 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    return sliding_window


def _soft_cap(logits_soft_cap: float | None) -> float:
    """The kernels' soft_cap argument: 0 for none."""
    if logits_soft_cap is None:
        return 0.0
    if not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
    return logits_soft_cap


def _capped(scores: torch.Tensor, logits_soft_cap: float | None) -> torch.Tensor:
    return (
        scores
        if logits_soft_cap is None
        else logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    )


def decode_attention_reference(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
):
    """The same attention in torch, request by request, in float32 (with a window, over the
    query's last sliding_window keys)."""
    num_heads, block_size = q.shape[1], k_cache.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(q)
    for i, length in enumerate(seq_lens.tolist()):
        lo = max(0, length - sliding_window) if sliding_window else 0
        blocks = block_tables[i, : -(-length // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[lo:length].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks].flatten(0, 1)[lo:length].float().repeat_interleave(group, dim=1)
        scores = _capped(torch.einsum("hd,thd->ht", q[i].float(), k) * scale, logits_soft_cap)
        out[i] = torch.einsum("ht,thd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


# ---- prefill attention ------------------------------------------------------------------------
def prefill_attention(
    q: torch.Tensor,  # [num_queries, num_heads, head_dim]: one request's prompt chunk
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [>= blocks] int32: the request's blocks
    context_len: int,  # keys cached before the chunk (0 for a whole prompt)
    scale: float,
    out: torch.Tensor | None = None,
    library: dict | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # [num_queries, num_heads, head_dim]
    """Causal attention of one request's chunk of queries over its context and its own keys,
    all read through its block table (the chunk's keys and values are already in the cache):
    query i sits at position context_len + i. `sliding_window` W: query i sees keys from
    context_len + i - W + 1 on; the table's blocks wholly before the first query's are never
    read. `logits_soft_cap` c: scores become c * tanh(score / c) before the softmax."""
    _check(q, k_cache, v_cache, dtype=q.dtype)
    _check(block_table, dtype=torch.int32)
    num_queries, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")  # fmt: skip
    keys = context_len + num_queries
    if block_table.dim() != 1 or block_table.numel() * block_size < keys:
        raise ValueError(f"the block table must hold {keys} keys, has {block_table.numel()} "
                         f"blocks of {block_size}")  # fmt: skip
    window = _window(sliding_window)
    base = context_len - window + 1 if window and context_len >= window else 0  # as the kernel
    kernels = library or load()
    threads = torch.get_num_threads()
    entries = ctypes.c_int64()
    kernels["prefill_attention_scratch"].call(
        keys=keys - base, num_kv_heads=num_kv_heads, head_dim=head_dim, num_threads=threads,
        entries=ctypes.addressof(entries),
    )  # fmt: skip
    scratch = torch.empty(entries.value, dtype=torch.float32)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError("out must be shaped and typed like q")
    _check(out)
    status = _kernel("prefill_attention", q.dtype, kernels)(
        q=q.data_ptr(), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
        block_table=block_table.data_ptr(), context_len=context_len, num_queries=num_queries,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, scale=scale, out=out.data_ptr(), scratch=scratch.data_ptr(),
        window=window, soft_cap=_soft_cap(logits_soft_cap), num_threads=threads,
    )  # fmt: skip
    if status:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads, "
                         "or a length is out of range")  # fmt: skip
    return out


def prefill_attention_reference(
    q,
    k_cache,
    v_cache,
    block_table,
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
):
    """The same attention in torch, in float32, with an explicit causal mask aligned at the
    bottom right (query i sees keys 0 .. context_len + i; with a window, from
    context_len + i - sliding_window + 1 on)."""
    num_queries, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    keys = context_len + num_queries
    blocks = block_table[: -(-keys // block_size)].long()
    k, v = (
        c[blocks].flatten(0, 1)[:keys].float().transpose(0, 1)[None] for c in (k_cache, v_cache)
    )
    key_pos, q_pos = torch.arange(keys)[None, :], context_len + torch.arange(num_queries)[:, None]
    seen = key_pos <= q_pos
    if sliding_window:
        seen &= key_pos > q_pos - sliding_window
    group = num_heads // num_kv_heads
    k, v = k[0].repeat_interleave(group, 0), v[0].repeat_interleave(group, 0)  # [H, keys, D]
    scores = _capped(q.float().transpose(0, 1) @ k.transpose(1, 2) * scale, logits_soft_cap)
    out = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v  # [H, queries, D]
    return out.transpose(0, 1).to(q.dtype)


# ---- quantized linear -------------------------------------------------------------------------
def qlinear_paths(library: dict | None = None) -> set[str]:
    """ "avx512_vnni" where the quantized products were compiled with integer dot products;
    none: portable loops."""
    paths = ctypes.c_int64()
    (library or load())["qlinear_paths"].call(paths=ctypes.addressof(paths))
    return {"avx512_vnni"} if paths.value & 1 else set()


class QLinear:
    """x @ W.T with W = scales * u + mins per block (engine/layers/quantization.py), the
    activations quantized to 15 bits per block inside the kernel (qlinear.c). The weight is
    checked once, here; a call checks only x and hands the kernel its pointers, so that the
    ~120 products of a one-token decode step cost little Python besides the kernel itself."""

    def __init__(
        self,
        qs: torch.Tensor,  # [out_features, in_features * bits / 8] uint8
        scales: torch.Tensor,  # [out_features, in_features / block] float32
        mins: torch.Tensor,  # [out_features, in_features / block] float32
        bits: int,
        block: int,
        library: dict | None = None,
    ) -> None:
        _check(qs, dtype=torch.uint8)
        _check(scales, mins, dtype=torch.float32)
        n, k = qs.shape[0], qs.shape[1] * 8 // bits
        if (
            bits not in (4, 8)
            or k % block
            or scales.shape != (n, k // block)
            or (mins.shape != scales.shape)
        ):
            raise ValueError(
                f"not a weight of {bits}-bit blocks of {block}: qs {tuple(qs.shape)}, scales "
                f"{tuple(scales.shape)}, mins {tuple(mins.shape)}"
            )
        self.weights = (qs, scales, mins)  # kept alive: the kernel reads them by address
        self.n, self.k, self.bits, self.block = n, k, bits, block
        self._pointers = (qs.data_ptr(), scales.data_ptr(), mins.data_ptr())
        lib = library or load()
        self._kernels = {dtype: lib[f"qlinear_{suffix}"].fn for dtype, suffix in _SUFFIX.items()}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out], x's dtype
        if x.shape[-1] != self.k or x.dtype not in self._kernels or x.device.type != "cpu":
            raise ValueError(
                f"expected float32 or bfloat16 CPU inputs of {self.k} features, got "
                f"{x.dtype} {tuple(x.shape)} on {x.device}"
            )
        rows = x.reshape(-1, self.k)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.empty(*x.shape[:-1], self.n, dtype=x.dtype)
        qs, scales, mins = self._pointers
        status = self._kernels[x.dtype](
            rows.data_ptr(), rows.shape[0], self.k, qs, scales, mins, self.n, self.bits,
            self.block, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise ValueError(
                f"qlinear refused its arguments (code {status}): in_features a multiple of 32; "
                "4-bit blocks of 32, or 8-bit blocks of 16 or 32"
            )
        return out


def qlinear(x, qs, scales, mins, bits: int, block: int, library: dict | None = None):
    """One product through `QLinear` (checking the weight on every call)."""
    return QLinear(qs, scales, mins, bits, block, library)(x)


def qlinear_reference(x, qs, scales, mins, bits: int, block: int):
    """The same product in float64 torch, activations quantized per block to 15 bits as the
    kernel does."""
    k = x.shape[-1]
    n = qs.shape[0]
    if bits == 4:
        q = qs.view(n, k // 32, 16)
        u = torch.cat([q & 0x0F, q >> 4], dim=-1).reshape(n, k)
    else:
        u = qs
    xb = x.reshape(-1, k // block, block).float()
    d = xb.abs().amax(-1, keepdim=True) / 16383
    qx = torch.round(xb * torch.where(d > 0, 1 / d, torch.zeros_like(d))).double()
    dots = torch.einsum("tbj,rbj->trb", qx, u.view(n, k // block, block).double())
    y = (dots * d.squeeze(-1)[:, None, :].double() * scales[None].double()).sum(-1)
    y = (y + torch.einsum("tb,rb->tr", xb.sum(-1).double(), mins.double())).float()
    return y.reshape(*x.shape[:-1], n).to(x.dtype)


# ---- RMSNorm ----------------------------------------------------------------------------------
def rms_norm(
    x: torch.Tensor,  # [rows, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [rows, hidden]: added to x first
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x (of x + residual, returned too, when a residual is given)."""
    _check(x, weight, *(() if residual is None else (residual,)), dtype=x.dtype)
    if x.dim() != 2 or weight.shape != x.shape[1:]:
        raise ValueError(f"x must be [rows, hidden] with weight [hidden]: {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if residual is not None and residual.shape != x.shape:
        raise ValueError("residual must be shaped like x")
    out = torch.empty_like(x)
    total = None if residual is None else torch.empty_like(x)
    _kernel("rms_norm", x.dtype)(
        x=x.data_ptr(), residual=None if residual is None else residual.data_ptr(),
        weight=weight.data_ptr(), eps=eps, out=out.data_ptr(),
        sum_out=None if total is None else total.data_ptr(), rows=x.shape[0], hidden=x.shape[1],
        num_threads=torch.get_num_threads(),
    )  # fmt: skip
    return out if total is None else (out, total)


def rms_norm_reference(x, weight, eps, residual=None):
    """transformers' LlamaRMSNorm, after the residual add in x's dtype."""
    if residual is not None:
        x = x + residual
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, x)


# ---- rotary embedding -------------------------------------------------------------------------
def rotary(
    positions: torch.Tensor,  # [tokens] int64
    q: torch.Tensor,  # [tokens, num_heads, head_dim]: each head contiguous, rows any stride
    k: torch.Tensor,  # [tokens, num_kv_heads, head_dim]
    cache: torch.Tensor,  # [max_positions, 2 * head_dim]: cos, then sin
) -> tuple[torch.Tensor, torch.Tensor]:  # q and k rotated, contiguous
    """Rotary embedding (rotate_half layout) of q and k by each token's position. q and k may
    be views into one fused QKV output: only their heads need to be contiguous."""
    _check(positions, dtype=torch.int64)
    _check(cache, dtype=q.dtype)
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    for t in (q, k):
        if t.dtype != q.dtype or t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError("q and k: each head's values must be contiguous, heads adjacent")
    if k.shape[0] != tokens or k.shape[2] != head_dim or cache.shape[1] != 2 * head_dim:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, cache "
                         f"{tuple(cache.shape)}")  # fmt: skip
    q_out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype)
    k_out = torch.empty(tokens, num_kv_heads, head_dim, dtype=q.dtype)
    status = _kernel("rotary", q.dtype)(
        q=q.data_ptr(), q_stride=q.stride(0), k=k.data_ptr(), k_stride=k.stride(0),
        positions=positions.data_ptr(), cache=cache.data_ptr(), max_positions=cache.shape[0],
        tokens=tokens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        q_out=q_out.data_ptr(), k_out=k_out.data_ptr(), num_threads=torch.get_num_threads(),
    )  # fmt: skip
    if status == 2:
        raise ValueError(f"a position is outside the cache's {cache.shape[0]} positions")
    if status:
        raise ValueError("head_dim must be even")
    return q_out, k_out


def rotary_reference(positions, q, k, cache):
    """transformers' `q * cos + rotate_half(q) * sin`, in q's dtype."""
    cos, sin = cache[positions][:, None, :].chunk(2, dim=-1)

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# ---- top-k / top-p ----------------------------------------------------------------------------
def top_k_top_p(
    logits: torch.Tensor,  # [rows, vocab] float32
    temperature: torch.Tensor,  # [rows] float32, > 0
    top_k: torch.Tensor,  # [rows] int64, 0: off
    top_p: torch.Tensor,  # [rows] float32, 1: off
    capacity: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:  # [rows, K] scores (-inf after the kept), token ids
    """The tokens each row keeps after temperature, top-k and top-p, as the sampler's sorted
    reference keeps them, largest first: their scores (logits / temperature) and ids, -inf and
    0 after a row's last. K is the most any row keeps (`capacity` is a first guess)."""
    _check(logits, temperature, top_p, dtype=torch.float32)
    _check(top_k, dtype=torch.int64)
    rows, vocab = logits.shape
    if temperature.shape != (rows,) or top_k.shape != (rows,) or top_p.shape != (rows,):
        raise ValueError(f"temperature, top_k and top_p must be [{rows}]")
    threads = torch.get_num_threads()
    scratch = torch.empty(threads * 4 * vocab, dtype=torch.float32)
    counts = torch.empty(rows, dtype=torch.int64)
    while True:
        capacity = max(1, min(capacity, vocab))
        values = torch.empty(rows, capacity, dtype=torch.float32)
        ids = torch.empty(rows, capacity, dtype=torch.int64)
        status = _kernel("top_k_top_p", torch.float32)(
            logits=logits.data_ptr(), temperature=temperature.data_ptr(),
            top_k=top_k.data_ptr(), top_p=top_p.data_ptr(), rows=rows, vocab=vocab,
            out_values=values.data_ptr(), out_ids=ids.data_ptr(), out_counts=counts.data_ptr(),
            capacity=capacity, scratch=scratch.data_ptr(), num_threads=threads,
        )  # fmt: skip
        if status == 1:
            raise ValueError("temperature and top_p must be > 0, top_k >= 0")
        widest = int(counts.max()) if rows else 1
        if status == 0:
            return values[:, :widest], ids[:, :widest]
        capacity = widest  # a row keeps more than the first guess: once more, wide enough
