/* tilegraph C backend: matmuls on GGUF block-format weights, and a KV cache written in place
 * and attended over (blockq.h declares them). Compiled into the runtime library (build.py).
 *
 * Decode reads every weight once per token, so its speed is the weights' bytes over memory
 * bandwidth, if the arithmetic keeps up. It does here as in llama.cpp (ggml's vec_dot_q*_q8):
 * the activation row is quantized to int8 once per matmul (a scale per 32 values, and each
 * 32's sum), and each weight block meets it in integer dot products (AVX512-VNNI vpdpbusd,
 * or AVX2 maddubs), one float multiply-add per 32 products. Dequantizing the weight to
 * float in registers instead costs a conversion and a float FMA per 8 values, 4x the
 * instructions per weight byte: benchmarks/blockq_kernels.py measures the two.
 *
 * The instruction set is chosen at run time (tg_blockq_isa: __builtin_cpu_supports), each
 * variant compiled under its own #pragma GCC target from blockq_simd.h; the scalar variant
 * here is the fallback and the tests' second opinion. */
#ifndef TG_MAX_POST /* runtime.h has no include guard; runtime.c includes this file after it */
#include "runtime.h"
#endif
#include "blockq.h"
#include <immintrin.h>

#define BQ_MAXR 4   /* activation rows sharing one unpacked weight block (a prompt's rows) */
/* How far ahead of the weight row it reads the decode loop asks for the rows to come: one row
 * of activations does a few instructions per 64 weight bytes, too few to hide a load that misses,
 * and the hardware's stream prefetch alone left the VBMI kernel waiting on its weight loads (one
 * row of q8_0 4096 x 576: ~1.2-1.5x faster with this, in one process A/B). */
#define BQ_PF_BYTES 4096
#define BQ_TILE 16  /* weight rows a thread takes at a time: 16 rows of K = 1536 in q4 are 15 KB, in L1 */
/* Below this many weight bytes times rows a matmul runs on one thread: waking a sleeping
 * OpenMP team costs some microseconds, what one core takes for ~64 KB from cache. */
#define BQ_PARALLEL_BYTES 65536
/* A prompt's rows (more than this) take dequantized weight panels into sgemm: faster than the
 * integer kernels there (benchmarks/generate_llama_cpp.py's pp rows), as a GEMM reuses each
 * dequantized weight across all rows; with activation='q8' the rows are rounded first. */
#define BQ_SGEMM_ROWS 8
/* AMX's tile products cost the same for 1 or 8 activation rows; the 8-row VBMI kernel's grow
 * with the rows: from 3 rows up AMX is no slower, at 2 it takes 1.3-1.9x as long. */
#define BQ_AMX_MIN_ROWS 3

/* A row of q8 activations: q[K], a scale per 32 (d), the sums of q per 32 (s) and per 16 (s16). */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *s;
    int16_t *s16;
    float *ds;  /* per 32: d, then d * s (one 8-byte load gives a block's two terms) */
} tg_q8row;

typedef void (*bq_dot_fn)(const uint8_t *w, const tg_q8row *a, int R, int64_t nb, float *y);
typedef struct {
    void (*quantize)(const float *x, int64_t k, tg_q8row *a);
    bq_dot_fn dot[TG_BQ_COUNT];
} tg_bq_kernels;

/* Elements per block and bytes per block of each format (GGUF's; ir/block_formats.py). */
static const int64_t BQ_BLOCK[TG_BQ_COUNT] = {1, 1, 1, 32, 32, 32, 256, 256, 32};
static const int64_t BQ_BYTES[TG_BQ_COUNT] = {4, 2, 2, 18, 20, 34, 144, 210, 22};

static inline float bq_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);               /* inf, NaN */
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);          /* normal */
    else if (!man) bits = sign;                                              /* zero */
    else { float f = (float)man * (1.f / 16777216.f); memcpy(&bits, &f, 4); bits |= sign; }  /* subnormal */
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline float bq_half_at(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return bq_half(h); }

/* q4_k's 12 bytes: eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4). */
static inline void tg_q4k_scales(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
        sc[j + 4] = (q[j + 8] & 0x0F) | ((q[j] >> 6) << 4);
        mn[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
}

/* One block of a format to floats (BQ_BLOCK[fmt] of them). */
static void bq_dequant_block(int fmt, const uint8_t *w, float *out) {
    switch (fmt) {
    case TG_BQ_F32: memcpy(out, w, 4); break;
    case TG_BQ_F16: out[0] = bq_half_at(w); break;
    case TG_BQ_BF16: { uint32_t b = (uint32_t)(w[0] | (w[1] << 8)) << 16; memcpy(out, &b, 4); break; }
    case TG_BQ_Q4_0: {
        float d = bq_half_at(w);
        for (int j = 0; j < 16; j++) {
            out[j] = ((w[2 + j] & 0x0F) - 8) * d;
            out[j + 16] = ((w[2 + j] >> 4) - 8) * d;
        }
        break;
    }
    case TG_BQ_Q5_0: {  /* f16 d, 32 fifth bits (element i: bit i), then q4_0's nibbles; w = d (q - 16) */
        float d = bq_half_at(w);
        uint32_t qh;
        memcpy(&qh, w + 2, 4);
        for (int j = 0; j < 16; j++) {
            out[j] = (int)((w[6 + j] & 0x0F) | ((qh >> j & 1) << 4)) - 16;
            out[j + 16] = (int)((w[6 + j] >> 4) | ((qh >> (j + 16) & 1) << 4)) - 16;
            out[j] *= d;
            out[j + 16] *= d;
        }
        break;
    }
    case TG_BQ_Q4_1: {
        float d = bq_half_at(w), m = bq_half_at(w + 2);
        for (int j = 0; j < 16; j++) {
            out[j] = (w[4 + j] & 0x0F) * d + m;
            out[j + 16] = (w[4 + j] >> 4) * d + m;
        }
        break;
    }
    case TG_BQ_Q8_0: {
        float d = bq_half_at(w);
        for (int j = 0; j < 32; j++) out[j] = (int8_t)w[2 + j] * d;
        break;
    }
    case TG_BQ_Q4_K: {
        float d = bq_half_at(w), dmin = bq_half_at(w + 2);
        uint8_t sc[8], mn[8];
        tg_q4k_scales(w + 4, sc, mn);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                uint8_t q = w[16 + 32 * c + l];
                out[64 * c + l] = d * sc[2 * c] * (q & 0x0F) - dmin * mn[2 * c];
                out[64 * c + 32 + l] = d * sc[2 * c + 1] * (q >> 4) - dmin * mn[2 * c + 1];
            }
        break;
    }
    case TG_BQ_Q6_K: {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        float d = bq_half_at(w + 208);
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, out += 128)
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
                int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                out[l] = d * sc[is] * q1;
                out[l + 32] = d * sc[is + 2] * q2;
                out[l + 64] = d * sc[is + 4] * q3;
                out[l + 96] = d * sc[is + 6] * q4;
            }
        break;
    }
    }
}

/* --- the scalar variant: the same q8 activations, each weight block dequantized --- */

