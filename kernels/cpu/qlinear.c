/* Matrix products against quantized weights, the GGUF's integers as they are (worker forward,
 * stage 6): y = x @ W.T for a step's few tokens, reading a quarter to a half of the bytes a
 * bfloat16 weight takes.
 *
 * Every GGUF block type stepscope runs is repacked (engine/layers/quantization/gguf.py) into
 * one form: unsigned integers u in blocks of `block` (32, or 16 for Q6_K) along a weight row,
 * each block with a float32 scale and a float32 min,
 *
 *   w[r, j] = scales[r, b] * u[r, j] + mins[r, b],     b = j / block
 *
 * u of `bits` 4 (two a byte: byte i of a 32-block holds element i in its low nibble and
 * element i + 16 in its high one, Q4_0/Q4_1's own order) or 8 (one a byte).
 *
 * The activations are quantized for integer dot products, as llama.cpp does, but to 16 bits where
 * llama.cpp takes 8: each token's row, per block, to int16 q = round(x / d) with
 * d = max|x| / 32767, beside the block's float sum s. (8 bits cost SmolLM2 5% of its top-1
 * agreement with the dequantized weights under teacher forcing; 16 bits make the rounding
 * smaller than bfloat16's.) Then per weight block, one integer dot product and two
 * multiply-adds:
 *
 *   y[t, r] = sum_b  scales[r, b] * d[t, b] * sum_j u[r, j] q[t, j]  +  mins[r, b] * s[t, b]
 *
 * The weight side is exact; the error is the activations' 16-bit rounding (measured against
 * the dequantized weights by `stepscope bench accuracy`). With AVX512-VNNI a block of 32 is
 * one instruction (vpdpwssd: the weights widened to int16 times the activations, summed in
 * pairs into sixteen int32 lanes); elsewhere, portable loops.
 *
 * Rows are spread over OpenMP threads, a contiguous run each; each row is read once for up to
 * four tokens at a time.
 *
 * Layouts (contiguous, row-major): x [m, k]; qs [n, k * bits / 8] uint8; scales, mins
 * [n, k / block] float32; out [m, n]. k a multiple of 32.
 */
#include <math.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

int qlinear_paths(int64_t *paths) {
    *paths = HAVE_VNNI;
    return 0;
}

/* The quantized activations, grown as needed and kept: a step allocates nothing. One per
 * calling thread (the caller quantizes before the parallel region, and hands the pointers to
 * the threads that read them). */
struct activations {
    const int16_t *q;
    const float *d, *s;
};

static __thread int16_t *act_q;
static __thread float *act_d, *act_s;
static __thread int64_t act_q_capacity, act_b_capacity;

static int reserve_activations(int64_t values, int64_t blocks) {
    if (values > act_q_capacity) {
        free(act_q);
        act_q = NULL;
        act_q_capacity = 0;
        if (posix_memalign((void **)&act_q, 64, (size_t)values * sizeof(int16_t))) return 1;
        act_q_capacity = values;
    }
    if (blocks > act_b_capacity) {
        free(act_d);
        free(act_s);
        act_d = malloc((size_t)blocks * sizeof(float));
        act_s = malloc((size_t)blocks * sizeof(float));
        act_b_capacity = 0;
        if (act_d == NULL || act_s == NULL) return 1;
        act_b_capacity = blocks;
    }
    return 0;
}

static inline ALWAYS_INLINE void quantize_activations(enum dtype dt, const void *x, int64_t m,
                                                      int64_t k, int64_t block) {
    const int64_t nb = k / block;
    for (int64_t t = 0; t < m; t++) {
        for (int64_t b = 0; b < nb; b++) {
            const int64_t base = t * k + b * block;
            float amax = 0.0f, sum = 0.0f;
            for (int64_t j = 0; j < block; j++) {
                const float v = load_as(dt, x, base + j);
                amax = fmaxf(amax, fabsf(v));
                sum += v;
            }
            const float d = amax / 32767.0f;
            const float inv = d > 0.0f ? 1.0f / d : 0.0f;
            for (int64_t j = 0; j < block; j++)
                act_q[base + j] = (int16_t)roundf(load_as(dt, x, base + j) * inv);
            act_d[t * nb + b] = d;
            act_s[t * nb + b] = sum;
        }
    }
}

