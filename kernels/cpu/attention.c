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
 * Compiled with -ffp-contract=fast (multiply-adds fused) and -fno-trapping-math (so that the
 * exponential's floor vectorizes); see build.py.
 *
 * Layouts (all contiguous, row-major):
 *   q        [num_seqs, num_heads, head_dim]
 *   k_cache  [num_blocks, block_size, num_kv_heads, head_dim]   (v_cache the same)
 *   block_tables [num_seqs, bt_stride] int32, seq_lens [num_seqs] int32 (context incl. query)
 *   scratch  float32, num_threads * num_heads * (max_len + 2 * head_dim) entries (each
 *            thread's scores, query rows and accumulators)
 *   out      [num_seqs, num_heads, head_dim]
 */
#include <omp.h>

#include "common.h"

/* Ask for the next block while this one is computed on: blocks lie anywhere in the pool, so
 * the hardware prefetcher, which follows addresses, cannot guess where the next one is. */
static inline void prefetch_block(const void *start, int64_t bytes) {
    const char *p = (const char *)start;
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 3);
}

/* e^x for x <= 0, in a form a loop over it vectorizes: x = n ln2 + r with |r| <= ln2 / 2,
 * e^r by its Taylor polynomial to r^7 (relative error under 2e-7), 2^n from exponent bits. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f; /* ln2, high part: exact in float */
    r = r - n * 1.428606765330187e-06f;  /* ln2, low part */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* Softmax of row[0..n) in place; returns nothing, leaves probabilities. */
static inline void softmax_row(float *row, int64_t n) {
    float max = row[0];
#pragma omp simd reduction(max : max)
    for (int64_t t = 1; t < n; t++) max = row[t] > max ? row[t] : max;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        const float p = exp_nonpositive(row[t] - max);
        row[t] = p;
        sum += p;
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; t++) row[t] *= inv;
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
static inline void scores_16_d64(const float *keys, int64_t key_stride, int64_t num_kv_heads,
                                 int64_t group, const float *qs, float *scores, int64_t max_len,
                                 float scale) {
    for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++) {
        const float *kb = keys + kv_head * 64;
        for (int64_t h = kv_head * group; h < (kv_head + 1) * group; h++) {
            const __m512 q0 = _mm512_loadu_ps(qs + h * 64), q1 = _mm512_loadu_ps(qs + h * 64 + 16);
            const __m512 q2 = _mm512_loadu_ps(qs + h * 64 + 32);
            const __m512 q3 = _mm512_loadu_ps(qs + h * 64 + 48);
            __m512 r[16];
            for (int t = 0; t < 16; t++) {
                const float *k = kb + t * key_stride;
                __m512 s = _mm512_mul_ps(q0, _mm512_loadu_ps(k));
                s = _mm512_fmadd_ps(q1, _mm512_loadu_ps(k + 16), s);
                s = _mm512_fmadd_ps(q2, _mm512_loadu_ps(k + 32), s);
                r[t] = _mm512_fmadd_ps(q3, _mm512_loadu_ps(k + 48), s);
            }
            _mm512_storeu_ps(scores + h * max_len, _mm512_mul_ps(sum_lanes_16(r), _mm512_set1_ps(scale)));
        }
    }
}

/* Pass 2 for N query heads of one KV head: each value row is read once for all N, and the
 * N * 4 sums are independent chains held in registers. */
#define DEFINE_VALUES_D64(N)                                                                   \
    static inline void values_##N##_d64(const float *vb, int64_t n, int64_t key_stride,        \
                                        const float *p, int64_t max_len, float *acc) {         \
        __m512 a[N][4];                                                                        \
        for (int i = 0; i < N; i++)                                                            \
            for (int c = 0; c < 4; c++) a[i][c] = _mm512_loadu_ps(acc + i * 64 + c * 16);       \
        for (int64_t t = 0; t < n; t++) {                                                      \
            const float *v = vb + t * key_stride;                                              \
            const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);                \
            const __m512 v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);           \
            for (int i = 0; i < N; i++) {                                                      \
                const __m512 w = _mm512_set1_ps(p[i * max_len + t]);                           \
                a[i][0] = _mm512_fmadd_ps(w, v0, a[i][0]);                                     \
                a[i][1] = _mm512_fmadd_ps(w, v1, a[i][1]);                                     \
                a[i][2] = _mm512_fmadd_ps(w, v2, a[i][2]);                                     \
                a[i][3] = _mm512_fmadd_ps(w, v3, a[i][3]);                                     \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < N; i++)                                                            \
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + i * 64 + c * 16, a[i][c]);       \
    }