static void bq_quantize_scalar(const float *x, int64_t k, tg_q8row *a) {
    int8_t *q = a->q;
    for (int64_t b = 0; b < k / 32; b++) {
        float amax = 0.f;
        for (int i = 0; i < 32; i++) { float v = fabsf(x[32 * b + i]); amax = v > amax ? v : amax; }
        float id = amax > 0.f ? 127.f / amax : 0.f;
        int32_t h[2] = {0, 0};
        for (int i = 0; i < 32; i++) {
            long v = lrintf(x[32 * b + i] * id);  /* nearest, ties to even: as cvtps2dq */
            q[32 * b + i] = (int8_t)(v > 127 ? 127 : v < -128 ? -128 : v);
            h[i / 16] += q[32 * b + i];
        }
        a->d[b] = amax / 127.f;
        a->s16[2 * b] = (int16_t)h[0];
        a->s16[2 * b + 1] = (int16_t)h[1];
        a->s[b] = h[0] + h[1];
        a->ds[2 * b] = a->d[b];
        a->ds[2 * b + 1] = a->d[b] * (float)a->s[b];
    }
}

static void bq_dot_scalar(int fmt, const uint8_t *w, const tg_q8row *a, int R, int64_t nb, float *y) {
    float buf[256];
    int64_t blk = BQ_BLOCK[fmt], bytes = BQ_BYTES[fmt];
    for (int r = 0; r < R; r++) y[r] = 0.f;
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        bq_dequant_block(fmt, w, buf);
        for (int r = 0; r < R; r++) {
            float acc = 0.f;
            for (int64_t i = 0; i < blk; i++) {
                int64_t e = b * blk + i;
                acc += buf[i] * (a[r].q[e] * a[r].d[e / 32]);
            }
            y[r] += acc;
        }
    }
}
#define BQ_SCALAR(name, fmt) \
    static void name(const uint8_t *w, const tg_q8row *a, int R, int64_t nb, float *y) { bq_dot_scalar(fmt, w, a, R, nb, y); }
BQ_SCALAR(bq_dot_q4_0_scalar, TG_BQ_Q4_0)
BQ_SCALAR(bq_dot_q4_1_scalar, TG_BQ_Q4_1)
BQ_SCALAR(bq_dot_q8_0_scalar, TG_BQ_Q8_0)
BQ_SCALAR(bq_dot_q4_k_scalar, TG_BQ_Q4_K)
BQ_SCALAR(bq_dot_q6_k_scalar, TG_BQ_Q6_K)
BQ_SCALAR(bq_dot_q5_0_scalar, TG_BQ_Q5_0)
static const tg_bq_kernels bq_kernels_scalar = {
    .quantize = bq_quantize_scalar,
    .dot = {[TG_BQ_Q4_0] = bq_dot_q4_0_scalar, [TG_BQ_Q4_1] = bq_dot_q4_1_scalar, [TG_BQ_Q8_0] = bq_dot_q8_0_scalar,
            [TG_BQ_Q4_K] = bq_dot_q4_k_scalar, [TG_BQ_Q6_K] = bq_dot_q6_k_scalar, [TG_BQ_Q5_0] = bq_dot_q5_0_scalar},
};

/* --- the SIMD variants --- */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define BQ_SUFFIX _avx2
#define BQ_DP(acc, u, s) (acc) = _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#include "blockq_simd.h"
#undef BQ_SUFFIX
#undef BQ_DP
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#define BQ_SUFFIX _vnni
#define BQ_DP(acc, u, s) (acc) = _mm256_dpbusd_epi32((acc), (u), (s))
#include "blockq_simd.h"
#undef BQ_SUFFIX
#undef BQ_DP
#pragma GCC pop_options

/* Decode's hot formats on 512-bit registers, two 32-blocks per step (AVX512-VNNI): one
 * vpdpbusd, one conversion and one FMA per 64 weights; both blocks' f16 scales converted
 * together and multiplied by the activation's (d, d * sum) pairs in one go. A decode step's
 * rows take these (a batch's, four at a time). */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")
static inline __m512i bq_zmm_nibbles2(const uint8_t *p0, const uint8_t *p1) {
    __m256i raw = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)p1), _mm_loadu_si128((const __m128i *)p0));
    __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                              _mm256_permute2x128_si256(lo, hi, 0x31), 1);
}
static inline uint32_t bq_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t bq_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* fmt's blocks: the two f16 pairs (scale, min-or-scale) of blocks b, b+1 -> [x0, y0, x1, y1].
 * R activation rows (a batch's decode rows, up to BQ_MAXR) share each unpacked weight block and
 * its converted scales: the weight is read and unpacked once for them all. */
#define BQ_ZMM_KERNEL(name, BYTES, UNPACK, PAIR, OFFSET)                                                          \
    static inline __attribute__((always_inline)) void name##_rows(const uint8_t *w, const tg_q8row *a, const int R, \
                                                                  int64_t nb, float *y) {                         \
        const uint8_t *wb = w;                                                                                    \
        __m512 acc[BQ_MAXR];                                                                                      \
        __m128 off[BQ_MAXR];                                                                                      \
        for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); off[r] = _mm_setzero_ps(); }                  \
        const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);                   \
        int64_t b = 0;                                                                                            \
        for (; b + 1 < nb; b += 2, wb += 2 * (BYTES)) {                                                           \
            __m512i u = UNPACK;                                                                                   \
            __m128 pair = _mm_cvtph_ps(PAIR);                                                                     \
            for (int r = 0; r < R; r++) {                                                                         \
                __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(a[r].q + 32 * b)); \
                __m128 f = _mm_mul_ps(pair, _mm_loadu_ps(a[r].ds + 2 * b));                                       \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp),                                                  \
                                         _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(f)), acc[r]);       \
                off[r] = _mm_add_ps(off[r], f);                                                                   \
            }                                                                                                     \
        }                                                                                                         \
        for (int r = 0; r < R; r++) {                                                                             \
            float o[4];                                                                                           \
            _mm_storeu_ps(o, off[r]);                                                                             \
            float rest = 0.f;                                                                                     \
            if (b < nb) bq_body_tail(w, (a + r), b, nb, &rest);                                                   \
            y[r] = _mm512_reduce_add_ps(acc[r]) + (OFFSET) + rest;                                                \
        }                                                                                                         \
    }                                                                                                             \
    static void name(const uint8_t *w, const tg_q8row *a, int R, int64_t nb, float *y) {                        \
        if (R == BQ_MAXR) name##_rows(w, a, BQ_MAXR, nb, y);                                                      \
        else for (int r = 0; r < R; r++) name##_rows(w, a + r, 1, nb, y + r);                                    \
    }

/* q4_1: [d, m] per block; off lanes 1, 3 are m * da * sum */
#define bq_body_tail(w, a, b, nb, rest) bq_dot_q4_1_vnni((w) + (b) * 20, &(tg_q8row){(a)->q + 32 * (b), (a)->d + (b), \
                                                                  (a)->s + (b), (a)->s16 + 2 * (b), (a)->ds + 2 * (b)}, 1, (nb) - (b), (rest))
BQ_ZMM_KERNEL(bq_zmm_q4_1, 20, bq_zmm_nibbles2(wb + 4, wb + 24),
              _mm_set_epi32(0, 0, (int)bq_u32(wb + 20), (int)bq_u32(wb)), o[1] + o[3])
