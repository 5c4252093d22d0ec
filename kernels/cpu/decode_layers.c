/* Every decoder layer of a decode step in one call (worker forward, stage 6): the one-stream
 * path, where each token is a few milliseconds of work and Python's per-op dispatch would be
 * half of it.
 *
 * A decode step of a Llama-family model with GGUF weights runs, per layer, the same kernels the
 * Python forward (engine/models/llama.py) calls one by one, in the same order and precision,
 * here called from C:
 *
 *   xn, residual = rms_norm(x + residual)            norm.c (the first layer: no add)
 *   qkv          = xn @ Wqkv.T                        qlinear.c
 *   q, k         = rotary(q, k)                       rotary.c
 *   cache[slot]  = k, v                               (a copy per token)
 *   attn         = decode_attention(q, cache)         attention.c
 *   x            = attn @ Wo.T                        qlinear.c
 *   xn, residual = rms_norm(x + residual)             norm.c
 *   x            = (silu(gate) * up)(xn @ Wgu.T) @ Wdown.T    qlinear.c, and here
 *
 * and leaves x and residual for the final norm. Python gathers each layer's weight addresses
 * once (engine/models/fused_decode.py); a step passes the step's positions, slots and block
 * tables. Intermediate buffers are kept between calls (grown as needed): a step allocates
 * nothing.
 *
 * weights: per layer, the addresses of input_layernorm, post_attention_layernorm, then qs,
 * scales, mins of the fused qkv, o, fused gate_up and down projections (14); formats: per
 * layer, (bits, block) of those four (8); kv_caches: per layer, the k and v cache addresses.
 * The caches are [blocks, block_size, num_kv_heads, head_dim]; slots [tokens] int64.
 */
#include <math.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

enum { W_INPUT_NORM, W_POST_NORM, W_QKV, W_O = W_QKV + 3, W_GATE_UP = W_O + 3,
       W_DOWN = W_GATE_UP + 3, W_PER_LAYER = W_DOWN + 3 };

static __thread char *workspace;
static __thread int64_t workspace_bytes;

static char *reserve_workspace(int64_t bytes) {
    if (bytes > workspace_bytes) {
        free(workspace);
        workspace_bytes = 0;
        if (posix_memalign((void **)&workspace, 64, (size_t)bytes)) return workspace = NULL;
        workspace_bytes = bytes;
    }
    return workspace;
}

#define ADDR(T, a) ((T *)(intptr_t)(a))

