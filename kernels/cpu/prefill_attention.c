/* Prefill attention on the CPU, straight from the paged KV cache (worker forward, stage 6).
 *
 * One request's prompt chunk per call: its queries attend causally to every key before them,
 * the cached context and the chunk's own keys alike (already written to the cache), read
 * through its block table. Query i sits at position context_len + i and sees keys 0 .. that
 * position (causal, aligned at the bottom right: a chunk after a prefix hit is no special case).
 *
 * Decode attention (attention.c) reads each key once per query; here each key serves many
 * queries, so the work is arithmetic, not memory traffic, and it is laid out as small matrix
 * products whose operands stay in registers:
 *   1. the keys, transposed, and the values of every KV head are copied once out of their
 *      blocks into contiguous float32 (bfloat16 widened), for all threads to read;
 *   2. a work item is ROWS queries of one head; items run longest first over OpenMP threads.
 *      Its scores (queries x keys up to the item's last position) come from a register tile
 *      of 8 queries x 32 keys: per dimension one broadcast of each query's element times two
 *      vectors of 16 transposed keys, no horizontal sums. Keys past a query's position are
 *      never used: each row's softmax stops there, and its weights past it are zero.
 *   3. the softmax of each row, then the weighted values, 4 queries x 64 dimensions in
 *      registers, each value row read once for the 4.
 * Sums are in float32; compiled as attention.c (-ffp-contract=fast, -fno-trapping-math).
 *
 * A sliding window of W keys (window > 0; 0: none): query i sees keys from its position - W + 1
 * on. Only the keys from the first query's first one on are copied out (base, below): the
 * blocks before them are never read (the KV manager may have freed them and left a null block
 * id in the table). An item scores keys from its first query's first one on (tile-aligned),
 * and each row's weights before its own first key are zero. Soft-capping (soft_cap > 0; 0:
 * none) bounds each score to soft_cap * tanh(score / soft_cap) before the softmax.
 *
 * Layouts (contiguous, row-major):
 *   q, out   [num_queries, num_heads, head_dim]
 *   k_cache  [num_blocks, block_size, num_kv_heads, head_dim]   (v_cache the same)
 *   block_table [>= blocks of context_len + num_queries keys] int32 (with a window, entries
 *                before the one holding key base are not read)
 *   scratch  float32, prefill_attention_scratch(...) entries (see below)
 */
#include <omp.h>

#include "common.h"
#include "kernels.h"

#define ROWS 32 /* queries per work item */
#define TILE 32 /* keys per score tile: the transposed keys' rows are padded to a multiple */

static inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* Scratch entries a call needs: the transposed keys and the values of every KV head, then per
 * thread one item's scores, its query rows and its sums; `keys` counts those the call copies
 * (all of context and chunk, or with a window those from base on). */