#undef bq_body_tail
/* q4_0: [d, d] per block (w = d (q - 8)); off lanes 1, 3 are d * da * sum */
#define bq_body_tail(w, a, b, nb, rest) bq_dot_q4_0_vnni((w) + (b) * 18, &(tg_q8row){(a)->q + 32 * (b), (a)->d + (b), \
                                                                  (a)->s + (b), (a)->s16 + 2 * (b), (a)->ds + 2 * (b)}, 1, (nb) - (b), (rest))
BQ_ZMM_KERNEL(bq_zmm_q4_0, 18, bq_zmm_nibbles2(wb + 2, wb + 20),
              _mm_set_epi16(0, 0, 0, 0, (short)bq_u16(wb + 18), (short)bq_u16(wb + 18), (short)bq_u16(wb),
                            (short)bq_u16(wb)), -8.f * (o[1] + o[3]))
#undef bq_body_tail
/* q8_0: signed weights through |w| and sign(a, w) (the sign applied to each row's activations) */
static inline __attribute__((always_inline)) void bq_zmm_q8_0_rows(const uint8_t *w, const tg_q8row *a, const int R,
                                                                   int64_t nb, float *y) {
    const uint8_t *wb = w;
    __m512 acc[BQ_MAXR];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    int64_t b = 0;
    for (; b + 1 < nb; b += 2, wb += 68) {
        __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(wb + 2))),
                                       _mm256_loadu_si256((const __m256i *)(wb + 36)), 1);
        /* sign(a, w): negate a where w < 0, zero where w == 0 */
        __mmask64 neg = _mm512_movepi8_mask(q), keep = ~_mm512_testn_epi8_mask(q, q);
        __m512i aq = _mm512_abs_epi8(q);
        __m128 pair = _mm_cvtph_ps(_mm_set_epi16(0, 0, 0, 0, 0, (short)bq_u16(wb + 34), 0, (short)bq_u16(wb)));
        for (int r = 0; r < R; r++) {
            __m512i s = _mm512_loadu_si512(a[r].q + 32 * b);
            s = _mm512_maskz_mov_epi8(keep, _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s));
            __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aq, s);
            __m128 f = _mm_mul_ps(pair, _mm_loadu_ps(a[r].ds + 2 * b));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(f)),
                                     acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float rest = 0.f;
        const tg_q8row *ar = a + r;
        if (b < nb)
            bq_dot_q8_0_vnni(w + b * 34, &(tg_q8row){ar->q + 32 * b, ar->d + b, ar->s + b, ar->s16 + 2 * b,
                                                      ar->ds + 2 * b}, 1, nb - b, &rest);
        y[r] = _mm512_reduce_add_ps(acc[r]) + rest;
    }
}
static void bq_zmm_q8_0(const uint8_t *w, const tg_q8row *a, int R, int64_t nb, float *y) {
    if (R == BQ_MAXR) bq_zmm_q8_0_rows(w, a, BQ_MAXR, nb, y);
    else for (int r = 0; r < R; r++) bq_zmm_q8_0_rows(w, a + r, 1, nb, y + r);
}
#pragma GCC pop_options
static const bq_dot_fn bq_zmm[TG_BQ_COUNT] = {[TG_BQ_Q4_0] = bq_zmm_q4_0, [TG_BQ_Q4_1] = bq_zmm_q4_1,
                                              [TG_BQ_Q8_0] = bq_zmm_q8_0};

/* Decode's hot formats, a weight pair of 32-blocks per 512-bit step for up to 8 activation rows
 * at once (AVX512-VBMI on top of VNNI): a batch's 8 decode rows share each weight's unpacking,
 * and each row costs one vpdpbusd, one conversion, one multiply and one FMA per 64 weights.
 * What makes that the whole per-row cost:
 * - the weights enter vpdpbusd as its signed operand (q4_0 as q - 8, q4_1's q, q8_0 as is) and the
 *   activations as unsigned a + 128 (stored so once per matmul): the extra 128 * sum(w) does not
 *   depend on the row, so one vpdpbusd per weight pair computes it for every row and each row's
 *   dot product starts from its negation (exact: integers);
 * - the nibbles are unpacked by one vpermb (each block's 16 bytes twice over) and one
 *   vpmultishiftqb (the high halves shifted down 4), the two f16 scales spread over their 8
 *   lanes each by one vpermw and converted once;
 * - the activation scales come already spread over 16 lanes (written once per matmul), so a
 *   row multiplies without a shuffle, and a row's sum is reduced once at the end.
 * ggml reaches the same per-row cost by repacking q4_0 into row-interleaved blocks at load;
 * the file's own layout is kept here. */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx512vbmi")
#define BQ_Z8_ROWS 8
/* A q8 activation row as these kernels read it: au = q + 128 as bytes; sa: per weight pair
 * (64 values), 16 floats, d of the pair's first block in lanes 0-7 and of its second in 8-15;
 * sm (q4_1's min term): d * sum(q) of each block in lanes 0 and 8, zeros elsewhere. */
/* vpermb's indices for a pair of q4_0 / q4_1 blocks: byte i of the result is the pair's byte
 * nib + (i / 32) * block + i % 16 (each block's 16 nibble bytes twice); set by tg_blockq_isa. */
static uint8_t bq_z8_pick[TG_BQ_COUNT][64];
static void bq_z8_init(void) {
    for (int i = 0; i < 64; i++) {
        bq_z8_pick[TG_BQ_Q4_0][i] = (uint8_t)(2 + (i / 32) * 18 + i % 16);
        bq_z8_pick[TG_BQ_Q4_1][i] = (uint8_t)(4 + (i / 32) * 20 + i % 16);
    }
}
typedef struct {
    uint8_t *au;
    float *sa, *sm;
    const int8_t *q;  /* the row's own signed values (tg_q8row's q) */
} bq_z8row;

static void bq_z8_prepare(const tg_q8row *a, int64_t K, bq_z8row *z) {
    int64_t np = K / 64;
    const __m512i x80 = _mm512_set1_epi8((char)0x80);
    for (int64_t k = 0; k + 64 <= K; k += 64)
        _mm512_storeu_si512(z->au + k, _mm512_xor_si512(_mm512_loadu_si512(a->q + k), x80));
    for (int64_t p = 0; p < np; p++) {
        __m512 d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a->d[2 * p]), _mm512_set1_ps(a->d[2 * p + 1]));
        _mm512_storeu_ps(z->sa + 16 * p, d);
        __m512 m = _mm512_setzero_ps();
        m = _mm512_mask_mov_ps(m, 0x0001, _mm512_set1_ps(a->ds[4 * p + 1]));
        m = _mm512_mask_mov_ps(m, 0x0100, _mm512_set1_ps(a->ds[4 * p + 3]));
        _mm512_storeu_ps(z->sm + 16 * p, m);
    }
}

/* y[r] = the row w (np pairs of fmt's blocks) times activation row r, for R (a constant where
 * inlined) rows.
 * q4_1's q (0..15) enters vpdpbusd as its unsigned operand and the row's own signed q8 values as
 * the signed one: the same integers as the offset form, without its shared vpdpbusd and
 * subtraction per weight pair. (q4_0 that way would turn its exact integer - 8 into a float term
 * per block that cancels against the rest: logits moved by ~1e-3 on the tiny test model.) */