DEFINE_VALUES_D64(1)
DEFINE_VALUES_D64(2)
DEFINE_VALUES_D64(3)
DEFINE_VALUES_D64(4)

/* Pass 2 over one block: for each KV head, its query heads four (or fewer) at a time. p is
 * the probabilities at the block's first key, acc the [num_heads][64] sums. */
static inline void values_block_d64(const float *block, int64_t n, int64_t key_stride,
                                    int64_t num_kv_heads, int64_t group, const float *p,
                                    int64_t max_len, float *acc) {
    for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++) {
        const float *vb = block + kv_head * 64;
        for (int64_t h = kv_head * group; h < (kv_head + 1) * group; h += 4) {
            const int64_t left = (kv_head + 1) * group - h;
            const float *ph = p + h * max_len;
            float *ah = acc + h * 64;
            if (left >= 4) values_4_d64(vb, n, key_stride, ph, max_len, ah);
            else if (left == 3) values_3_d64(vb, n, key_stride, ph, max_len, ah);
            else if (left == 2) values_2_d64(vb, n, key_stride, ph, max_len, ah);
            else values_1_d64(vb, n, key_stride, ph, max_len, ah);
        }
    }
}
#else
#define HAVE_AVX512 0
static inline void scores_16_d64(const float *keys, int64_t key_stride, int64_t num_kv_heads,
                                 int64_t group, const float *qs, float *scores, int64_t max_len,
                                 float scale) {
    (void)keys, (void)key_stride, (void)num_kv_heads, (void)group, (void)qs, (void)scores,
        (void)max_len, (void)scale;
}
static inline void values_block_d64(const float *block, int64_t n, int64_t key_stride,
                                    int64_t num_kv_heads, int64_t group, const float *p,
                                    int64_t max_len, float *acc) {
    (void)block, (void)n, (void)key_stride, (void)num_kv_heads, (void)group, (void)p,
        (void)max_len, (void)acc;
}
#endif

/* HD is the head dimension: a literal for the common sizes, so that the loops over it unroll
 * and the accumulators stay in registers, or `head_dim` itself for any other size. */
/* The block of `table` holding token `start` of `cache`, as float32 (through WIDEN), with the
 * next one (if the context has one) asked for ahead. */
#define BLOCK_AT(cache, start, n, WIDEN)                                                       \
    (((start) + block_size < len                                                               \
          ? prefetch_block((cache) + (int64_t)table[(start) / block_size + 1] * block_size     \
                                         * key_stride,                                         \
                           block_bytes)                                                        \
          : (void)0),                                                                          \
     WIDEN((cache) + (int64_t)table[(start) / block_size] * block_size * key_stride,           \
           (n) * key_stride, wide))

/* WIDEN gives a block as float32: the block itself for float32, else widened once into the
 * thread's buffer, rather than at every use (each key and value serves every query head of
 * its group). */
