/* Decode attention on the CPU, straight from the paged KV cache (worker forward, stage 6).
 *
 * One query token per request (a decode step): each request's keys and values are read where
 * they lie, block by block through its block table, and never copied into a padded batch. A
 * work item is one request, spread over OpenMP threads. Within an item, two passes over the
 * context, a block at a time (a block holds every KV head's keys of its tokens, contiguous):
 * the scores of every key for each query head (four keys at a time, so that four independent
 * sums hide the latency of the multiply-adds; with GQA each KV head serves its group of query
 * heads), then the softmax over each head's whole row (one long loop, which vectorizes), then
 * the values weighted by it. Sums are in float32.
 *
 * A sliding window of W keys (window > 0; 0: none): the query, at position seq_len - 1, sees
 * keys seq_len - W .. seq_len - 1. The blocks wholly before them are never read (the KV
 * manager may have freed them and left a null block id in the table), nor the keys before
 * them in the first block read. Soft-capping (soft_cap > 0; 0: none) bounds each score to
 * soft_cap * tanh(score / soft_cap) before the softmax.
 *
 * Compiled with -ffp-contract=fast (multiply-adds fused) and -fno-trapping-math (so that the
 * exponential's floor vectorizes); see build.py.
 *
 * Layouts (all contiguous, row-major):
 *   q        [num_seqs, num_heads, head_dim]
 *   k_cache  [num_blocks, block_size, num_kv_heads, head_dim]   (v_cache the same)
 *   block_tables [num_seqs, bt_stride] int32, seq_lens [num_seqs] int32 (context incl. query)
 *   scratch  float32, num_threads * (num_heads * (max_len + 2 * head_dim) + block_size *
 *            num_kv_heads * head_dim) entries (each thread's scores, query rows, accumulators
 *            and one widened block)
 *   out      [num_seqs, num_heads, head_dim]
 */
#include <omp.h>

#include "common.h"
#include "kernels.h"

/* Ask for the next block while this one is computed on: blocks lie anywhere in the pool, so
 * the hardware prefetcher, which follows addresses, cannot guess where the next one is. Into
 * L2, not L1 (locality 2: prefetcht1): a float32 block's 192 lines overflow L1's miss buffers.
 * And not all at once: a burst of 192 prefetches stalled the loads of the block being computed
 * on behind them, so that memory reads and arithmetic took turns. The AVX-512 routines ask for
 * the next block's lines a few at a time, between their multiply-adds (prefetch_some): reading
 * a cold cache, float32 decode went from 13 to 19-20 GB/s and bfloat16 from 10 to 17
 * (docs/benchmarks.md). The portable loops ask for the whole block into L2. */
static inline void prefetch_block(const void *start, int64_t bytes) {
    const char *p = (const char *)start;
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 2);
}

/* The AVX-512 routines ask for the next block a few lines at a time, between their
 * multiply-adds, rather than all at once: the lines of it not yet asked for, per thread. */
static __thread const char *prefetch_next, *prefetch_end;

static inline ALWAYS_INLINE void prefetch_some(int lines) {
    for (; lines > 0 && prefetch_next < prefetch_end; lines--, prefetch_next += 64)
        __builtin_prefetch(prefetch_next, 0, 2);
}

/* The two passes over one block for head_dim 64 in AVX-512, where the compiler has it. The
 * portable loops below leave the multiply-adds waiting on each other: pass 1 ends every dot
 * product in a horizontal sum of its own, and pass 2 chains each sum through the block's
 * keys one head at a time. On these CPUs a decode's compute and its memory reads barely
 * overlap, so the instructions saved are time saved (docs/benchmarks.md). */
#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512 1