static inline __attribute__((always_inline)) void bq_z8_body(const int fmt, const uint8_t *w, const bq_z8row *a,
                                                             const int R, int64_t np, float *y) {
    __m512 acc[BQ_Z8_ROWS], off[BQ_Z8_ROWS];
    for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); off[r] = _mm512_setzero_ps(); }
    const int bytes = fmt == TG_BQ_Q4_0 ? 36 : fmt == TG_BQ_Q4_1 ? 40 : 68;
    const __mmask64 first = fmt == TG_BQ_Q4_0 ? (1ULL << 36) - 1 : (1ULL << 40) - 1;
    const __m512i idx = _mm512_loadu_si512(bq_z8_pick[fmt]);
    /* vpmultishiftqb: bytes 16-31 of each 32 take bits 4-11 of their byte (the high nibble) */
    const __m512i lo = _mm512_set1_epi64(0x3830282018100800LL), hi = _mm512_set1_epi64(0x3C342C241C140C04LL);
    const __m512i shift = _mm512_mask_blend_epi64(0xCC, lo, hi);
    /* vpermw: the pair's scales (and q4_1's mins) spread over 8 lanes each */
    const __m512i words = fmt == TG_BQ_Q4_0   ? _mm512_set_epi64(0, 0, 0, 0, 0x0009000900090009LL, 0x0009000900090009LL, 0, 0)
                          : fmt == TG_BQ_Q4_1 ? _mm512_set_epi64(0x000B000B000B000BLL, 0x000B000B000B000BLL,
                                                                 0x0001000100010001LL, 0x0001000100010001LL,
                                                                 0x000A000A000A000ALL, 0x000A000A000A000ALL, 0, 0)
                                              : _mm512_set_epi64(0, 0, 0, 0, 0x0011001100110011LL, 0x0011001100110011LL, 0, 0);
    const __m512i m4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8), x80 = _mm512_set1_epi8((char)0x80);
    /* the nibbles as unsigned, the activations signed (see above) */
    const int direct = fmt == TG_BQ_Q4_1;
    for (int64_t p = 0; p < np; p++, w += bytes) {
        __m512i q, h;
        if (fmt == TG_BQ_Q8_0) {
            q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + 2))),
                                   _mm256_loadu_si256((const __m256i *)(w + 36)), 1);
            h = _mm512_permutexvar_epi16(words, _mm512_loadu_si512(w));  /* 64 of the pair's 68 bytes */
        } else {
            __m512i raw = _mm512_maskz_loadu_epi8(first, w);  /* the pair's bytes only: never past the row */
            q = _mm512_and_si512(_mm512_multishift_epi64_epi8(shift, _mm512_permutexvar_epi8(idx, raw)), m4);
            if (fmt == TG_BQ_Q4_0) q = _mm512_sub_epi8(q, eight);
            h = _mm512_permutexvar_epi16(words, raw);
        }
        __m512 sw = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), sm = _mm512_setzero_ps();
        if (fmt == TG_BQ_Q4_1) sm = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
        if (direct) {
            for (int r = 0; r < R; r++) {
                __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(a[r].q + 64 * p));
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dp), _mm512_loadu_ps(a[r].sa + 16 * p));
                acc[r] = _mm512_fmadd_ps(t, sw, acc[r]);
                off[r] = _mm512_fmadd_ps(sm, _mm512_loadu_ps(a[r].sm + 16 * p), off[r]);  /* m_w d_a sum(q_a) */
            }
            continue;
        }
        __m512i neg = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), x80, q));
        for (int r = 0; r < R; r++) {
            __m512i dp = _mm512_dpbusd_epi32(neg, _mm512_loadu_si512(a[r].au + 64 * p), q);
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dp), _mm512_loadu_ps(a[r].sa + 16 * p));
            acc[r] = _mm512_fmadd_ps(t, sw, acc[r]);
            if (fmt == TG_BQ_Q4_1) off[r] = _mm512_fmadd_ps(sm, _mm512_loadu_ps(a[r].sm + 16 * p), off[r]);
        }
    }
    for (int r = 0; r < R; r++)
        y[r] = _mm512_reduce_add_ps(fmt == TG_BQ_Q4_1 ? _mm512_add_ps(acc[r], off[r]) : acc[r]);
}

typedef void (*bq_z8_fn)(const uint8_t *w, const bq_z8row *a, int R, int64_t np, float *y);
/* R rows as runs of 8, 4, 2 and 1, each with its accumulators in registers */
#define BQ_Z8_KERNEL(name, FMT)                                                                   \
    static void name(const uint8_t *w, const bq_z8row *a, int R, int64_t np, float *y) {          \
        while (R > 0) {                                                                           \
            int n = R >= 8 ? 8 : R >= 4 ? 4 : R >= 2 ? 2 : 1;                                     \
            if (n == 8) bq_z8_body(FMT, w, a, 8, np, y);                                          \
            else if (n == 4) bq_z8_body(FMT, w, a, 4, np, y);                                     \
            else if (n == 2) bq_z8_body(FMT, w, a, 2, np, y);                                     \
            else bq_z8_body(FMT, w, a, 1, np, y);                                                 \
            a += n, y += n, R -= n;                                                               \
        }                                                                                         \
    }
BQ_Z8_KERNEL(bq_z8_q4_0, TG_BQ_Q4_0)
BQ_Z8_KERNEL(bq_z8_q4_1, TG_BQ_Q4_1)
BQ_Z8_KERNEL(bq_z8_q8_0, TG_BQ_Q8_0)
#undef BQ_Z8_KERNEL
#pragma GCC pop_options
static const bq_z8_fn bq_z8[TG_BQ_COUNT] = {[TG_BQ_Q4_0] = bq_z8_q4_0, [TG_BQ_Q4_1] = bq_z8_q4_1,
                                            [TG_BQ_Q8_0] = bq_z8_q8_0};

/* A batch's decode rows (2..8) on AMX int8 tiles, where the processor has them and the kernel lets
 * this process use them (tg_blockq_isa asks once; level 4). 16 weight rows x one 32-block x 8
 * activation rows is one tdpbssd: the weights are the A tile as they lie in the file (q8_0's 32
 * bytes at the row stride, no copy; q4's 16 nibble bytes split into their low and high halves,
 * two K = 16 tiles), the activations the B tile, laid out once per matmul in AMX's 4-byte column
 * groups (bq_amx_prepare). A block's 16 x 8 int32 products then take their two scales in float:
 * 8 conversions and FMAs per 16 weight rows and 8 activation rows, against the 8-row VBMI
 * kernel's 8 vpdpbusd + conversions + FMAs per weight row and 64 weights (about 3x the
 * instructions per weight). Signed x signed (tdpbssd): q4_0 as q - 8, q4_1's q, q8_0 as is, the
 * activations' int8 as they are; no offsets. ggml reaches AMX through a repacked weight copy
 * (its "extra buffer type"); this keeps the file's bytes and reads each weight once. */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx512vbmi,amx-tile,amx-int8")
