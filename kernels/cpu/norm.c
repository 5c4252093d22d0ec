/* RMSNorm on the CPU, with the residual add before it in the same pass (worker forward,
 * stage 6), op for op as transformers' LlamaRMSNorm computes it:
 *
 *   sum = x + residual             (in the model's dtype; only with a residual)
 *   h   = float32(sum)
 *   h   = h * (1 / sqrt(mean(h * h) + eps))
 *   out = weight * dtype(h)        (in the model's dtype)
 *
 * torch runs that as seven or eight kernels, each a pass over the activations and, for a
 * decode step of a few tokens, mostly dispatch; here it is one pass per row, rows spread over
 * OpenMP threads. Compiled with -ffp-contract=off: every product and sum rounds where torch's
 * would, so float32 results differ from torch's only by the order of the sum of squares.
 *
 * x, residual, sum_out, out: [rows, hidden], contiguous; weight: [hidden]. residual may be
 * NULL (no add; sum_out unused).
 */
#include "common.h"
#include "kernels.h"

#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                            \
    int NAME(const T *x, const T *residual, const T *weight, float eps, T *out, T *sum_out,    \
             int64_t rows, int64_t hidden, int64_t num_threads) {                              \
        if (rows < 0 || hidden < 1 || num_threads < 1) return 1;                               \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows > 1)")     \
        for (int64_t row = 0; row < rows; row++) {                                             \
            const T *xr = x + row * hidden;                                                    \
            T *o = out + row * hidden;                                                         \
            float squares = 0.0f;                                                              \
            if (residual != NULL) {                                                            \
                const T *rr = residual + row * hidden;                                         \
                T *sr = sum_out + row * hidden;                                                \
                _Pragma("omp simd reduction(+ : squares)")                                     \
                for (int64_t i = 0; i < hidden; i++) {                                         \
                    const float s = ROUND(LOAD(xr + i) + LOAD(rr + i));                        \
                    STORE(sr + i, s);                                                          \
                    squares += s * s;                                                          \
                }                                                                              \
                xr = sr;                                                                       \
            } else {                                                                           \
                _Pragma("omp simd reduction(+ : squares)")                                     \
                for (int64_t i = 0; i < hidden; i++) {                                         \
                    const float s = LOAD(xr + i);                                              \
                    squares += s * s;                                                          \
                }                                                                              \
            }                                                                                  \
            const float scale = 1.0f / __builtin_sqrtf(squares / (float)hidden + eps);         \
            _Pragma("omp simd")                                                                \
            for (int64_t i = 0; i < hidden; i++)                                               \
                STORE(o + i, LOAD(weight + i) * ROUND(LOAD(xr + i) * scale));                  \
        }                                                                                      \
        return 0;                                                                              \
    }

DEFINE_RMS_NORM(rms_norm_f32, float, load_f32, store_f32, round_f32)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, load_bf16, store_bf16, round_bf16)