static inline int64_t scratch_entries(int64_t keys, int64_t num_kv_heads, int64_t head_dim,
                                      int64_t num_threads) {
    const int64_t padded = round_up(keys, TILE);
    return 2 * num_kv_heads * head_dim * padded
           + num_threads * (ROWS * padded + 2 * ROWS * head_dim);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

/* Scores of 8 query rows (qs, hd apart) against TILE keys (kt: hd rows of `padded` keys). */
static inline ALWAYS_INLINE void scores_tile(const float *qs, const float *kt, int64_t padded,
                                             float *s, int64_t s_stride, int64_t hd) {
#if HAVE_AVX512
    __m512 a[8][2];
    for (int r = 0; r < 8; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
        const __m512 k0 = _mm512_loadu_ps(kt + d * padded);
        const __m512 k1 = _mm512_loadu_ps(kt + d * padded + 16);
        for (int r = 0; r < 8; r++) {
            const __m512 x = _mm512_set1_ps(qs[r * hd + d]);
            a[r][0] = _mm512_fmadd_ps(x, k0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(x, k1, a[r][1]);
        }
    }
    for (int r = 0; r < 8; r++) {
        _mm512_storeu_ps(s + r * s_stride, a[r][0]);
        _mm512_storeu_ps(s + r * s_stride + 16, a[r][1]);
    }
#else
    for (int r = 0; r < 8; r++) {
        float a[TILE] = {0};
        for (int64_t d = 0; d < hd; d++) {
            const float x = qs[r * hd + d];
#pragma omp simd
            for (int j = 0; j < TILE; j++) a[j] += x * kt[d * padded + j];
        }
        for (int j = 0; j < TILE; j++) s[r * s_stride + j] = a[j];
    }
#endif
}

/* Weighted values of 4 query rows (p: their weights, s_stride apart) over keys [0, n):
 * acc[r][hd] = sum_j p[r][j] * v[j][:]. v holds `hd` floats per key. */
static inline ALWAYS_INLINE void values_rows4(const float *p, int64_t s_stride, const float *v,
                                              int64_t n, float *acc, int64_t hd) {
#if HAVE_AVX512
    if (hd == 64) {
        __m512 a[4][4];
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const float *vj = v + j * 64;
            const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
            const __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
            for (int r = 0; r < 4; r++) {
                const __m512 w = _mm512_set1_ps(p[r * s_stride + j]);
                a[r][0] = _mm512_fmadd_ps(w, v0, a[r][0]);
                a[r][1] = _mm512_fmadd_ps(w, v1, a[r][1]);
                a[r][2] = _mm512_fmadd_ps(w, v2, a[r][2]);
                a[r][3] = _mm512_fmadd_ps(w, v3, a[r][3]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + r * 64 + c * 16, a[r][c]);
        return;
    }
#endif
    for (int r = 0; r < 4; r++) {
        float *ar = acc + r * hd;
        for (int64_t d = 0; d < hd; d++) ar[d] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float w = p[r * s_stride + j];
            const float *vj = v + j * hd;
#pragma omp simd
            for (int64_t d = 0; d < hd; d++) ar[d] += w * vj[d];
        }
    }
}

struct prefill {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_table;
    int64_t context_len, num_queries, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    void *out;
    float *scratch;
    int64_t window; /* keys a query sees, itself included; 0: all */
    float soft_cap; /* scores bounded to soft_cap * tanh(score / soft_cap); 0: none */
    int64_t num_threads;
};

static inline ALWAYS_INLINE void prefill_part(const struct prefill *a, enum dtype dt,
                                              int64_t hd) {
    const int64_t num_heads = a->num_heads, num_kv_heads = a->num_kv_heads;
    const int64_t group = num_heads / num_kv_heads, key_stride = num_kv_heads * hd;
    const int64_t window = a->window, context_len = a->context_len;
    /* The first key any query sees; key t of the scratch is key base + t of the request. */
    const int64_t base = window > 0 && context_len >= window ? context_len - window + 1 : 0;
    const int64_t keys = context_len + a->num_queries - base, padded = round_up(keys, TILE);
    float *kt = a->scratch;                              /* [num_kv_heads][hd][padded] */
    float *vs = kt + num_kv_heads * hd * padded;         /* [num_kv_heads][padded][hd] */
    float *mine = vs + num_kv_heads * hd * padded
                  + omp_get_thread_num() * (ROWS * padded + 2 * ROWS * hd);
    float *s = mine, *qs = s + ROWS * padded, *acc = qs + ROWS * hd;

    /* 1. Keys transposed and values, out of their blocks; the padding keys zero. */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < padded; t++) {
        const int64_t pos = base + t, bs = a->block_size;
        const int64_t at =
            t < keys ? ((int64_t)a->block_table[pos / bs] * bs + pos % bs) * key_stride : -1;
        for (int64_t g = 0; g < num_kv_heads; g++)
            for (int64_t d = 0; d < hd; d++) {
                const int64_t i = at + g * hd + d;
                kt[(g * hd + d) * padded + t] = at < 0 ? 0.0f : load_as(dt, a->k_cache, i);
                vs[(g * padded + t) * hd + d] = at < 0 ? 0.0f : load_as(dt, a->v_cache, i);
            }
    }
    /* (the implicit barrier: every thread reads all of it below) */

    /* 2-3. Items of ROWS queries of one head, the last queries (the most keys) first. */
    const int64_t blocks = (a->num_queries + ROWS - 1) / ROWS;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t item = 0; item < blocks * num_heads; item++) {
        const int64_t i0 = (blocks - 1 - item / num_heads) * ROWS, h = item % num_heads;
        const int64_t g = h / group;
        const int64_t m = a->num_queries - i0 < ROWS ? a->num_queries - i0 : ROWS;
        const int64_t last = context_len + i0 + m - base; /* keys its last query sees, + 1 */
        /* The item's first query's first key, its tile's start: no key before is scored. */
        const int64_t from_item = window > 0 && context_len + i0 - window + 1 > base
                                      ? context_len + i0 - window + 1 - base
                                      : 0;
        const int64_t first = from_item / TILE * TILE;
        for (int64_t r = 0; r < ROWS; r++)
            for (int64_t d = 0; d < hd; d++)
                qs[r * hd + d] =
                    r < m ? a->scale * load_as(dt, a->q, ((i0 + r) * num_heads + h) * hd + d)
                          : 0.0f;
        const float *ktg = kt + g * hd * padded;
        for (int64_t r0 = 0; r0 < m; r0 += 8)
            for (int64_t j0 = first; j0 < last; j0 += TILE)
                scores_tile(qs + r0 * hd, ktg + j0, padded, s + r0 * padded + j0, padded, hd);
        for (int64_t r = 0; r < m; r++) { /* query r sees keys [from, seen) */
            const int64_t seen = context_len + i0 + r + 1 - base;
            const int64_t from = window > 0 && seen > window ? seen - window : 0;
            float *row = s + r * padded;
            soft_cap_row(row + from, seen - from, a->soft_cap);
            softmax_row(row + from, seen - from);
            for (int64_t j = first; j < from; j++) row[j] = 0.0f;
            for (int64_t j = seen; j < last; j++) row[j] = 0.0f;
        }
        for (int64_t r = m; r < round_up(m, 4); r++) /* rows padding the last group of 4 */
            for (int64_t j = first; j < last; j++) s[r * padded + j] = 0.0f;
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            const int64_t n = context_len + i0 + (r0 + 4 < m ? r0 + 4 : m) - base;
            values_rows4(s + r0 * padded + first, padded, vs + (g * padded + first) * hd,
                         n - first, acc, hd);
            for (int64_t r = r0; r < r0 + 4 && r < m; r++)
                for (int64_t d = 0; d < hd; d++)
                    store_as(dt, a->out, ((i0 + r) * num_heads + h) * hd + d,
                             acc[(r - r0) * hd + d]);
        }
    }
}