#define BQ_AMX_N 16 /* weight rows per tile (a tile's 16 rows): the tile loop's BQ_TILE */
_Static_assert(BQ_AMX_N == BQ_TILE, "an AMX group is one tile of the matmul's row loop");
typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} bq_tilecfg;
/* Per 32-block b of the activations: bt (256 bytes, B's 8 rows of 8 rows x 4 bytes), da (16 floats:
 * row m's d in lanes m and 8 + m), dsa (the same of d * sum(q): q4_1's min term); rows past R zero. */
typedef struct {
    uint8_t *bt;
    float *da, *dsa;
} bq_amxa;

static void bq_amx_prepare(const tg_q8row *rows, int R, int64_t nb, bq_amxa *a) {
    memset(a->bt, 0, (size_t)nb * 256);
    memset(a->da, 0, sizeof(float) * (size_t)nb * 16);
    memset(a->dsa, 0, sizeof(float) * (size_t)nb * 16);
    for (int m = 0; m < R; m++)
        for (int64_t b = 0; b < nb; b++) {
            for (int r = 0; r < 8; r++) memcpy(a->bt + b * 256 + r * 32 + m * 4, rows[m].q + 32 * b + 4 * r, 4);
            a->da[b * 16 + m] = a->da[b * 16 + 8 + m] = rows[m].d[b];
            a->dsa[b * 16 + m] = a->dsa[b * 16 + 8 + m] = rows[m].ds[2 * b + 1];
        }
}

/* The tiles' shapes for fmt, loaded once per thread per matmul (a load costs as much as
 * several blocks' products); tile_release when the thread's groups are done. */
static void bq_amx_config(void) {
    bq_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t += t ? 1 : 5) cfg.rows[t] = 16, cfg.colsb[t] = 32; /* C (0, 5-7): 16 weight rows x 8 int32 */
    cfg.rows[1] = 16, cfg.colsb[1] = 32;  /* A: 16 weight rows x a block's 32 values */
    cfg.rows[3] = 8, cfg.colsb[3] = 32;   /* B: the block's 32 values as 8 groups of 4 x 8 activation rows */
    _tile_loadconfig(&cfg);
}

/* y[m, n0 + i] for i < 16, m < R: 16 weight rows from w (their first), nb blocks; c: a thread's
 * scratch of nb * 128 int32. All the tile products first, then their scaling in float: the tile
 * unit and the vector unit then run apart (the scaling read each product back right after its
 * tile store, a wait per block, at 1.4x the 8-row VBMI kernel's speed instead of the ~2x here). */
static void bq_amx_group(int fmt, const uint8_t *w, int64_t row_bytes, int64_t nb, const bq_amxa *a, int R,
                         float *y, int64_t ldy, int32_t *c) {
    const int q8 = fmt == TG_BQ_Q8_0, bytes = (int)BQ_BYTES[fmt], nib = fmt == TG_BQ_Q4_1 ? 4 : 2;
    const __m512i m4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    /* q4: every block's nibbles unpacked before the first tile load (a tile load of bytes stored
     * just before waits for them to reach the cache: the store buffer does not forward to it),
     * each weight row's low nibbles then its high ones, its 32 values in order: one K = 32 tile
     * product per block, as q8_0's, where two K = 16 halves cost twice the tile loads */
    const __m512i row_lo = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), row_hi = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    uint8_t *nibs = (uint8_t *)(c + nb * 128);
    /* the rows two groups ahead, requested into L2 now: a group's 16 rows are 16 streams the
     * hardware prefetcher does not follow, and its products are short next to a wait on memory
     * (a prefetch past the matrix's end is dropped, never a fault) */
    for (int64_t i = 0; i < BQ_AMX_N * row_bytes; i += 64)
        _mm_prefetch((const char *)(w + 2 * BQ_AMX_N * row_bytes + i), _MM_HINT_T1);
    for (int64_t b = 0; b < nb && !q8; b++) {
        const uint8_t *blk = w + b * bytes;
        for (int i = 0; i < BQ_AMX_N; i += 4) {  /* 4 rows' 16 nibble bytes in one register */
            const uint8_t *p = blk + nib + i * row_bytes;
            __m512i x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
            x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(p + row_bytes)), 1);
            x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(p + 2 * row_bytes)), 2);
            x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(p + 3 * row_bytes)), 3);
            __m512i l = _mm512_and_si512(x, m4), h = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
            if (fmt == TG_BQ_Q4_0) l = _mm512_sub_epi8(l, eight), h = _mm512_sub_epi8(h, eight);
            _mm512_store_si512(nibs + b * 512 + i * 32, _mm512_permutex2var_epi64(l, row_lo, h));
            _mm512_store_si512(nibs + b * 512 + i * 32 + 64, _mm512_permutex2var_epi64(l, row_hi, h));
        }
    }
    for (int64_t b = 0; b < nb; b++) {
        if (q8) _tile_loadd(1, w + b * bytes + 2, row_bytes);
        else _tile_loadd(1, nibs + b * 512, 32);
        _tile_loadd(3, a->bt + b * 256, 32);
        /* four product tiles in turn: a block's product does not wait for the previous one's store */
#define BQ_AMX_DOT(T) { _tile_zero(T); _tile_dpbssd(T, 1, 3); _tile_stored(T, c + b * 128, 32); }
        switch (b & 3) { case 0: BQ_AMX_DOT(0) break; case 1: BQ_AMX_DOT(5) break; case 2: BQ_AMX_DOT(6) break;
                         default: BQ_AMX_DOT(7) }
#undef BQ_AMX_DOT
    }
    __m512 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
    /* row i's scale (and q4_1's min) at byte i * row_bytes of a block: one gather of 16 dwords */
    const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32((int)row_bytes));
    for (int64_t b = 0; b < nb; b++) {
        __m512i sd = _mm512_i32gather_epi32(at, (const void *)(w + b * bytes), 1);
        __m512 sw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(sd)), sm = _mm512_setzero_ps();
        if (fmt == TG_BQ_Q4_1) sm = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(sd, 16)));
        /* c's register j holds weight rows 2j (lanes 0-7) and 2j + 1 (8-15) against the 8 activation rows */
        const __m512 da = _mm512_loadu_ps(a->da + 16 * b), dsa = _mm512_loadu_ps(a->dsa + 16 * b);
        const int32_t *cb = c + b * 128;
        for (int j = 0; j < 8; j++) {
            const __m512i pick = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(2 * j), _mm512_set1_epi32(2 * j + 1));
            __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(pick, sw), da);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * j)), s, acc[j]);
            if (fmt == TG_BQ_Q4_1) acc[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pick, sm), dsa, acc[j]);
        }
    }
    __attribute__((aligned(64))) float out[8 * 16];
    for (int j = 0; j < 8; j++) _mm512_store_ps(out + 16 * j, acc[j]);
    for (int m = 0; m < R; m++)
        for (int j = 0; j < 8; j++) y[m * ldy + 2 * j] = out[16 * j + m], y[m * ldy + 2 * j + 1] = out[16 * j + 8 + m];
}
static void bq_amx_release(void) { _tile_release(); }
#pragma GCC pop_options

/* AMX int8 usable here: tiles granted (attention.c's tg_amx_granted) and AMX-INT8 (CPUID 7.0 EDX bit 25). */
static int bq_amx_usable(void) {
    unsigned a, b, c, d;
    return tg_amx_granted() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25));
}

static const tg_bq_kernels *bq_active;
static int bq_level = -1;