#if HAVE_VNNI
/* Elements j..j+31 of a weight row as 32 int16, in order. */
static inline ALWAYS_INLINE __m512i load_weights(const uint8_t *row, int64_t j, int bits) {
    if (bits == 8) return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + j)));
    const __m128i packed = _mm_loadu_si128((const __m128i *)(row + j / 2));
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m256i bytes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low),
                                           _mm_and_si128(packed, low));
    return _mm512_cvtepu8_epi16(bytes);
}
#endif

#if HAVE_VNNI
/* Elements j..j+31 of a row against `nt` tokens: acc[t] += the block's integer dot product
 * (vpdpwssd) times its weight scale and the token's activation scale (one per block of 32, or
 * two blocks of 16: lanes 0-7 the first, 8-15 the second). */
static inline ALWAYS_INLINE void block_dots(int bits, int block, int nt, const uint8_t *row_q,
                                            const float *row_s, const int16_t *act_q,
                                            const float *act_d, int64_t t0, int64_t k, int64_t nb,
                                            int64_t j, __m512 *acc) {
    const __m512i u = load_weights(row_q, j, bits);
    const int64_t b = j / block;
    for (int t = 0; t < nt; t++) {
        const int64_t tb = (t0 + t) * nb + b;
        const __m512i q = _mm512_loadu_si512((const void *)(act_q + (t0 + t) * k + j));
        const __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), u, q);
        __m512 scale;
        if (block == 32)
            scale = _mm512_set1_ps(row_s[b] * act_d[tb]);
        else
            scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(row_s[b] * act_d[tb]),
                                         _mm512_set1_ps(row_s[b + 1] * act_d[tb + 1]));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[t]);
    }
}
#endif

/* The dot products of one weight row with `nt` tokens' quantized activations (nt a constant
 * at each call: the accumulators stay in registers). */
static inline ALWAYS_INLINE void row_dots(int bits, int block, int nt, const uint8_t *row_q,
                                          const float *row_s, const float *row_m,
                                          const struct activations *a, int64_t t0, int64_t k,
                                          float *result) {
    const int16_t *act_q = a->q;
    const float *act_d = a->d, *act_s = a->s;
    const int64_t nb = k / block;
    /* The mins' part first, a dot product over the row's blocks per token (vectorized). */
    float mins[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int t = 0; t < nt; t++) {
        const float *sums = act_s + (t0 + t) * nb;
        float m = 0.0f;
#pragma omp simd reduction(+ : m)
        for (int64_t b = 0; b < nb; b++) m += row_m[b] * sums[b];
        mins[t] = m;
    }
#if HAVE_VNNI
    /* Two accumulators a token, even and odd blocks, so that each multiply-add waits on the
     * one two blocks back: one chain would leave the loop bound by its latency at one token. */
    __m512 even[4], odd[4];
    for (int t = 0; t < nt; t++) even[t] = odd[t] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 64 <= k; j += 64) {
        block_dots(bits, block, nt, row_q, row_s, act_q, act_d, t0, k, nb, j, even);
        block_dots(bits, block, nt, row_q, row_s, act_q, act_d, t0, k, nb, j + 32, odd);
    }
    if (j < k) block_dots(bits, block, nt, row_q, row_s, act_q, act_d, t0, k, nb, j, even);
    for (int t = 0; t < nt; t++)
        result[t] = _mm512_reduce_add_ps(_mm512_add_ps(even[t], odd[t])) + mins[t];