/* Lane t of the result: the sum of the 16 lanes of r[t]. */
static inline __m512 sum_lanes_16(const __m512 r[16]) {
    __m512 u[8], w[4];
    for (int i = 0; i < 8; i++) /* per 128-bit chunk: [a0+a2, b0+b2, a1+a3, b1+b3] */
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]),
                             _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per chunk: the chunk's sums of keys 4i .. 4i+3 */
        const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* Sum each w[i]'s four chunks into chunk i. */
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Pass 1, 16 keys (rows key_stride apart): scores[h * max_len + t] for every query head. */
static inline ALWAYS_INLINE void scores_16_d64(const float *keys, int64_t key_stride,
                                               int64_t num_kv_heads, int64_t group,
                                               const float *qs, float *scores,
                                               int64_t max_len, float scale) {
    for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++) {
        const float *kb = keys + kv_head * 64;
        for (int64_t h = kv_head * group; h < (kv_head + 1) * group; h++) {
            const __m512 q0 = _mm512_loadu_ps(qs + h * 64), q1 = _mm512_loadu_ps(qs + h * 64 + 16);
            const __m512 q2 = _mm512_loadu_ps(qs + h * 64 + 32);
            const __m512 q3 = _mm512_loadu_ps(qs + h * 64 + 48);
            __m512 r[16];
            for (int t = 0; t < 16; t++) {
                prefetch_some(2);
                const float *k = kb + t * key_stride;
                __m512 s = _mm512_mul_ps(q0, _mm512_loadu_ps(k));
                s = _mm512_fmadd_ps(q1, _mm512_loadu_ps(k + 16), s);
                s = _mm512_fmadd_ps(q2, _mm512_loadu_ps(k + 32), s);
                r[t] = _mm512_fmadd_ps(q3, _mm512_loadu_ps(k + 48), s);
            }
            const __m512 sums = sum_lanes_16(r);
            _mm512_storeu_ps(scores + h * max_len, _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
        }
    }
}

/* 16 elements as float32: bfloat16 widened in registers (its bits are a float's top half). */
static inline ALWAYS_INLINE __m512 load_16(int bf16, const void *p, int64_t i) {
    if (!bf16) return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Pass 2 for `heads` query heads of one KV head (1 to 4, a constant at each call, so that the
 * loops over heads unroll): each value row is read once for all of them, and the heads * 4
 * sums are independent chains held in registers. vb holds float32, or bfloat16 values read
 * straight from the cache (bf16). */
static inline ALWAYS_INLINE void values_heads_d64(int bf16, const void *vb, int64_t n,
                                                  int64_t key_stride, const float *p,
                                                  int64_t max_len, float *acc, int heads) {
    __m512 a[4][4];
    for (int i = 0; i < heads; i++)
        for (int c = 0; c < 4; c++) a[i][c] = _mm512_loadu_ps(acc + i * 64 + c * 16);
    for (int64_t t = 0; t < n; t++) {
        prefetch_some(bf16 ? 2 : 4);
        const int64_t v = t * key_stride;
        const __m512 v0 = load_16(bf16, vb, v), v1 = load_16(bf16, vb, v + 16);
        const __m512 v2 = load_16(bf16, vb, v + 32), v3 = load_16(bf16, vb, v + 48);
        for (int i = 0; i < heads; i++) {
            const __m512 w = _mm512_set1_ps(p[i * max_len + t]);
            a[i][0] = _mm512_fmadd_ps(w, v0, a[i][0]);
            a[i][1] = _mm512_fmadd_ps(w, v1, a[i][1]);
            a[i][2] = _mm512_fmadd_ps(w, v2, a[i][2]);
            a[i][3] = _mm512_fmadd_ps(w, v3, a[i][3]);
        }
    }
    for (int i = 0; i < heads; i++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + i * 64 + c * 16, a[i][c]);
}

/* Pass 2 over one block: for each KV head, its query heads four (or fewer) at a time. p is
 * the probabilities at the block's first key, acc the [num_heads][64] sums. */
static inline ALWAYS_INLINE void values_block_d64(int bf16, const void *block, int64_t n,
                                                  int64_t key_stride, int64_t num_kv_heads,
                                                  int64_t group, const float *p,
                                                  int64_t max_len, float *acc) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++) {
        const void *vb = (const char *)block + kv_head * 64 * size;
        for (int64_t h = kv_head * group; h < (kv_head + 1) * group; h += 4) {
            const int64_t left = (kv_head + 1) * group - h;
            const float *ph = p + h * max_len;
            float *ah = acc + h * 64;
            if (left >= 4) values_heads_d64(bf16, vb, n, key_stride, ph, max_len, ah, 4);
            else if (left == 3) values_heads_d64(bf16, vb, n, key_stride, ph, max_len, ah, 3);
            else if (left == 2) values_heads_d64(bf16, vb, n, key_stride, ph, max_len, ah, 2);
            else values_heads_d64(bf16, vb, n, key_stride, ph, max_len, ah, 1);
        }
    }
}

