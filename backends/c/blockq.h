/* tilegraph C backend: kernels on GGUF block-format weights and on a KV cache (blockq.c).
 *
 * A block-format weight stays in memory as its file's bytes: a [N, row_bytes] array of
 * uint8, each row K values in blocks of the format (ir/block_formats.py describes each
 * format once; TG_BQ_* are its formats' numbers here, in blockq.py's table). Every entry
 * point returns 0, or writes tg_err and returns nonzero. */
#ifndef TG_BLOCKQ_H
#define TG_BLOCKQ_H
#include <stdint.h>

enum { TG_BQ_F32 = 0, TG_BQ_F16, TG_BQ_BF16, TG_BQ_Q4_0, TG_BQ_Q4_1, TG_BQ_Q8_0, TG_BQ_Q4_K, TG_BQ_Q6_K, TG_BQ_Q5_0,
       TG_BQ_COUNT };

/* y[M, N] = x[M, K] @ dequant(w)^T, x and y contiguous rows (x row stride K, y row stride ldy). */
int tg_block_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t row_bytes,
                    int fmt, float *y, int64_t ldy);
/* The same with activation='f32': x multiplied as it is, each weight block dequantized to float. */
int tg_block_matmul_f32(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t row_bytes,
                        int fmt, float *y, int64_t ldy);
/* out[i, :] = dequant(w[idx[i], :]) for i < n (an embedding lookup); each idx checked < N. */
int tg_block_rows(const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, int fmt, const int64_t *idx,
                  int64_t n, float *out);
/* cache[b, h, pos_b + t, :] = x[b, h, t, :], in place; elem bytes per value. pos_b = pos[b * pstride]
 * (pstride 0: one position for every sequence). */
int tg_cache_write(void *cache, const void *x, int64_t B, int64_t Hkv, int64_t S, int64_t T, int64_t D,
                   int64_t elem, const int64_t *pos, int64_t pstride);
/* The same into an f16 cache: each value rounded to nearest even (F16C where the processor has it). */
int tg_cache_write_f16(uint16_t *cache, const float *x, int64_t B, int64_t Hkv, int64_t S, int64_t T, int64_t D,
                       const int64_t *pos, int64_t pstride);
/* o[b, h, t, :] = softmax(scale q[b, h, t] . k[b, h / (H / Hkv), j]) over j <= pos_b + t, times v:
 * causal attention of T new queries over the first pos_b + T cache rows, grouped-query without
 * repeating K/V (each cache row is read once for the H / Hkv heads that share it). window > 0:
 * only j > pos_b + t - window (a sliding window; the keys before it are not read). */
int tg_cache_attention(const float *q, const float *k, const float *v, float *o, int64_t B, int64_t H,
                       int64_t Hkv, int64_t T, int64_t S, int64_t D, const int64_t *pos, int64_t pstride,
                       float scale, int64_t window);
/* The same over an f16 cache (k, v as f16 bits), widened as it is read. */
int tg_cache_attention_f16(const float *q, const uint16_t *k, const uint16_t *v, float *o, int64_t B, int64_t H,
                           int64_t Hkv, int64_t T, int64_t S, int64_t D, const int64_t *pos, int64_t pstride,
                           float scale, int64_t window);
/* out[b] = a token drawn from logits[b, :V] (tg.sample: repetition penalty on seen != 0,
 * temperature 0 = the first largest, top_k 0 = all, top_p, u[b] uniform in [0, 1)). */
int tg_sample(const float *logits, const uint8_t *seen, const float *u, int64_t B, int64_t V, float temperature,
              int64_t top_k, float top_p, float penalty, int64_t *out);
/* y = x / sqrt(mean(x^2 over each row of n) + eps) * scale (scale may be NULL). */
void tg_rms_norm_rows(const float *x, float *y, const float *scale, int64_t rows, int64_t n, float eps);
/* The instruction set the block kernels use: asked 0 scalar, 1 AVX2, 2 AVX512-VNNI, 3 AVX512-VNNI
 * with VBMI, 4 that and AMX int8 (where this process may use it), -1 the best this processor has; returns the one chosen (never more than the processor has). */
int tg_blockq_isa(int want);
/* The kernel tg_block_matmul takes for M rows of format fmt at the current instruction set:
 * float weights; dequantized panels into sgemm (a prompt's rows); the ISA's block-at-a-time
 * kernels; two blocks per 512-bit step, 4 rows at once; two blocks per step, 8 rows at once; AMX
 * tiles, 16 weight rows x 2..8 rows per tile product. */
enum { TG_BQ_KERNEL_FLOAT = 0, TG_BQ_KERNEL_SGEMM, TG_BQ_KERNEL_BLOCKS, TG_BQ_KERNEL_ZMM, TG_BQ_KERNEL_Z8, TG_BQ_KERNEL_AMX };
int tg_blockq_kernel(int fmt, int64_t M);
/* The path tg_cache_attention(_f16) takes for T queries of head size D (window 0: none) over L
 * keys at the current instruction set: a prompt's GEMMs; AVX-512 units reading the cache in
 * place; portable units (an f16 cache widened a block at a time into scratch). */
enum { TG_CA_KERNEL_PROMPT = 0, TG_CA_KERNEL_ZMM, TG_CA_KERNEL_UNITS };
int tg_cache_attention_kernel(int64_t T, int64_t D, int64_t window, int64_t L);
#endif