#else
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = 0; b < nb; b++) {
        const int64_t j0 = b * block;
        for (int t = 0; t < nt; t++) {
            const int16_t *q = act_q + (t0 + t) * k + j0;
            int32_t dot = 0;
            for (int64_t j = 0; j < block; j++) {
                const int64_t e = j0 + j;
                int32_t u;
                if (bits == 8) {
                    u = row_q[e];
                } else {
                    const int64_t within = e % 32, byte = (e - within) / 2 + within % 16;
                    u = within < 16 ? (row_q[byte] & 0x0F) : (row_q[byte] >> 4);
                }
                dot += u * (int32_t)q[j];
            }
            acc[t] += row_s[b] * act_d[(t0 + t) * nb + b] * (float)dot;
        }
    }
    for (int t = 0; t < nt; t++) result[t] = acc[t] + mins[t];
#endif
}

static inline ALWAYS_INLINE void rows_times(enum dtype dt, int bits, int block, const uint8_t *qs,
                                            const float *scales, const float *mins,
                                            const struct activations *a, int64_t m, int64_t k,
                                            int64_t n, void *out, int64_t row) {
    const int64_t nb = k / block, row_bytes = k * bits / 8;
    const uint8_t *row_q = qs + row * row_bytes;
    const float *row_s = scales + row * nb, *row_m = mins + row * nb;
    float result[4];
    for (int64_t t0 = 0; t0 < m; t0 += 4) {
        const int64_t nt = m - t0 < 4 ? m - t0 : 4;
        switch (nt) {
        case 1: row_dots(bits, block, 1, row_q, row_s, row_m, a, t0, k, result); break;
        case 2: row_dots(bits, block, 2, row_q, row_s, row_m, a, t0, k, result); break;
        case 3: row_dots(bits, block, 3, row_q, row_s, row_m, a, t0, k, result); break;
        default: row_dots(bits, block, 4, row_q, row_s, row_m, a, t0, k, result); break;
        }
        for (int64_t t = 0; t < nt; t++) store_as(dt, out, (t0 + t) * n + row, result[t]);
    }
}

static inline ALWAYS_INLINE int qlinear(enum dtype dt, const void *x, int64_t m, int64_t k,
                                        const uint8_t *qs, const float *scales, const float *mins,
                                        int64_t n, int64_t bits, int64_t block, void *out,
                                        int64_t num_threads) {
    if (m < 0 || n < 1 || k < 32 || k % 32 || num_threads < 1) return 1;
    if (!((bits == 4 && block == 32) || (bits == 8 && (block == 32 || block == 16)))) return 2;
    if (m == 0) return 0;
    if (reserve_activations(m * k, m * (k / block))) return 3;
    quantize_activations(dt, x, m, k, block);
    /* The OpenMP threads read the caller's buffers: their own thread-locals are not these. */
    const struct activations a = {act_q, act_d, act_s};
    /* Each thread one contiguous run of rows, so that its reads stream: rows dealt out in chunks
     * of 16 made each thread jump over the other's rows every 4.6 KB, and the hardware
     * prefetcher lost the stream at every jump (one stream's projections took 8.0-8.6 ms a token
     * that way against 4.8-5.3 ms, the LM head 1.4-2.4 ms against 0.9-1.2). A weight too small
     * to split runs on the caller. */
#define ROWS(BITS, BLOCK)                                                                        \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(n * k >= 65536)")     \
    for (int64_t row = 0; row < n; row++)                                                        \
        rows_times(dt, BITS, BLOCK, qs, scales, mins, &a, m, k, n, out, row);
    if (bits == 4) {
        ROWS(4, 32)
    } else if (block == 32) {
        ROWS(8, 32)
    } else {
        ROWS(8, 16)
    }
#undef ROWS
    return 0;
}

int qlinear_f32(const float *x, int64_t m, int64_t k, const uint8_t *qs, const float *scales,
                const float *mins, int64_t n, int64_t bits, int64_t block, float *out,
                int64_t num_threads) {
    return qlinear(F32, x, m, k, qs, scales, mins, n, bits, block, out, num_threads);
}

int qlinear_bf16(const uint16_t *x, int64_t m, int64_t k, const uint8_t *qs, const float *scales,
                 const float *mins, int64_t n, int64_t bits, int64_t block, uint16_t *out,
                 int64_t num_threads) {
    return qlinear(BF16, x, m, k, qs, scales, mins, n, bits, block, out, num_threads);
}
