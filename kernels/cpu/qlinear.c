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
 * The activations are quantized for integer dot products, as llama.cpp does, but to 15 bits where
 * llama.cpp takes 8: each token's row, per block, to q = round(x / d) with d = max|x| / 16383,
 * beside the block's float sum s. (8 bits cost SmolLM2 5% of its top-1 agreement with the
 * dequantized weights under teacher forcing; 15 bits make the rounding far smaller than
 * bfloat16's.) Then per weight block, one integer dot product and two multiply-adds:
 *
 *   y[t, r] = sum_b  scales[r, b] * d[t, b] * sum_j u[r, j] q[t, j]  +  mins[r, b] * s[t, b]
 *
 * The weight side is exact; the error is the activations' 15-bit rounding (measured against
 * the dequantized weights by `stepscope bench accuracy`). With AVX512-VNNI, q is split into two
 * signed bytes, q = 128 * hi + lo, and 64 weight bytes meet 64 activation bytes in one
 * instruction (vpdpbusd, unsigned times signed bytes summed in fours into sixteen int32 lanes):
 * a 4-bit weight is never widened, only masked into its low and high nibbles. Why 15 bits and
 * not 16: hi must fit a signed byte. (The 16-bit form before it, vpdpwssd on the weights
 * widened to int16, took 4.0-4.5 ms for the 30 layers' projections of one SmolLM2 token where
 * this takes 3.2-3.5, with the prefetching below.) Elsewhere, portable loops.
 *
 * Rows are spread over OpenMP threads, a contiguous run each; each row is read once for up to
 * four tokens at a time, and a thread asks for the lines of the row PREFETCH_ROWS ahead while it
 * computes (the hardware prefetcher alone left the three streams of a row, integers, scales
 * and mins, short of the memory's bandwidth: the LM head of SmolLM2 took 1.1-1.4 ms after the
 * layers without it, 0.9 with it).
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
 * the threads that read them).
 *
 * Each token's values q = round(x / d), d = max|x| / ACT_MAX per block, |q| < 2^14. With VNNI
 * they are kept as two signed bytes, q = 128 * hi + lo (hi in -128..127, lo in 0..127), so that
 * a byte of weights (unsigned) meets a byte of activations in vpdpbusd: 64 products an
 * instruction and no widening of the weights. A token holds `stride` bytes of hi then `stride`
 * of lo, stride = k rounded up to 128, in the order the weight bytes come (act_position).
 * Without VNNI, int16 q in element order. */
#define ACT_MAX 16383.0f

struct activations {
    const void *q;
    int64_t stride;
    const float *d, *s;
};

static __thread void *act_q;
static __thread float *act_d, *act_s;
static __thread int64_t act_q_capacity, act_b_capacity;

/* How far ahead of the row it reads a thread asks for a row's lines (see the top). */
#define PREFETCH_ROWS 16

static inline int64_t act_stride(int64_t k) { return HAVE_VNNI ? (k + 127) / 128 * 128 : k; }

