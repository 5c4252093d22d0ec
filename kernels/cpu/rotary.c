/* Rotary position embedding on the CPU (worker forward, stage 6), for q and k in one call,
 * op for op as transformers computes `q * cos + rotate_half(q) * sin` (the rotate_half
 * layout: the first half of each head pairs with the second):
 *
 *   out[j]       = x[j] * cos[j]             + (-x[j + D/2]) * sin[j]
 *   out[j + D/2] = x[j + D/2] * cos[j + D/2] + x[j] * sin[j + D/2]
 *
 * each product and the sum rounded in the model's dtype (-ffp-contract=off keeps them
 * apart). torch runs a gather of the cache, two slices, a negation, a concatenation, four
 * products and two sums per tensor; here one pass reads q and k where the fused QKV
 * projection wrote them (rows `q_stride` / `k_stride` apart) and writes them contiguous.
 *
 * positions: [tokens] int64; cache: [max_positions, 2 * head_dim] (cos, then sin), in the
 * model's dtype; q_out [tokens, num_heads, head_dim], k_out [tokens, num_kv_heads, head_dim].
 */
#include "common.h"
#include "kernels.h"

#define DEFINE_ROTARY(NAME, T, LOAD, STORE, ROUND)                                              \
    static inline void NAME##_head(const T *x, const T *cos, const T *sin, T *out,            \
                                   int64_t half) {                                             \
        _Pragma("omp simd")                                                                    \
        for (int64_t j = 0; j < half; j++) {                                                   \
            const float x1 = LOAD(x + j), x2 = LOAD(x + half + j);                             \
            STORE(out + j, ROUND(x1 * LOAD(cos + j)) + ROUND(-x2 * LOAD(sin + j)));            \
            STORE(out + half + j,                                                              \
                  ROUND(x2 * LOAD(cos + half + j)) + ROUND(x1 * LOAD(sin + half + j)));        \
        }                                                                                      \
    }                                                                                          \
    int NAME(const T *q, int64_t q_stride, const T *k, int64_t k_stride,                       \
             const int64_t *positions, const T *cache, int64_t max_positions, int64_t tokens,  \
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, T *q_out, T *k_out,    \
             int64_t num_threads) {                                                            \
        if (head_dim % 2 || num_threads < 1) return 1;                                         \
        for (int64_t i = 0; i < tokens; i++)                                                   \
            if (positions[i] < 0 || positions[i] >= max_positions) return 2;                   \
        const int64_t half = head_dim / 2;                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(tokens > 1)")   \
        for (int64_t i = 0; i < tokens; i++) {                                                 \
            const T *cos = cache + positions[i] * 2 * head_dim, *sin = cos + head_dim;         \
            for (int64_t h = 0; h < num_heads; h++)                                            \
                NAME##_head(q + i * q_stride + h * head_dim, cos, sin,                         \
                            q_out + (i * num_heads + h) * head_dim, half);                     \
            for (int64_t h = 0; h < num_kv_heads; h++)                                         \
                NAME##_head(k + i * k_stride + h * head_dim, cos, sin,                         \
                            k_out + (i * num_kv_heads + h) * head_dim, half);                  \
        }                                                                                      \
        return 0;                                                                              \
    }

DEFINE_ROTARY(rotary_f32, float, load_f32, store_f32, round_f32)
DEFINE_ROTARY(rotary_bf16, uint16_t, load_bf16, store_bf16, round_bf16)
