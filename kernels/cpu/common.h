/* What every CPU kernel shares: float32 and bfloat16 element access (bfloat16 as its 16 bits,
 * widened to float32 to compute, rounded back to nearest-even as torch rounds). */
#ifndef STEPSCOPE_CPU_COMMON_H
#define STEPSCOPE_CPU_COMMON_H

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

#endif