#define DEFINE_DECODE_LAYERS(SUFFIX, T, LOAD, STORE, ROUND)                                     \
    int decode_layers_##SUFFIX(                                                                 \
        T *x, T *residual, const int64_t *weights, const int64_t *formats, int64_t num_layers,  \
        const int64_t *kv_caches, int64_t tokens, int64_t hidden, int64_t num_heads,           \
        int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, float eps, float scale,  \
        const int64_t *positions, const T *rope_cache, int64_t max_positions,                  \
        const int64_t *slots, const int32_t *block_tables, int64_t bt_stride,                  \
        const int32_t *seq_lens, int64_t block_size, int64_t max_len, int64_t num_threads) {   \
        if (tokens < 1 || num_layers < 1 || num_threads < 1) return 1;                         \
        const int64_t hq = num_heads * head_dim, hk = num_kv_heads * head_dim;                 \
        const int64_t qkv_width = hq + 2 * hk;                                                 \
        /* xn, qkv, q, k, attn, gate_up, act in T; then attention's float scratch. */          \
        const int64_t values = tokens * (hidden + qkv_width + hq + hk + hq + 3 * intermediate); \
        const int64_t scratch_floats =                                                         \
            num_threads * (num_heads * (max_len + 2 * head_dim) + block_size * hk);            \
        const int64_t t_bytes = (values * (int64_t)sizeof(T) + 63) / 64 * 64;                  \
        char *space = reserve_workspace(t_bytes + scratch_floats * (int64_t)sizeof(float));    \
        if (space == NULL) return 3;                                                           \
        T *xn = (T *)space, *qkv = xn + tokens * hidden, *q = qkv + tokens * qkv_width;        \
        T *k = q + tokens * hq, *attn = k + tokens * hk, *gate_up = attn + tokens * hq;        \
        T *act = gate_up + tokens * 2 * intermediate;                                          \
        float *scratch = (float *)(space + t_bytes);                                           \
        int status;                                                                            \
        for (int64_t layer = 0; layer < num_layers; layer++) {                                 \
            const int64_t *w = weights + layer * W_PER_LAYER, *f = formats + layer * 8;        \
            T *k_cache = ADDR(T, kv_caches[2 * layer]);                                         \
            T *v_cache = ADDR(T, kv_caches[2 * layer + 1]);                                     \
            if (layer == 0) {                                                                  \
                for (int64_t i = 0; i < tokens * hidden; i++) residual[i] = x[i];             \
                status = rms_norm_##SUFFIX(x, NULL, ADDR(const T, w[W_INPUT_NORM]), eps, xn,    \
                                           NULL, tokens, hidden, num_threads);                 \
            } else {                                                                           \
                status = rms_norm_##SUFFIX(x, residual, ADDR(const T, w[W_INPUT_NORM]), eps,    \
                                           xn, residual, tokens, hidden, num_threads);         \
            }                                                                                  \
            if (status) return 10 + status;                                                    \
            status = qlinear_##SUFFIX(xn, tokens, hidden, ADDR(const uint8_t, w[W_QKV]),        \
                                      ADDR(const float, w[W_QKV + 1]),                         \
                                      ADDR(const float, w[W_QKV + 2]), qkv_width, f[0], f[1],  \
                                      qkv, num_threads);                                       \
            if (status) return 20 + status;                                                    \
            status = rotary_##SUFFIX(qkv, qkv_width, qkv + hq, qkv_width, positions,            \
                                     rope_cache, max_positions, tokens, num_heads,             \
                                     num_kv_heads, head_dim, q, k, num_threads);               \
            if (status) return 30 + status;                                                    \
            for (int64_t i = 0; i < tokens; i++) {                                             \
                const T *v = qkv + i * qkv_width + hq + hk;                                     \
                for (int64_t j = 0; j < hk; j++) {                                             \
                    k_cache[slots[i] * hk + j] = k[i * hk + j];                                \
                    v_cache[slots[i] * hk + j] = v[j];                                         \
                }                                                                              \
            }                                                                                  \
            status = decode_attention_##SUFFIX(q, k_cache, v_cache, block_tables, bt_stride,    \
                                               seq_lens, tokens, num_heads, num_kv_heads,      \
                                               head_dim, block_size, scale, attn, scratch,     \
                                               0, 0.0f, max_len, num_threads);                 \
            if (status) return 40 + status;                                                    \
            status = qlinear_##SUFFIX(attn, tokens, hq, ADDR(const uint8_t, w[W_O]),            \
                                      ADDR(const float, w[W_O + 1]),                           \
                                      ADDR(const float, w[W_O + 2]), hidden, f[2], f[3], x,    \
                                      num_threads);                                            \
            if (status) return 50 + status;                                                    \
            status = rms_norm_##SUFFIX(x, residual, ADDR(const T, w[W_POST_NORM]), eps, xn,    \
                                       residual, tokens, hidden, num_threads);                 \
            if (status) return 60 + status;                                                    \
            status = qlinear_##SUFFIX(xn, tokens, hidden, ADDR(const uint8_t, w[W_GATE_UP]),    \
                                      ADDR(const float, w[W_GATE_UP + 1]),                     \
                                      ADDR(const float, w[W_GATE_UP + 2]), 2 * intermediate,   \
                                      f[4], f[5], gate_up, num_threads);                       \
            if (status) return 70 + status;                                                    \
            /* silu(gate) * up, each rounded to the model's dtype as torch rounds them; split  \
             * over the threads (a scalar expf each). */                                       \
            _Pragma("omp parallel for collapse(2) schedule(static) num_threads(num_threads)")  \
            for (int64_t i = 0; i < tokens; i++) {                                             \
                for (int64_t j = 0; j < intermediate; j++) {                                   \
                    const T *g = gate_up + i * 2 * intermediate, *u = g + intermediate;        \
                    const float gj = LOAD(g + j);                                              \
                    const float s = ROUND(gj / (1.0f + expf(-gj)));                            \
                    STORE(act + i * intermediate + j, s * LOAD(u + j));                        \
                }                                                                              \
            }                                                                                  \
            status = qlinear_##SUFFIX(act, tokens, intermediate, ADDR(const uint8_t, w[W_DOWN]),\
                                      ADDR(const float, w[W_DOWN + 1]),                        \
                                      ADDR(const float, w[W_DOWN + 2]), hidden, f[6], f[7], x, \
                                      num_threads);                                            \
            if (status) return 80 + status;                                                    \
        }                                                                                      \
        return 0;                                                                              \
    }

DEFINE_DECODE_LAYERS(f32, float, load_f32, store_f32, round_f32)
DEFINE_DECODE_LAYERS(bf16, uint16_t, load_bf16, store_bf16, round_bf16)