int tg_blockq_isa(int want) {
    __builtin_cpu_init();
    int have = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        have = 1;  /* f16c comes with every AVX2 processor; __builtin_cpu_supports cannot name it in GCC 12 */
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
            have = 2 + !!__builtin_cpu_supports("avx512vbmi");
        if (have == 3 && bq_amx_usable()) have = 4;
    }
    int level = want < 0 || want > have ? have : want;
    bq_active = level >= 2 ? &bq_kernels_vnni : level == 1 ? &bq_kernels_avx2 : &bq_kernels_scalar;
    if (level >= 3) bq_z8_init();
    bq_level = level;
    return level;
}

static const tg_bq_kernels *bq_kernels(void) {
    if (!bq_active) tg_blockq_isa(-1);
    return bq_active;
}

/* A thread's scratch, grown (never shrunk) to the largest request: after a model's first
 * step at its largest size, a step allocates nothing. Slot 1 is for a kernel's per-thread
 * buffer inside a parallel loop whose calling thread holds slot 0's (its inputs). */
static __thread void *bq_scratch[2];
static __thread size_t bq_scratch_size[2];
static void *bq_scratch_slot(int slot, size_t bytes) {
    if (bytes > bq_scratch_size[slot]) {
        void *p = NULL;
        if (posix_memalign(&p, 64, bytes)) return NULL;
        free(bq_scratch[slot]);
        bq_scratch[slot] = p;
        bq_scratch_size[slot] = bytes;
    }
    return bq_scratch[slot];
}
static void *bq_scratch_get(size_t bytes) { return bq_scratch_slot(0, bytes); }

static int bq_check(int fmt, int64_t K, int64_t N, int64_t row_bytes) {
    if (fmt < 0 || fmt >= TG_BQ_COUNT) TG_FAIL("block matmul: unknown block format %d", fmt);
    if (K < 0 || N < 0 || K % BQ_BLOCK[fmt]) TG_FAIL("block matmul: K = %lld is not a whole number of %lld-value blocks",
                                                   (long long)K, (long long)BQ_BLOCK[fmt]);
    if (row_bytes != K / BQ_BLOCK[fmt] * BQ_BYTES[fmt])
        TG_FAIL("block matmul: rows of %lld bytes, but K = %lld needs %lld", (long long)row_bytes, (long long)K,
                (long long)(K / BQ_BLOCK[fmt] * BQ_BYTES[fmt]));
    return 0;
}

static inline float bq_f16c(uint16_t h) { return bq_half(h); }

/* Float formats: the weight row converted as it is read, multiplied in float. */
static void bq_float_rows(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t n0, int64_t n1,
                          int64_t row_bytes, int fmt, float *y, int64_t ldy) {
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float acc = 0.f;
            if (fmt == TG_BQ_F32) {
                const float *wr = (const float *)row;
#pragma omp simd reduction(+ : acc)
                for (int64_t k = 0; k < K; k++) acc += xm[k] * wr[k];
            } else if (fmt == TG_BQ_BF16) {
                const uint16_t *wr = (const uint16_t *)row;
#pragma omp simd reduction(+ : acc)
                for (int64_t k = 0; k < K; k++) {
                    union { uint32_t u; float f; } c = {.u = (uint32_t)wr[k] << 16};
                    acc += xm[k] * c.f;
                }
            } else {
                const uint16_t *wr = (const uint16_t *)row;
                for (int64_t k = 0; k < K; k++) acc += xm[k] * bq_f16c(wr[k]);
            }
            y[m * ldy + n] = acc;
        }
    }
}

static int bq_panels(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t row_bytes, int fmt,
                     float *y, int64_t ldy);

/* Which kernel tg_block_matmul runs for M activation rows of fmt (on q8 activations): one
 * place decides, and tg_blockq_kernel reports it so the tests see the fast path taken. */
static int bq_pick(int fmt, int64_t M) {
    if (BQ_BLOCK[fmt] == 1) return TG_BQ_KERNEL_FLOAT;
    bq_kernels();  /* sets bq_level on first use */
    if (M > BQ_SGEMM_ROWS) return TG_BQ_KERNEL_SGEMM;
    if (bq_level >= 4 && M >= BQ_AMX_MIN_ROWS && bq_z8[fmt]) return TG_BQ_KERNEL_AMX;
    if (bq_level >= 3 && bq_z8[fmt]) return TG_BQ_KERNEL_Z8;
    if (bq_level >= 2 && bq_zmm[fmt]) return TG_BQ_KERNEL_ZMM;
    return TG_BQ_KERNEL_BLOCKS;
}

int tg_blockq_kernel(int fmt, int64_t M) {
    if (fmt < 0 || fmt >= TG_BQ_COUNT) {
        snprintf(tg_err, sizeof tg_err, "block matmul: unknown block format %d", fmt);
        return -1;
    }
    return bq_pick(fmt, M);
}

int tg_block_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t row_bytes,
                    int fmt, float *y, int64_t ldy) {
    if (bq_check(fmt, K, N, row_bytes)) return 1;
    if (M <= 0 || N == 0) return 0;
    int64_t tiles = (N + BQ_TILE - 1) / BQ_TILE;
    int parallel = N * row_bytes * (M < 8 ? M : 8) > BQ_PARALLEL_BYTES;
    if (BQ_BLOCK[fmt] == 1) {
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t n0 = t * BQ_TILE, n1 = n0 + BQ_TILE < N ? n0 + BQ_TILE : N;
            bq_float_rows(x, M, K, w, n0, n1, row_bytes, fmt, y, ldy);
        }
        return 0;
    }
    const tg_bq_kernels *kern = bq_kernels();
    int kernel = bq_pick(fmt, M);
    /* the q8 rows: K bytes, K / 32 scales and sums, K / 16 half-sums each; for the 8-row
     * kernels also K bytes of q + 128 and two K / 4 floats of spread scales */
    int64_t nb32 = K / 32, per_row = K + nb32 * 16 + nb32 * 8 + nb32 * 4 + 64;
    /* AMX takes whole groups of 16 weight rows; a matrix's last few rows go through the 8-row kernel */
    int amx = kernel == TG_BQ_KERNEL_AMX;
    int64_t z8_row = kernel == TG_BQ_KERNEL_Z8 || amx ? K + 2 * (K / 64) * 64 + 64 : 0;
    int64_t amx_bytes = amx ? nb32 * (256 + 128) : 0;
    uint8_t *scratch = bq_scratch_get((size_t)(M * (per_row + z8_row) + M * (sizeof(tg_q8row) + sizeof(bq_z8row)) +
                                               amx_bytes));
    if (!scratch) TG_FAIL("block matmul: out of memory for %lld quantized activation rows", (long long)M);
    tg_q8row *rows = (tg_q8row *)(scratch + M * (per_row + z8_row));
    bq_z8row *zrows = (bq_z8row *)(rows + M);
    uint8_t *amx_base = (uint8_t *)(zrows + M);
    bq_amxa am = {amx_base, (float *)(amx_base + nb32 * 256), (float *)(amx_base + nb32 * 320)};