static int reserve_activations(int64_t bytes, int64_t blocks) {
    if (bytes > act_q_capacity) {
        free(act_q);
        act_q = NULL;
        act_q_capacity = 0;
        if (posix_memalign(&act_q, 64, (size_t)bytes)) return 1;
        act_q_capacity = bytes;
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

/* Where element e of a token goes in its VNNI arrays: 8-bit weights come one element a byte, in
 * order. 4-bit weights come 64 bytes (four blocks of 32) at a time, block g's 16 bytes at 16g,
 * each byte holding elements i (low nibble) and i + 16 (high): so elements 0-15 of the four
 * blocks go, in that order, to the first 64 bytes of the run of 128 and elements 16-31 to the
 * second 64, each meeting the nibbles they multiply. */
static inline ALWAYS_INLINE int64_t act_position(int bits, int64_t e) {
    if (bits == 8) return e;
    const int64_t b = e / 32, w = e % 32;
    return (b / 4) * 128 + (w < 16 ? 0 : 64) + (b % 4) * 16 + w % 16;
}

static inline ALWAYS_INLINE void quantize_activations(enum dtype dt, const void *x, int64_t m,
                                                      int64_t k, int64_t block, int bits) {
    const int64_t nb = k / block, stride = act_stride(k);
    for (int64_t t = 0; t < m; t++) {
        for (int64_t b = 0; b < nb; b++) {
            const int64_t base = t * k + b * block;
            float amax = 0.0f, sum = 0.0f;
            for (int64_t j = 0; j < block; j++) {
                const float v = load_as(dt, x, base + j);
                amax = fmaxf(amax, fabsf(v));
                sum += v;
            }
            const float d = amax / ACT_MAX;
            const float inv = d > 0.0f ? 1.0f / d : 0.0f;
            for (int64_t j = 0; j < block; j++) {
                const int32_t q = (int32_t)roundf(load_as(dt, x, base + j) * inv);
#if HAVE_VNNI
                int8_t *hi = (int8_t *)act_q + t * 2 * stride, *lo = hi + stride;
                const int64_t at = act_position(bits, b * block + j);
                hi[at] = (int8_t)(q >> 7); /* arithmetic shift: floor(q / 128) */
                lo[at] = (int8_t)(q & 127);
#else
                (void)bits;
                (void)stride;
                ((int16_t *)act_q)[base + j] = (int16_t)q;
#endif
            }
            act_d[t * nb + b] = d;
            act_s[t * nb + b] = sum;
        }
    }
}

/* The dot products of one weight row with `nt` tokens' quantized activations (nt a constant
 * at each call: the accumulators stay in registers). */
static inline ALWAYS_INLINE void row_dots(int bits, int block, int nt, const uint8_t *row_q,
                                          const float *row_s, const float *row_m,
                                          const struct activations *a, int64_t t0, int64_t k,
                                          float *result) {
    const float *act_d = a->d, *act_s = a->s;
    const int64_t nb = k / block;
#if HAVE_VNNI
    const int64_t row_bytes = k * bits / 8;
    /* 64 weight bytes a turn: 128 elements of 4 bits (four blocks), 64 of 8 bits (two blocks
     * of 32 or four of 16); a shorter last turn is masked. Each int32 lane of a dot product sums
     * the elements of one block: lanes 4g..4g+3 block g, or with two blocks, 8g..8g+7. Its
     * scale (the weight's times the token's, per block) goes to those lanes, and the turn adds
     * into one float accumulator a token. The mins' part, the blocks' mins times the token's
     * block sums, adds up in a four-lane accumulator beside it. */
    const int8_t *act_q = (const int8_t *)a->q;
    const int64_t stride = a->stride, elements = bits == 4 ? 128 : 64;
    const __m512i idx = bits == 8 && block == 32
                            ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                            : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i nibble = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    for (int64_t i = 0; i < nb; i += 16) { /* this row's scales and mins, PREFETCH_ROWS on */
        _mm_prefetch((const char *)(row_s + PREFETCH_ROWS * nb + i), _MM_HINT_T0);
        _mm_prefetch((const char *)(row_m + PREFETCH_ROWS * nb + i), _MM_HINT_T0);
    }
    __m512 acc[4];
    __m128 acc_mins[4];
    for (int t = 0; t < nt; t++) {
        acc[t] = _mm512_setzero_ps();
        acc_mins[t] = _mm_setzero_ps();
    }
    for (int64_t e = 0; e < k; e += elements) {
        const int64_t n = k - e < elements ? k - e : elements, bytes = n * bits / 8;
        const __mmask64 wmask = bytes == 64 ? ~(__mmask64)0 : ((__mmask64)1 << bytes) - 1;
        const __mmask8 smask = (__mmask8)((1u << (n / block)) - 1);
        const int64_t b = e / block;
        const uint8_t *w_at = row_q + e * bits / 8;
        _mm_prefetch((const char *)(w_at + PREFETCH_ROWS * row_bytes), _MM_HINT_T0);
        const __m512i w = _mm512_maskz_loadu_epi8(wmask, w_at);
        const __m512i w_low = bits == 4 ? _mm512_and_si512(w, nibble) : w;
        const __m512i w_high = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
        const __m128 row_scale = _mm_maskz_loadu_ps(smask, row_s + b);
        const __m128 row_min = _mm_maskz_loadu_ps(smask, row_m + b);
        for (int t = 0; t < nt; t++) {
            const int8_t *hi = act_q + (t0 + t) * 2 * stride + e, *lo = hi + stride;
            __m512i dh = _mm512_dpbusd_epi32(zero, w_low, _mm512_loadu_si512(hi));
            __m512i dl = _mm512_dpbusd_epi32(zero, w_low, _mm512_loadu_si512(lo));
            if (bits == 4) {
                dh = _mm512_dpbusd_epi32(dh, w_high, _mm512_loadu_si512(hi + 64));
                dl = _mm512_dpbusd_epi32(dl, w_high, _mm512_loadu_si512(lo + 64));
            }
            const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dh, 7), dl);
            const int64_t tb = (t0 + t) * nb + b;
            const __m128 scale = _mm_mul_ps(row_scale, _mm_maskz_loadu_ps(smask, act_d + tb));
            const __m512 lanes = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(scale));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), lanes, acc[t]);
            acc_mins[t] = _mm_fmadd_ps(row_min, _mm_maskz_loadu_ps(smask, act_s + tb), acc_mins[t]);
        }
    }
    for (int t = 0; t < nt; t++) {
        const __m512 mins = _mm512_zextps128_ps512(acc_mins[t]);
        result[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], mins));
    }
#else
    const int16_t *act_q = (const int16_t *)a->q;
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
            const int64_t tb = (t0 + t) * nb + b;
            acc[t] += row_s[b] * act_d[tb] * (float)dot + row_m[b] * act_s[tb];
        }
    }
    for (int t = 0; t < nt; t++) result[t] = acc[t];
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
    /* Two bytes an element either way: hi and lo with VNNI, one int16 without. */
    const int64_t act_bytes = m * 2 * act_stride(k);
    if (reserve_activations(act_bytes, m * (k / block))) return 3;
    quantize_activations(dt, x, m, k, block, (int)bits);
    /* The OpenMP threads read the caller's buffers: their own thread-locals are not these. */
    const struct activations a = {act_q, act_stride(k), act_d, act_s};
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