#define DEFINE_DECODE_ATTENTION(NAME, T, LOAD, STORE, HD, WIDEN)                               \
    static int NAME(const T *q, const T *k_cache, const T *v_cache,                            \
                    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,   \
                    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,                 \
                    int64_t head_dim, int64_t block_size, float scale, T *out, float *scratch, \
                    int64_t max_len, int64_t num_threads) {                                    \
        const int64_t group = num_heads / num_kv_heads;                                        \
        if (group * num_kv_heads != num_heads || num_threads < 1) return 1;                    \
        for (int64_t s = 0; s < num_seqs; s++)                                                 \
            if (seq_lens[s] < 1 || seq_lens[s] > max_len) return 2;                            \
        const int64_t key_stride = num_kv_heads * HD; /* between two keys of a block */        \
        const int64_t block_bytes = block_size * key_stride * (int64_t)sizeof(T);              \
        _Pragma("omp parallel num_threads(num_threads)") {                                     \
            const int64_t me = omp_get_thread_num();                                           \
            float *scores = scratch + me * num_heads * max_len; /* [num_heads][max_len] */     \
            float *qs = scratch + num_threads * num_heads * max_len + me * 2 * num_heads * HD; \
            float *acc = qs + num_heads * HD; /* [num_heads][HD] */                            \
            float *wide = scratch + num_threads * num_heads * (max_len + 2 * HD)               \
                          + me * block_size * key_stride; /* one block, widened */             \
            _Pragma("omp for schedule(dynamic, 1)")                                            \
            for (int64_t seq = 0; seq < num_seqs; seq++) {                                     \
                const int64_t len = seq_lens[seq];                                             \
                const int32_t *table = block_tables + seq * bt_stride;                         \
                for (int64_t i = 0; i < num_heads * HD; i++) {                                 \
                    qs[i] = LOAD(q + seq * num_heads * HD + i);                                \
                    acc[i] = 0.0f;                                                             \
                }                                                                              \
                /* Pass 1: scores, a block at a time (every KV head of it: one contiguous      \
                 * stretch of memory), four keys at a time. */                                 \
                for (int64_t start = 0; start < len; start += block_size) {                    \
                    const int64_t n = len - start < block_size ? len - start : block_size;     \
                    const float *block = BLOCK_AT(k_cache, start, n, WIDEN);                   \
                    int64_t t0 = 0; /* keys done in tiles of 16 */                             \
                    if (HAVE_AVX512 && HD == 64)                                               \
                        for (; t0 + 16 <= n; t0 += 16)                                         \
                            scores_16_d64(block + t0 * key_stride, key_stride, num_kv_heads,   \
                                          group, qs, scores + start + t0, max_len, scale);     \
                    for (int64_t kv_head = 0; kv_head < num_kv_heads && t0 < n; kv_head++) {   \
                        const float *kb = block + kv_head * HD;                                \
                        int64_t t = t0;                                                        \
                        for (; t + 4 <= n; t += 4) {                                           \
                            const float *k0 = kb + t * key_stride, *k1 = k0 + key_stride;      \
                            const float *k2 = k1 + key_stride, *k3 = k2 + key_stride;          \
                            for (int64_t h = kv_head * group; h < (kv_head + 1) * group; h++) {\
                                const float *x = qs + h * HD;                                  \
                                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;              \
                                _Pragma("omp simd reduction(+ : s0, s1, s2, s3)")              \
                                for (int64_t d = 0; d < HD; d++) {                             \
                                    s0 += x[d] * k0[d];                                        \
                                    s1 += x[d] * k1[d];                                        \
                                    s2 += x[d] * k2[d];                                        \
                                    s3 += x[d] * k3[d];                                        \
                                }                                                              \
                                float *row = scores + h * max_len + start + t;                 \
                                row[0] = s0 * scale;                                           \
                                row[1] = s1 * scale;                                           \
                                row[2] = s2 * scale;                                           \
                                row[3] = s3 * scale;                                           \
                            }                                                                  \
                        }                                                                      \
                        for (; t < n; t++) {                                                   \
                            const float *key = kb + t * key_stride;                            \
                            for (int64_t h = kv_head * group; h < (kv_head + 1) * group; h++) {\
                                const float *x = qs + h * HD;                                  \
                                float s0 = 0.0f;                                               \
                                _Pragma("omp simd reduction(+ : s0)")                          \
                                for (int64_t d = 0; d < HD; d++) s0 += x[d] * key[d];          \
                                scores[h * max_len + start + t] = s0 * scale;                  \
                            }                                                                  \
                        }                                                                      \
                    }                                                                          \
                }                                                                              \
                for (int64_t h = 0; h < num_heads; h++) softmax_row(scores + h * max_len, len);\
                /* Pass 2: the values, weighted by the probabilities, a block at a time. */   \
                for (int64_t start = 0; start < len; start += block_size) {                    \
                    const int64_t n = len - start < block_size ? len - start : block_size;     \
                    const float *block = BLOCK_AT(v_cache, start, n, WIDEN);                   \
                    if (HAVE_AVX512 && HD == 64) {                                             \
                        values_block_d64(block, n, key_stride, num_kv_heads, group,            \
                                         scores + start, max_len, acc);                        \
                        continue;                                                              \
                    }                                                                          \
                    for (int64_t h = 0; h < num_heads; h++) {                                  \
                        const float *vb = block + (h / group) * HD;                            \
                        const float *p = scores + h * max_len + start;                         \
                        /* 32 columns at a time: their sums stay in registers over the     \
                         * block's keys. */                                                    \
                        int64_t d0 = 0;                                                        \
                        for (; d0 + 32 <= HD; d0 += 32) {                                      \
                            float a[32];                                                       \
                            for (int64_t j = 0; j < 32; j++) a[j] = acc[h * HD + d0 + j];      \
                            for (int64_t t = 0; t < n; t++) {                                  \
                                const float *value = vb + t * key_stride + d0;                 \
                                const float w = p[t];                                          \
                                _Pragma("omp simd")                                            \
                                for (int64_t j = 0; j < 32; j++) a[j] += w * value[j];         \
                            }                                                                  \
                            for (int64_t j = 0; j < 32; j++) acc[h * HD + d0 + j] = a[j];      \
                        }                                                                      \
                        for (; d0 < HD; d0++)                                                  \
                            for (int64_t t = 0; t < n; t++)                                    \
                                acc[h * HD + d0] += p[t] * vb[t * key_stride + d0];            \
                    }                                                                          \
                }                                                                              \
                for (int64_t i = 0; i < num_heads * HD; i++)                                   \
                    STORE(out + seq * num_heads * HD + i, acc[i]);                             \
            }                                                                                  \
        }                                                                                      \
        return 0;                                                                              \
    }