#pragma omp parallel for schedule(static) if (M >= 16 && parallel)
    for (int64_t m = 0; m < M; m++) {
        uint8_t *base = scratch + m * per_row;
        float *d = (float *)base;
        int32_t *s = (int32_t *)(d + nb32);
        int16_t *s16 = (int16_t *)(s + nb32);
        float *ds = (float *)(base + nb32 * 12);
        int8_t *q = (int8_t *)(base + nb32 * 20 + 32);
        rows[m] = (tg_q8row){q, d, s, s16, ds};
        kern->quantize(x + m * K, K, &rows[m]);
        if (z8_row) {
            uint8_t *zb = scratch + M * per_row + m * z8_row;
            zrows[m] = (bq_z8row){zb, (float *)(zb + K), (float *)(zb + K + (K / 64) * 64), rows[m].q};
            bq_z8_prepare(&rows[m], K, &zrows[m]);
        }
    }
    if (amx) bq_amx_prepare(rows, (int)M, nb32, &am);
    if (kernel == TG_BQ_KERNEL_SGEMM) {
        /* the rows as the q8 values they round to, in float, then panels into sgemm */
        float *xq = malloc(sizeof(float) * (size_t)(M * K));
        if (!xq) TG_FAIL("block matmul: out of memory for %lld activation rows", (long long)M);
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) xq[m * K + k] = (float)rows[m].q[k] * rows[m].d[k / 32];
        int rc = bq_panels(xq, M, K, w, N, row_bytes, fmt, y, ldy);
        free(xq);
        return rc;
    }
    int64_t nb = K / BQ_BLOCK[fmt];
    /* decode: the 8-row kernel takes a weight pair of blocks per step, a batch's rows (up to 8) at
     * once, an odd last block through the single-block kernel; the others up to 4 rows at once */
    int z8 = kernel == TG_BQ_KERNEL_Z8 || amx, step = z8 ? BQ_Z8_ROWS : BQ_MAXR;
    bq_dot_fn dot = kernel == TG_BQ_KERNEL_ZMM ? bq_zmm[fmt] : kern->dot[fmt];
    int64_t np = nb32 / 2, wpair = 2 * BQ_BYTES[fmt];
    int failed = 0;
#pragma omp parallel if (parallel)
    {
    int32_t *c = NULL;  /* AMX: this thread's tile products, its tiles configured */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n0 = t * BQ_TILE, n1 = n0 + BQ_TILE < N ? n0 + BQ_TILE : N;
        if (amx && n1 - n0 == BQ_AMX_N) {
            if (!c) {
                c = bq_scratch_slot(1, (sizeof(int32_t) * 128 + 512) * (size_t)nb32);
                if (!c) { failed = 1; continue; }
                bq_amx_config();
            }
            bq_amx_group(fmt, w + n0 * row_bytes, row_bytes, nb32, &am, (int)M, y + n0, ldy, c);
            continue;
        }
        for (int64_t m = 0; m < M; m += step) {
            int R = M - m < step ? (int)(M - m) : step;
            for (int64_t n = n0; n < n1; n++) {
                float out[BQ_Z8_ROWS];
                const uint8_t *wr = w + n * row_bytes;
                if (z8 && (n + 1) * row_bytes + BQ_PF_BYTES <= N * row_bytes)
                    for (int64_t i = 0; i < row_bytes; i += 64)
                        _mm_prefetch((const char *)(wr + BQ_PF_BYTES + i), _MM_HINT_T0);
                if (!z8) dot(wr, rows + m, R, nb, out);
                else {
                    bq_z8[fmt](wr, zrows + m, R, np, out);
                    for (int r = 0; r < R && (nb32 & 1); r++) {
                        const tg_q8row *a = rows + m + r;
                        int64_t b = nb32 - 1;
                        float rest;
                        dot(wr + np * wpair, &(tg_q8row){a->q + 32 * b, a->d + b, a->s + b, a->s16 + 2 * b,
                                                         a->ds + 2 * b}, 1, 1, &rest);
                        out[r] += rest;
                    }
                }
                for (int r = 0; r < R; r++) y[(m + r) * ldy + n] = out[r];
            }
        }
    }
    if (c) bq_amx_release();
    }
    if (failed) TG_FAIL("block matmul: out of memory for a thread's %lld tile products", (long long)(128 * nb32));
    return 0;
}

int tg_block_rows(const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, int fmt, const int64_t *idx,
                  int64_t n, float *out) {
    if (bq_check(fmt, K, N, row_bytes)) return 1;
    for (int64_t i = 0; i < n; i++)  /* [-N, N), as np.take */
        if (idx[i] < -N || idx[i] >= N)
            TG_FAIL("embedding lookup: index %lld is outside the table's %lld rows", (long long)idx[i], (long long)N);
    int64_t blk = BQ_BLOCK[fmt], nb = K / blk;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = w + (idx[i] < 0 ? idx[i] + N : idx[i]) * row_bytes;
        for (int64_t b = 0; b < nb; b++) bq_dequant_block(fmt, row + b * BQ_BYTES[fmt], out + i * K + b * blk);
    }
    return 0;
}

void tg_rms_norm_rows(const float *x, float *y, const float *scale, int64_t rows, int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows * n > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        double ss = 0.;  /* double: a row's sum of squares stays exact to f32 at any length */
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
        float inv = (float)(1. / sqrt(ss / (double)n + (double)eps));
        if (scale) {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) yr[i] = xr[i] * inv * scale[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) yr[i] = xr[i] * inv;
        }
    }
}

#define BQ_ROW_MAX 8192  /* a weight row dequantized whole on the stack (32 KB) */
/* a long row: a block at a time */
static float bq_dot_float_blocks(int fmt, const uint8_t *w, const float *x, int64_t K) {
    float buf[256], acc = 0.f;
    int64_t blk = BQ_BLOCK[fmt];
    for (int64_t b = 0; b < K / blk; b++) {
        bq_dequant_block(fmt, w + b * BQ_BYTES[fmt], buf);
        for (int64_t i = 0; i < blk; i++) acc += buf[i] * x[b * blk + i];
    }
    return acc;
}

/* --- the alternative, measured against: the weight dequantized to float in registers ---
 * (benchmarks/blockq_kernels.py times it beside tg_block_matmul; only the two formats of
 * the bundled model.) Per 32 weights: nibbles or bytes widened to 2 x 16 int32, converted
 * to float and multiplied into the float activations, the block's scale applied once. */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")
static float bq_f32dq_row(int fmt, const uint8_t *w, const float *x, const float *xsum, int64_t nb) {
    __m512 acc = _mm512_setzero_ps();
    float off = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        __m128i lo16, hi16;
        float d, m = 0.f;
        if (fmt == TG_BQ_Q8_0) {
            d = bq_half_at(w);
            lo16 = _mm_loadu_si128((const __m128i *)(w + 2));
            hi16 = _mm_loadu_si128((const __m128i *)(w + 18));
            w += 34;
        } else if (fmt == TG_BQ_Q4_0) {  /* d (q - 8): the min is -8 d */
            d = bq_half_at(w), m = -8.f * d;
            __m128i q = _mm_loadu_si128((const __m128i *)(w + 2)), mask = _mm_set1_epi8(0x0F);
            lo16 = _mm_and_si128(q, mask);
            hi16 = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
            w += 18;
        } else {
            d = bq_half_at(w), m = bq_half_at(w + 2);
            __m128i q = _mm_loadu_si128((const __m128i *)(w + 4)), mask = _mm_set1_epi8(0x0F);
            lo16 = _mm_and_si128(q, mask);
            hi16 = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
            w += 20;
        }
        __m512 q0 = _mm512_cvtepi32_ps(fmt == TG_BQ_Q8_0 ? _mm512_cvtepi8_epi32(lo16) : _mm512_cvtepu8_epi32(lo16));
        __m512 q1 = _mm512_cvtepi32_ps(fmt == TG_BQ_Q8_0 ? _mm512_cvtepi8_epi32(hi16) : _mm512_cvtepu8_epi32(hi16));
        __m512 p = _mm512_mul_ps(q0, _mm512_loadu_ps(x + 32 * b));
        p = _mm512_fmadd_ps(q1, _mm512_loadu_ps(x + 32 * b + 16), p);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d), p, acc);
        off += m * xsum[b];
    }
    return _mm512_reduce_add_ps(acc) + off;
}
#pragma GCC pop_options