/* Pass 1 for bfloat16, 16 keys, with the CPU's bfloat16 dot product (vdpbf16ps: pairs of
 * bfloat16 multiplied and summed into float32 lanes), the keys and the query read as they lie
 * in bfloat16: no widening, half the multiply-adds of the float32 routine above. */
#if defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
static inline ALWAYS_INLINE void scores_16_d64_bf16(const uint16_t *keys, int64_t key_stride,
                                                    int64_t num_kv_heads, int64_t group,
                                                    const uint16_t *q, float *scores,
                                                    int64_t max_len, float scale) {
    for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++) {
        const uint16_t *kb = keys + kv_head * 64;
        for (int64_t h = kv_head * group; h < (kv_head + 1) * group; h++) {
            const __m512bh q0 = (__m512bh)_mm512_loadu_si512(q + h * 64);
            const __m512bh q1 = (__m512bh)_mm512_loadu_si512(q + h * 64 + 32);
            __m512 r[16];
            for (int t = 0; t < 16; t++) {
                prefetch_some(1);
                const uint16_t *k = kb + t * key_stride;
                const __m512 s =
                    _mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_loadu_si512(k));
                r[t] = _mm512_dpbf16_ps(s, q1, (__m512bh)_mm512_loadu_si512(k + 32));
            }
            const __m512 sums = sum_lanes_16(r);
            _mm512_storeu_ps(scores + h * max_len, _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
        }
    }
}
#else
#define HAVE_AVX512_BF16 0
static inline void scores_16_d64_bf16(const uint16_t *keys, int64_t key_stride,
                                      int64_t num_kv_heads, int64_t group, const uint16_t *q,
                                      float *scores, int64_t max_len, float scale) {
    (void)keys, (void)key_stride, (void)num_kv_heads, (void)group, (void)q, (void)scores,
        (void)max_len, (void)scale;
}
#endif
#else
#define HAVE_AVX512 0
#define HAVE_AVX512_BF16 0
static inline void scores_16_d64(const float *keys, int64_t key_stride, int64_t num_kv_heads,
                                 int64_t group, const float *qs, float *scores, int64_t max_len,
                                 float scale) {
    (void)keys, (void)key_stride, (void)num_kv_heads, (void)group, (void)qs, (void)scores,
        (void)max_len, (void)scale;
}
static inline void values_block_d64(int bf16, const void *block, int64_t n, int64_t key_stride,
                                    int64_t num_kv_heads, int64_t group, const float *p,
                                    int64_t max_len, float *acc) {
    (void)bf16, (void)block, (void)n, (void)key_stride, (void)num_kv_heads, (void)group, (void)p,
        (void)max_len, (void)acc;
}
static inline void scores_16_d64_bf16(const uint16_t *keys, int64_t key_stride,
                                      int64_t num_kv_heads, int64_t group, const uint16_t *q,
                                      float *scores, int64_t max_len, float scale) {
    (void)keys, (void)key_stride, (void)num_kv_heads, (void)group, (void)q, (void)scores,
        (void)max_len, (void)scale;
}
#endif

/* The block of `table` holding token `start` of `cache`, where it lies in the pool, with the
 * next block, if the context has one, asked for ahead: all at once, or (spread, for the
 * AVX-512 routines) left to prefetch_some, after what is left of this block's lines. */
static inline ALWAYS_INLINE const void *block_in_pool(enum dtype dt, const void *cache,
                                                      const int32_t *table, int64_t start,
                                                      int64_t len, int64_t block_size,
                                                      int64_t key_stride, int spread) {
    const int64_t bytes = block_size * key_stride * (dt == BF16 ? 2 : 4);
    const char *pool = (const char *)cache;
    if (spread) prefetch_block(prefetch_next, prefetch_end - prefetch_next);
    prefetch_next = prefetch_end = NULL;
    if (start + block_size < len) {
        const char *next = pool + (int64_t)table[start / block_size + 1] * bytes;
        if (spread) prefetch_next = next, prefetch_end = next + bytes;
        else prefetch_block(next, bytes);
    }
    return pool + (int64_t)table[start / block_size] * bytes;
}