DEFINE_DECODE_ATTENTION(attend_f32_d64, float, load_f32, store_f32, 64, widen_f32)
DEFINE_DECODE_ATTENTION(attend_f32_d128, float, load_f32, store_f32, 128, widen_f32)
DEFINE_DECODE_ATTENTION(attend_f32_any, float, load_f32, store_f32, head_dim, widen_f32)
DEFINE_DECODE_ATTENTION(attend_bf16_d64, uint16_t, load_bf16, store_bf16, 64, widen_bf16)
DEFINE_DECODE_ATTENTION(attend_bf16_d128, uint16_t, load_bf16, store_bf16, 128, widen_bf16)
DEFINE_DECODE_ATTENTION(attend_bf16_any, uint16_t, load_bf16, store_bf16, head_dim, widen_bf16)

#define DEFINE_ENTRY(NAME, T, D64, D128, ANY)                                                  \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,      \
             int64_t bt_stride, const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads,  \
             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, T *out,  \
             float *scratch, int64_t max_len, int64_t num_threads) {                          \
        int (*fn)(const T *, const T *, const T *, const int32_t *, int64_t, const int32_t *,  \
                  int64_t, int64_t, int64_t, int64_t, int64_t, float, T *, float *, int64_t,   \
                  int64_t) = head_dim == 64 ? D64 : head_dim == 128 ? D128 : ANY;              \
        return fn(q, k_cache, v_cache, block_tables, bt_stride, seq_lens, num_seqs, num_heads, \
                  num_kv_heads, head_dim, block_size, scale, out, scratch, max_len,            \
                  num_threads);                                                                \
    }

DEFINE_ENTRY(decode_attention_f32, float, attend_f32_d64, attend_f32_d128, attend_f32_any)
DEFINE_ENTRY(decode_attention_bf16, uint16_t, attend_bf16_d64, attend_bf16_d128, attend_bf16_any)