static void prefill_f32_d64(const struct prefill *a) { prefill_part(a, F32, 64); }
static void prefill_f32_any(const struct prefill *a) { prefill_part(a, F32, a->head_dim); }
static void prefill_bf16_d64(const struct prefill *a) { prefill_part(a, BF16, 64); }
static void prefill_bf16_any(const struct prefill *a) { prefill_part(a, BF16, a->head_dim); }

static int prefill_attention(const struct prefill *a, enum dtype dt) {
    if (a->num_heads % a->num_kv_heads || a->num_threads < 1 || a->num_queries < 1
        || a->context_len < 0 || a->block_size < 1 || a->window < 0 || a->soft_cap < 0)
        return 1;
    void (*part)(const struct prefill *) =
        a->head_dim == 64 ? (dt == BF16 ? prefill_bf16_d64 : prefill_f32_d64)
                          : (dt == BF16 ? prefill_bf16_any : prefill_f32_any);
#pragma omp parallel num_threads(a->num_threads)
    part(a);
    return 0;
}

int prefill_attention_scratch(int64_t keys, int64_t num_kv_heads, int64_t head_dim,
                              int64_t num_threads, int64_t *entries) {
    *entries = scratch_entries(keys, num_kv_heads, head_dim, num_threads);
    return 0;
}

int prefill_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                          const int32_t *block_table, int64_t context_len, int64_t num_queries,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, float scale, float *out, float *scratch,
                          int64_t window, float soft_cap, int64_t num_threads) {
    const struct prefill a = {
        .q = q, .k_cache = k_cache, .v_cache = v_cache, .block_table = block_table,
        .context_len = context_len, .num_queries = num_queries, .num_heads = num_heads,
        .num_kv_heads = num_kv_heads, .head_dim = head_dim, .block_size = block_size,
        .scale = scale, .out = out, .scratch = scratch, .window = window,
        .soft_cap = soft_cap, .num_threads = num_threads};
    return prefill_attention(&a, F32);
}

int prefill_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int32_t *block_table, int64_t context_len, int64_t num_queries,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, uint16_t *out, float *scratch,
                           int64_t window, float soft_cap, int64_t num_threads) {
    const struct prefill a = {
        .q = q, .k_cache = k_cache, .v_cache = v_cache, .block_table = block_table,
        .context_len = context_len, .num_queries = num_queries, .num_heads = num_heads,
        .num_kv_heads = num_kv_heads, .head_dim = head_dim, .block_size = block_size,
        .scale = scale, .out = out, .scratch = scratch, .window = window,
        .soft_cap = soft_cap, .num_threads = num_threads};
    return prefill_attention(&a, BF16);
}