/* That block's first n keys as float32: the block itself for float32, else widened once into
 * `wide` (each key and value serves every query head of its group). */
static inline ALWAYS_INLINE const float *block_at(enum dtype dt, const void *cache,
                                                  const int32_t *table, int64_t start, int64_t n,
                                                  int64_t len, int64_t block_size,
                                                  int64_t key_stride, float *wide, int spread) {
    const void *block =
        block_in_pool(dt, cache, table, start, len, block_size, key_stride, spread);
    return dt == BF16 ? widen_bf16((const uint16_t *)block, n * key_stride, wide)
                      : widen_f32((const float *)block, n * key_stride, wide);
}

/* hd, in the functions below, is the head dimension: a literal for the common sizes, so that
 * the loops over it unroll and the accumulators stay in registers, or `head_dim` itself for
 * any other size. */

/* Pass 1 over one block of n keys (every KV head of it: one contiguous stretch of memory):
 * scores[h * max_len + t] for every query head h and key t, four keys at a time. */
static inline ALWAYS_INLINE void scores_block(const float *block, int64_t n, int64_t key_stride,
                                              int64_t num_kv_heads, int64_t group,
                                              const float *qs, float *scores, int64_t max_len,
                                              float scale, int64_t hd) {
    int64_t t0 = 0; /* keys done in tiles of 16 */
    if (HAVE_AVX512 && hd == 64)
        for (; t0 + 16 <= n; t0 += 16)
            scores_16_d64(block + t0 * key_stride, key_stride, num_kv_heads, group, qs,
                          scores + t0, max_len, scale);
    for (int64_t kv_head = 0; kv_head < num_kv_heads && t0 < n; kv_head++) {
        const float *kb = block + kv_head * hd;
        int64_t t = t0;
        for (; t + 4 <= n; t += 4) {
            const float *k0 = kb + t * key_stride, *k1 = k0 + key_stride;
            const float *k2 = k1 + key_stride, *k3 = k2 + key_stride;
            for (int64_t h = kv_head * group; h < (kv_head + 1) * group; h++) {
                const float *x = qs + h * hd;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int64_t d = 0; d < hd; d++) {
                    s0 += x[d] * k0[d];
                    s1 += x[d] * k1[d];
                    s2 += x[d] * k2[d];
                    s3 += x[d] * k3[d];
                }
                float *row = scores + h * max_len + t;
                row[0] = s0 * scale;
                row[1] = s1 * scale;
                row[2] = s2 * scale;
                row[3] = s3 * scale;
            }
        }
        for (; t < n; t++) {
            const float *key = kb + t * key_stride;
            for (int64_t h = kv_head * group; h < (kv_head + 1) * group; h++) {
                const float *x = qs + h * hd;
                float s0 = 0.0f;
#pragma omp simd reduction(+ : s0)
                for (int64_t d = 0; d < hd; d++) s0 += x[d] * key[d];
                scores[h * max_len + t] = s0 * scale;
            }
        }
    }
}

/* Pass 2 over one block of n values: acc[h][d] += p[h * max_len + t] * value_t[d], for every
 * query head h (p is the probabilities at the block's first key). */
static inline ALWAYS_INLINE void values_block(const float *block, int64_t n, int64_t key_stride,
                                              int64_t num_kv_heads, int64_t group,
                                              const float *p, int64_t max_len, float *acc,
                                              int64_t hd) {
    if (HAVE_AVX512 && hd == 64) {
        values_block_d64(0, block, n, key_stride, num_kv_heads, group, p, max_len, acc);
        return;
    }
    for (int64_t h = 0; h < num_kv_heads * group; h++) {
        const float *vb = block + (h / group) * hd;
        const float *ph = p + h * max_len;
        float *ah = acc + h * hd;
        /* 32 columns at a time: their sums stay in registers over the block's keys. */
        int64_t d0 = 0;
        for (; d0 + 32 <= hd; d0 += 32) {
            float a[32];
            for (int64_t j = 0; j < 32; j++) a[j] = ah[d0 + j];
            for (int64_t t = 0; t < n; t++) {
                const float *value = vb + t * key_stride + d0;
                const float w = ph[t];
#pragma omp simd
                for (int64_t j = 0; j < 32; j++) a[j] += w * value[j];
            }
            for (int64_t j = 0; j < 32; j++) ah[d0 + j] = a[j];
        }
        for (; d0 < hd; d0++)
            for (int64_t t = 0; t < n; t++) ah[d0] += ph[t] * vb[t * key_stride + d0];
    }
}