int tg_block_matmul_f32dq(const float *x, int64_t K, const uint8_t *w, int64_t N, int64_t row_bytes, int fmt,
                          float *y) {
    if (bq_check(fmt, K, N, row_bytes)) return 1;
    if (fmt != TG_BQ_Q8_0 && fmt != TG_BQ_Q4_1 && fmt != TG_BQ_Q4_0)
        TG_FAIL("the float-dequantizing kernel takes q4_0, q4_1 and q8_0");
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw"))
        TG_FAIL("the float-dequantizing kernel needs AVX512");
    float *xsum = bq_scratch_get((size_t)(K / 32) * sizeof(float));
    if (!xsum) TG_FAIL("out of memory");
    for (int64_t b = 0; b < K / 32; b++) {
        float s = 0.f;
        for (int i = 0; i < 32; i++) s += x[32 * b + i];
        xsum[b] = s;
    }
#pragma omp parallel for schedule(static) if (N * row_bytes > BQ_PARALLEL_BYTES)
    for (int64_t n = 0; n < N; n++) y[n] = bq_f32dq_row(fmt, w + n * row_bytes, x, xsum, K / 32);
    return 0;
}

/* activation='f32': the weight dequantized, the activations multiplied as they are. Rows of
 * few activations (decode) take the register kernel above where it has the format (the row's
 * block sums of x precomputed once), else each weight row is dequantized into a thread's
 * buffer in L1 and dotted with every activation row; a prompt's rows (M > BQ_SGEMM_ROWS) get
 * BQ_TILE dequantized weight rows at a time as a panel of one sgemm (oneDNN's). */
/* y[M, N] = x @ dequant(w)^T for a prompt's rows: BQ_TILE weight rows at a time dequantized into a
 * panel, one sgemm (oneDNN's, on the thread's own core) per panel. */
static int bq_panels(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t row_bytes, int fmt,
                     float *y, int64_t ldy) {
    int64_t tiles = (N + BQ_TILE - 1) / BQ_TILE, blk = BQ_BLOCK[fmt], bytes = BQ_BYTES[fmt];
    int failed = 0;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n0 = t * BQ_TILE, n1 = n0 + BQ_TILE < N ? n0 + BQ_TILE : N;
        float *panel = malloc(sizeof(float) * (size_t)(BQ_TILE * K));  /* per panel of a prompt: not per token */
        if (!panel) { failed = 1; continue; }
        for (int64_t n = n0; n < n1; n++)
            for (int64_t b = 0; b < K / blk; b++)
                bq_dequant_block(fmt, w + n * row_bytes + b * bytes, panel + (n - n0) * K + b * blk);
        if (dnnl_sgemm('N', 'T', M, n1 - n0, K, 1.f, x, K, panel, K, 0.f, y + n0, ldy) != dnnl_success) failed = 2;
        free(panel);
    }
    if (failed == 2) TG_FAIL("block matmul: oneDNN's sgemm failed on a panel");
    if (failed) TG_FAIL("block matmul: out of memory for a dequantized panel");
    return 0;
}

int tg_block_matmul_f32(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t row_bytes,
                        int fmt, float *y, int64_t ldy) {
    if (bq_check(fmt, K, N, row_bytes)) return 1;
    if (M <= 0 || N == 0) return 0;
    if (BQ_BLOCK[fmt] == 1) return tg_block_matmul(x, M, K, w, N, row_bytes, fmt, y, ldy);
    if (M > BQ_SGEMM_ROWS) return bq_panels(x, M, K, w, N, row_bytes, fmt, y, ldy);
    int regs = (fmt == TG_BQ_Q4_0 || fmt == TG_BQ_Q4_1 || fmt == TG_BQ_Q8_0) &&
               __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    int64_t nb32 = K / 32, blk = BQ_BLOCK[fmt], bytes = BQ_BYTES[fmt];
    float *xsum = bq_scratch_get((size_t)(M * nb32) * sizeof(float));
    if (!xsum) TG_FAIL("block matmul: out of memory");
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb32; b++) {
            float t = 0.f;
            for (int i = 0; i < 32; i++) t += x[m * K + 32 * b + i];
            xsum[m * nb32 + b] = t;
        }
    int64_t tiles = (N + BQ_TILE - 1) / BQ_TILE;
    int parallel = N * row_bytes * M > BQ_PARALLEL_BYTES;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n0 = t * BQ_TILE, n1 = n0 + BQ_TILE < N ? n0 + BQ_TILE : N;
        float row[BQ_ROW_MAX];
        for (int64_t n = n0; n < n1; n++) {
            if (regs || K > BQ_ROW_MAX) {
                for (int64_t m = 0; m < M; m++)
                    y[m * ldy + n] = regs ? bq_f32dq_row(fmt, w + n * row_bytes, x + m * K, xsum + m * nb32, nb32)
                                          : bq_dot_float_blocks(fmt, w + n * row_bytes, x + m * K, K);
                continue;
            }
            for (int64_t b = 0; b < K / blk; b++) bq_dequant_block(fmt, w + n * row_bytes + b * bytes, row + b * blk);
            for (int64_t m = 0; m < M; m++) {
                const float *xm = x + m * K;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t k = 0; k < K; k++) acc += xm[k] * row[k];
                y[m * ldy + n] = acc;
            }
        }
    }
    return 0;
}

/* Memory bandwidth probes (the benchmarks report decode as a share of them): a sum over
 * x (bytes read), and a copy (bytes read + written, as STREAM counts them). */
double tg_probe_read(const float *x, int64_t n) {
    double total = 0.;
#pragma omp parallel for reduction(+ : total) schedule(static)
    for (int64_t i0 = 0; i0 < n; i0 += 4096) {
        int64_t i1 = i0 + 4096 < n ? i0 + 4096 : n;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = i0; i < i1; i++) s += x[i];
        total += s;
    }
    return total;
}

void tg_probe_copy(float *dst, const float *src, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t i0 = 0; i0 < n; i0 += 1 << 16) {
        int64_t i1 = i0 + (1 << 16) < n ? i0 + (1 << 16) : n;
        memcpy(dst + i0, src + i0, (size_t)(i1 - i0) * sizeof(float));
    }
}

/* The decode step's other kernels: the KV cache (written, attended over) and sampling. */
#include "decode.c"
