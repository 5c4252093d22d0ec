/* Every function the CPU kernels' shared library exports: the one place their arguments are
 * written. Each .c file includes it, so the compiler checks each definition against it
 * (-Werror=missing-prototypes: nothing is exported that is not here), and build.py reads it
 * for the ctypes signatures and the parameter names ops.py calls by. So it stays plain: one
 * prototype per statement, pointers to float, uint16_t (bfloat16, as its bits), uint8_t,
 * int32_t or int64_t, and int64_t, float or int values. Every kernel returns 0, or a code for arguments
 * it refuses. Layouts are described in each kernel's file. */
#ifndef STEPSCOPE_CPU_KERNELS_H
#define STEPSCOPE_CPU_KERNELS_H

#include <stdint.h>

/* attention.c */
/* Writes which of decode attention's CPU-specific routines this build compiled into *paths:
 * 1, the AVX-512 block routines (head_dim 64); 2, bfloat16 dot products (AVX512-BF16). */
int decode_attention_paths(int64_t *paths);
int decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                         const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, float *out,
                         float *scratch, int64_t window, float soft_cap, int64_t max_len,
                         int64_t num_threads);
int decode_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t block_size, float scale, uint16_t *out,
                          float *scratch, int64_t window, float soft_cap, int64_t max_len,
                          int64_t num_threads);

/* prefill_attention.c */
/* Writes into *entries the float32 scratch entries a prefill_attention call needs. */
int prefill_attention_scratch(int64_t keys, int64_t num_kv_heads, int64_t head_dim,
                              int64_t num_threads, int64_t *entries);
int prefill_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                          const int32_t *block_table, int64_t context_len, int64_t num_queries,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, float scale, float *out, float *scratch,
                          int64_t window, float soft_cap, int64_t num_threads);
int prefill_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int32_t *block_table, int64_t context_len, int64_t num_queries,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, uint16_t *out, float *scratch,
                           int64_t window, float soft_cap, int64_t num_threads);

/* decode_layers.c */
int decode_layers_f32(float *x, float *residual, const int64_t *weights, const int64_t *formats,
                      int64_t num_layers, const int64_t *kv_caches, int64_t tokens, int64_t hidden,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t intermediate, float eps, float scale, const int64_t *positions,
                      const float *rope_cache, int64_t max_positions, const int64_t *slots,
                      const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                      int64_t block_size, int64_t max_len, int64_t num_threads);
int decode_layers_bf16(uint16_t *x, uint16_t *residual, const int64_t *weights,
                       const int64_t *formats, int64_t num_layers, const int64_t *kv_caches,
                       int64_t tokens, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t intermediate, float eps, float scale,
                       const int64_t *positions, const uint16_t *rope_cache,
                       int64_t max_positions, const int64_t *slots, const int32_t *block_tables,
                       int64_t bt_stride, const int32_t *seq_lens, int64_t block_size,
                       int64_t max_len, int64_t num_threads);

/* norm.c */
int rms_norm_f32(const float *x, const float *residual, const float *weight, float eps,
                 float *out, float *sum_out, int64_t rows, int64_t hidden, int64_t num_threads);
int rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, float eps,
                  uint16_t *out, uint16_t *sum_out, int64_t rows, int64_t hidden,
                  int64_t num_threads);

/* qlinear.c */
/* Writes which path this build compiled into *paths: 1, AVX512-VNNI integer dot products. */
int qlinear_paths(int64_t *paths);
int qlinear_f32(const float *x, int64_t m, int64_t k, const uint8_t *qs, const float *scales,
                const float *mins, int64_t n, int64_t bits, int64_t block, float *out,
                int64_t num_threads);
int qlinear_bf16(const uint16_t *x, int64_t m, int64_t k, const uint8_t *qs, const float *scales,
                 const float *mins, int64_t n, int64_t bits, int64_t block, uint16_t *out,
                 int64_t num_threads);

/* rotary.c */
int rotary_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
               const int64_t *positions, const float *cache, int64_t max_positions,
               int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               float *q_out, float *k_out, int64_t num_threads);
int rotary_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                const int64_t *positions, const uint16_t *cache, int64_t max_positions,
                int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                uint16_t *q_out, uint16_t *k_out, int64_t num_threads);

/* sampling.c */
int top_k_top_p_f32(const float *logits, const float *temperature, const int64_t *top_k,
                    const float *top_p, int64_t rows, int64_t vocab, float *out_values,
                    int64_t *out_ids, int64_t *out_counts, int64_t capacity, float *scratch,
                    int64_t num_threads);

#endif