/* A call's arguments (kernels.h), by name. */
struct decode {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables;
    int64_t bt_stride;
    const int32_t *seq_lens;
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    void *out;
    float *scratch;
    int64_t window; /* keys a query sees, itself included; 0: all */
    float soft_cap; /* scores bounded to soft_cap * tanh(score / soft_cap); 0: none */
    int64_t max_len, num_threads;
};

/* One thread's part of a call: the requests the OpenMP loop hands it, each in two passes over
 * its context, a block at a time. */
static inline ALWAYS_INLINE void attend(const struct decode *a, enum dtype dt, int64_t hd) {
    const int64_t num_heads = a->num_heads, num_kv_heads = a->num_kv_heads;
    const int64_t block_size = a->block_size, max_len = a->max_len, threads = a->num_threads;
    const float scale = a->scale;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t key_stride = num_kv_heads * hd; /* between two keys of a block */
    const int64_t me = omp_get_thread_num();
    const int spread = HAVE_AVX512 && hd == 64; /* prefetch_some in the AVX-512 routines */
    prefetch_next = prefetch_end = NULL;
    float *scores = a->scratch + me * num_heads * max_len; /* [num_heads][max_len] */
    float *qs = a->scratch + threads * num_heads * max_len + me * 2 * num_heads * hd;
    float *acc = qs + num_heads * hd; /* [num_heads][hd] */
    float *wide = a->scratch + threads * num_heads * (max_len + 2 * hd)
                  + me * block_size * key_stride; /* one block, widened */
#pragma omp for schedule(dynamic, 1) nowait /* the parallel region's end waits */
    for (int64_t seq = 0; seq < a->num_seqs; seq++) {
        const int64_t len = a->seq_lens[seq];
        const int32_t *table = a->block_tables + seq * a->bt_stride;
        for (int64_t i = 0; i < num_heads * hd; i++) {
            qs[i] = load_as(dt, a->q, seq * num_heads * hd + i);
            acc[i] = 0.0f;
        }
        /* With a window, keys before lo are never read: their blocks may have been freed. */
        const int64_t lo = a->window > 0 && len > a->window ? len - a->window : 0;
        for (int64_t start = lo / block_size * block_size; start < len; start += block_size) {
            const int64_t n = len - start < block_size ? len - start : block_size;
            int64_t t0 = lo > start ? lo - start : 0; /* the keys of this block it skips */
            if (dt == BF16 && hd == 64 && HAVE_AVX512_BF16) { /* 16 keys at a time */
                const uint16_t *keys = (const uint16_t *)block_in_pool(
                    dt, a->k_cache, table, start, len, block_size, key_stride, spread);
                const uint16_t *q = (const uint16_t *)a->q + seq * num_heads * hd;
                for (; t0 + 16 <= n; t0 += 16)
                    scores_16_d64_bf16(keys + t0 * key_stride, key_stride, num_kv_heads, group,
                                       q, scores + start + t0, max_len, scale);
            }
            if (t0 == n) continue;
            const float *block = block_at(dt, a->k_cache, table, start, n, len, block_size,
                                          key_stride, wide, spread); /* the rest, as float32 */
            scores_block(block + t0 * key_stride, n - t0, key_stride, num_kv_heads, group, qs,
                         scores + start + t0, max_len, scale, hd);
        }
        for (int64_t h = 0; h < num_heads; h++) {
            soft_cap_row(scores + h * max_len + lo, len - lo, a->soft_cap);
            softmax_row(scores + h * max_len + lo, len - lo);
        }
        for (int64_t start = lo / block_size * block_size; start < len; start += block_size) {
            const int64_t n = len - start < block_size ? len - start : block_size;
            const int64_t skip = lo > start ? lo - start : 0;
            const float *p = scores + start + skip;
            if (dt == BF16 && HAVE_AVX512 && hd == 64) { /* values widened in registers */
                const uint16_t *block = (const uint16_t *)block_in_pool(
                    dt, a->v_cache, table, start, len, block_size, key_stride, spread);
                values_block_d64(1, block + skip * key_stride, n - skip, key_stride, num_kv_heads,
                                 group, p, max_len, acc);
                continue;
            }
            const float *block = block_at(dt, a->v_cache, table, start, n, len, block_size,
                                          key_stride, wide, spread);
            values_block(block + skip * key_stride, n - skip, key_stride, num_kv_heads, group, p,
                         max_len, acc, hd);
        }
        for (int64_t i = 0; i < num_heads * hd; i++)
            store_as(dt, a->out, seq * num_heads * hd + i, acc[i]);
    }
}

