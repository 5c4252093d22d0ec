/* What every CPU kernel shares: float32 and bfloat16 element access (bfloat16 as its 16 bits,
 * widened to float32 to compute, rounded back to nearest-even as torch rounds), and the
 * exponential that softmax loops vectorize (attention's scores, the sampler's rows). */
#ifndef STEPSCOPE_CPU_COMMON_H
#define STEPSCOPE_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float load_f32(const float *p) { return *p; }
static inline void store_f32(float *p, float f) { *p = f; }

static inline float load_bf16(const uint16_t *p) {
    uint32_t bits = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void store_bf16(uint16_t *p, float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) { /* NaN stays NaN */
        *p = (uint16_t)((bits >> 16) | 0x40u);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    *p = (uint16_t)(bits >> 16);
}

/* A float rounded as the tensor's dtype would hold it. */
static inline float round_f32(float f) { return f; }
static inline float round_bf16(float f) {
    uint16_t h;
    store_bf16(&h, f);
    return load_bf16(&h);
}

/* A run of elements as float32: the run itself for float32, else widened into `buffer`. */
static inline const float *widen_f32(const float *src, int64_t count, float *buffer) {
    (void)count;
    (void)buffer;
    return src;
}

static inline const float *widen_bf16(const uint16_t *src, int64_t count, float *buffer) {
#pragma omp simd
    for (int64_t i = 0; i < count; i++) buffer[i] = load_bf16(src + i);
    return buffer;
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

/* Inlined at every call, even into several callers, so that what is a constant there (the
 * dtype, the head size, a number of heads) specialises the loops: written once, compiled per
 * case, as a C++ template would be. */
#define ALWAYS_INLINE __attribute__((always_inline))

/* A tensor's dtype, a constant at each call of an ALWAYS_INLINE function: the kernels compute
 * in float32 and widen bfloat16 where they read it. */
enum dtype { F32, BF16 };

static inline ALWAYS_INLINE float load_as(enum dtype dt, const void *p, int64_t i) {
    return dt == BF16 ? load_bf16((const uint16_t *)p + i) : load_f32((const float *)p + i);
}

static inline ALWAYS_INLINE void store_as(enum dtype dt, void *p, int64_t i, float f) {
    if (dt == BF16) store_bf16((uint16_t *)p + i, f);
    else store_f32((float *)p + i, f);
}

/* Attention logit soft-capping in place: cap * tanh(x / cap) for row[0..n) (cap > 0; 0: none),
 * as Gemma 2 and 3 bound their scores before the softmax. */
static inline void soft_cap_row(float *row, int64_t n, float cap) {
    if (cap <= 0.0f) return;
    const float inv = 1.0f / cap;
    for (int64_t t = 0; t < n; t++) row[t] = cap * tanhf(row[t] * inv);
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

#endif