/* attend, compiled once per dtype and head size. */
static void attend_f32_d64(const struct decode *a) { attend(a, F32, 64); }
static void attend_f32_d128(const struct decode *a) { attend(a, F32, 128); }
static void attend_f32_any(const struct decode *a) { attend(a, F32, a->head_dim); }
static void attend_bf16_d64(const struct decode *a) { attend(a, BF16, 64); }
static void attend_bf16_d128(const struct decode *a) { attend(a, BF16, 128); }
static void attend_bf16_any(const struct decode *a) { attend(a, BF16, a->head_dim); }

static int decode_attention(const struct decode *a, enum dtype dt) {
    if (a->num_heads % a->num_kv_heads || a->num_threads < 1 || a->window < 0 || a->soft_cap < 0)
        return 1;
    for (int64_t s = 0; s < a->num_seqs; s++)
        if (a->seq_lens[s] < 1 || a->seq_lens[s] > a->max_len) return 2;
    void (*attend_part)(const struct decode *) =
        a->head_dim == 64    ? (dt == BF16 ? attend_bf16_d64 : attend_f32_d64)
        : a->head_dim == 128 ? (dt == BF16 ? attend_bf16_d128 : attend_f32_d128)
                             : (dt == BF16 ? attend_bf16_any : attend_f32_any);
#pragma omp parallel num_threads(a->num_threads)
    attend_part(a);
    return 0;
}

int decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                         const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, float *out,
                         float *scratch, int64_t window, float soft_cap, int64_t max_len,
                         int64_t num_threads) {
    const struct decode a = {
        .q = q, .k_cache = k_cache, .v_cache = v_cache, .block_tables = block_tables,
        .bt_stride = bt_stride, .seq_lens = seq_lens, .num_seqs = num_seqs,
        .num_heads = num_heads, .num_kv_heads = num_kv_heads, .head_dim = head_dim,
        .block_size = block_size, .scale = scale, .out = out, .scratch = scratch,
        .window = window, .soft_cap = soft_cap, .max_len = max_len,
        .num_threads = num_threads};
    return decode_attention(&a, F32);
}

int decode_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t block_size, float scale, uint16_t *out,
                          float *scratch, int64_t window, float soft_cap, int64_t max_len,
                          int64_t num_threads) {
    const struct decode a = {
        .q = q, .k_cache = k_cache, .v_cache = v_cache, .block_tables = block_tables,
        .bt_stride = bt_stride, .seq_lens = seq_lens, .num_seqs = num_seqs,
        .num_heads = num_heads, .num_kv_heads = num_kv_heads, .head_dim = head_dim,
        .block_size = block_size, .scale = scale, .out = out, .scratch = scratch,
        .window = window, .soft_cap = soft_cap, .max_len = max_len,
        .num_threads = num_threads};
    return decode_attention(&a, BF16);
}

int decode_attention_paths(int64_t *paths) {
    *paths = (HAVE_AVX512 ? 1 : 0) | (HAVE_AVX512_BF16 ? 2 : 0);
    return 0;
}
