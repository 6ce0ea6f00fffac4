/* tilegraph C backend: flash attention, f32 on AVX-512 register-blocked products (elsewhere on
 * oneDNN's sgemm per block) and bf16 on AMX tiles or AVX-512 BF16 dot products (runtime.h declares tg_attention). Compiled into the runtime
 * library: build.py appends it to runtime.c, whose statics it uses (the bf16 switch of the
 * call, TG_FAIL); tg_amx_granted, defined here, serves blockq.c's AMX kernels too. */
#ifndef TG_MAX_POST /* runtime.h has no include guard; runtime.c is included before this file */
#include "runtime.h"
#endif

/* AMX tiles usable in this process: the processor has them (CPUID 7.0 EDX bit 24), the OS
 * saves their state (XCR0 bits 17, 18) and grants this process the tile data (Linux's
 * arch_prctl; without the grant the first tile instruction faults). Asked once; each kernel
 * checks its own data type (AMX-BF16, AMX-INT8) beside it. */
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
static int tg_amx_granted(void) {
    static int granted = -1;
    if (granted >= 0) return granted;
    unsigned a, b, c, d;
    granted = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return granted;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return granted; /* OSXSAVE: xgetbv allowed */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return granted;
#ifdef SYS_arch_prctl
    granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#endif
    return granted;
}

/* --- attention: softmax(q k^T * scale + mask) v, flash-style ---
 *
 * Per (batch, block of bq query rows) task, keys in blocks of bk (the `tile` pass's
 * block_q and block_kv) with
 * an online softmax (running max and sum, the accumulator rescaled when the max
 * grows): memory is one block of scores and one accumulator row per query, never the
 * Lq x Lk scores. The two products of a block (scores = q k^T, acc += p v) are small
 * GEMMs on oneDNN's sgemm (row-major) where the processor lacks AVX-512; with it, on
 * tg_attention_f32's own register-blocked products. Batch dims are flattened: dims bd[nb] and each tensor's strides
 * over them; rows of q, k, v are contiguous with row strides qr, kr, vr (>= the row).
 * mask_kind: 0 none, 1 bool (keep where true), 2 float (added). Causal keeps
 * j <= i + Lk - Lq. */

/* The result's element type for the tg_attention calls this thread makes next: f32, or bf16
 * (its 16 bits, in the same element positions) where only bf16 GEMMs read the result
 * (onednn.py, bf16_sources). Read once on the calling thread: the workers' copy is theirs. */
static _Thread_local int tg_attention_bf16_out;
void tg_set_attention_out_bf16(int on) { tg_attention_bf16_out = on; }

/* Which operands the next tg_attention calls of this thread read as bf16 (their 16 bits in the
 * same element positions): bit 0 q, bit 1 k, bit 2 v, where their producers write them so
 * (onednn.py, bf16_sources: a GEMM read only by attention); only the bf16 products take them. */
static _Thread_local int tg_attention_bf16_in;
void tg_set_attention_in_bf16(int bits) { tg_attention_bf16_in = bits; }

/* One finished row of attention: the accumulator acc[0:dv] over the softmax's sum, written
 * as element `at` onwards of o (f32, or bf16 where out_bf16). */
static inline void tg_attention_row(float *o, int64_t at, const float *acc, float sum, int64_t dv, int out_bf16) {
    /* a row with every key masked: NaN, as softmax over all -inf is */
    float inv = sum > 0.f ? 1.f / sum : NAN;
    if (out_bf16) {
        uint16_t *oi = (uint16_t *)o + at;
#pragma omp simd
        for (int64_t c = 0; c < dv; c++) oi[c] = tg_f2bf(acc[c] * inv);
    } else {
        float *oi = o + at;
#pragma omp simd
        for (int64_t c = 0; c < dv; c++) oi[c] = acc[c] * inv;
    }
}

/* The offsets of batch row `bi` (flattened over dims bd[nb]) in q, k, v, the mask and o. */
static void tg_batch_offsets(int nb, const int64_t *bd, const int64_t *qb, const int64_t *kb, const int64_t *vb,
                             const int64_t *mb, const int64_t *ob, int64_t bi, int64_t off[5]) {
    off[0] = off[1] = off[2] = off[3] = off[4] = 0;
    for (int i = nb - 1; i >= 0; i--) {
        int64_t idx = bi % bd[i];
        bi /= bd[i];
        off[0] += idx * qb[i]; off[1] += idx * kb[i]; off[2] += idx * vb[i]; off[3] += idx * mb[i];
        off[4] += idx * ob[i];
    }
}

/* One query row's scores against a key block, si[0:nk] (query i0 + i, keys from j0): the
 * causal cut and the mask applied (tg_flash_mask), then the online softmax step - the row's running max and
 * sum updated, si[j] replaced by its weight, the row's accumulator ai[0:dv] rescaled to the
 * new max. Both the f32 and the bf16 products use it. */
static inline void tg_flash_mask(float *si, int64_t nk, int64_t i0, int64_t i, int64_t j0, int64_t lq, int64_t lk,
                                 int causal, int mask_kind, const void *mask, int64_t om, int64_t mr, int64_t mc) {
    if (causal) { /* keys past i + lk - lq are the future */
        int64_t first = i0 + i + lk - lq + 1 - j0;
        for (int64_t j = first < 0 ? 0 : first; j < nk; j++) si[j] = -INFINITY;
    }
    if (mask_kind == 1) {
        const uint8_t *mi = (const uint8_t *)mask + om + (i0 + i) * mr + j0 * mc;
        for (int64_t j = 0; j < nk; j++) if (!mi[j * mc]) si[j] = -INFINITY;
    } else if (mask_kind == 2) {
        const float *mi = (const float *)mask + om + (i0 + i) * mr + j0 * mc;
#pragma omp simd
        for (int64_t j = 0; j < nk; j++) si[j] += mi[j * mc];
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* tg_expf on 16 lanes, the same reduction and polynomial (so every path weighs alike), with
 * 2^n applied by vscalefps: it saturates to inf and to zero itself, so only the input is
 * clamped (far enough out that the result is already inf or zero; NaN passes through
 * max/min as their second operand). The compiler's loop over tg_expf left a scalar tail per
 * row (a row of 197 keys: 5 scalar exps), its running sum in memory and twice the work. */
static inline __m512 tg_exp16(__m512 x) {
    __m512 t = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), t);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.f / 720), _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* e^x for the bf16 path's weights, x a score less its row's running max (so x <= 0, or NaN): no
 * upper clamp, and the polynomial to r^4, whose relative error (under 6e-5 on |r| <= ln2/2) is
 * a thirtieth of the bf16 rounding (2^-9) the weights then take; the f32 products keep tg_exp16.
 * The clamp at -104 keeps a masked score's -inf from making r NaN (scalef takes 2^-150 to 0). */
static inline __m512 tg_exp16_weight(__m512 x) {
    __m512 t = _mm512_max_ps(_mm512_set1_ps(-104.f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), t);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.f / 24), _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 tg_lanes(int64_t n) { return (__mmask16)(n >= 16 ? 0xffff : n <= 0 ? 0 : (1u << n) - 1); }

/* A 16 x 16 block of 32-bit elements (bf16 pairs, or f32) transposed: row r of `in` (row stride ldi)
 * becomes column r of `out` (row stride ldo); rows `live`.. read as zero. In three rounds of
 * shuffles (32-bit, 64-bit, then 128-bit lanes), 64 in all, where a gather per column took
 * several times as long on a processor whose gathers are microcoded. */
static inline void tg_transpose16(const uint32_t *in, int64_t ldi, int64_t live, uint32_t *out, int64_t ldo) {
    __m512i r[16], t[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) r[i] = i < live ? _mm512_loadu_si512(in + i * ldi) : _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) { /* 128-bit lane l of t[i], t[i+1]: rows i, i+1 at columns 4l..4l+3 */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 16; i += 4) { /* r[i + c], lane l: rows i..i+3 at column 4l + c */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) { /* column 4l + c: lane l of r[c], r[4 + c], r[8 + c], r[12 + c] */
        __m512i a_lo = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), a_hi = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
        __m512i b_lo = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        __m512i b_hi = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
        _mm512_storeu_si512(out + (0 + c) * ldo, _mm512_shuffle_i32x4(a_lo, b_lo, 0x88));
        _mm512_storeu_si512(out + (4 + c) * ldo, _mm512_shuffle_i32x4(a_lo, b_lo, 0xdd));
        _mm512_storeu_si512(out + (8 + c) * ldo, _mm512_shuffle_i32x4(a_hi, b_hi, 0x88));
        _mm512_storeu_si512(out + (12 + c) * ldo, _mm512_shuffle_i32x4(a_hi, b_hi, 0xdd));
    }
}

/* tg_flash_row on 16 lanes: the same online-softmax step over si[0:nk], the weights written
 * back to si as f32 or (pi: the bf16 products) as bf16 pairs along the keys, `width` pairs,
 * keys nk.. zero. */
static inline void tg_flash_row16(float *si, int64_t nk, int64_t i0, int64_t i, int64_t j0, int64_t lq, int64_t lk,
                                  int causal, int mask_kind, const void *mask, int64_t om, int64_t mr, int64_t mc,
                                  float *mxi, float *sumi, float *ai, int64_t dv, uint32_t *pi, int64_t width) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 vm = ninf;
    if (mask_kind == 2 && mc == 1 && !causal) { /* an added mask along the keys: in the max's pass */
        const float *mi = (const float *)mask + om + (i0 + i) * mr + j0;
        for (int64_t j = 0; j < nk; j += 16) {
            __mmask16 live = tg_lanes(nk - j);
            __m512 x = _mm512_add_ps(_mm512_mask_loadu_ps(ninf, live, si + j), _mm512_maskz_loadu_ps(live, mi + j));
            _mm512_mask_storeu_ps(si + j, live, x);
            vm = _mm512_max_ps(vm, x);
        }
    } else {
        tg_flash_mask(si, nk, i0, i, j0, lq, lk, causal, mask_kind, mask, om, mr, mc);
        for (int64_t j = 0; j < nk; j += 16) vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(ninf, tg_lanes(nk - j), si + j));
    }
    /* (a NaN score: its weight is NaN, so is the row's sum and output, as softmax's) */
    float m = _mm512_reduce_max_ps(vm);
    m = m > *mxi || m != m ? m : *mxi;
    /* all -inf so far: nothing to weigh yet (exp(-inf - -inf) would be NaN); nothing weighed
     * before this block (the row's first): an accumulator of zeros, no rescaling */
    float corr = m == -INFINITY || *mxi == -INFINITY ? 1.f : tg_expf(*mxi - m);
    const __m512 vmax = _mm512_set1_ps(m);
    __m512 l = _mm512_setzero_ps();
    if (!pi) {
        for (int64_t j = 0; j < nk; j += 16) {
            __mmask16 live = m == -INFINITY ? 0 : tg_lanes(nk - j);
            __m512 p = _mm512_maskz_mov_ps(live, tg_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, si + j), vmax)));
            l = _mm512_add_ps(l, p);
            _mm512_mask_storeu_ps(si + j, tg_lanes(nk - j), p);
        }
    }
#if defined(__AVX512BF16__)
    else {
        for (int64_t j = 0; j < 2 * width; j += 32) {
            __mmask16 lo = m == -INFINITY ? 0 : tg_lanes(nk - j), hi = m == -INFINITY ? 0 : tg_lanes(nk - j - 16);
            __m512 p0 = _mm512_maskz_mov_ps(lo, tg_exp16_weight(_mm512_sub_ps(_mm512_maskz_loadu_ps(lo, si + j), vmax)));
            __m512 p1 = _mm512_maskz_mov_ps(hi, tg_exp16_weight(_mm512_sub_ps(_mm512_maskz_loadu_ps(hi, si + j + 16), vmax)));
            l = _mm512_add_ps(l, _mm512_add_ps(p0, p1));
            _mm512_storeu_si512(pi + j / 2, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
    }
#endif
    *sumi = *sumi * corr + _mm512_reduce_add_ps(l);
    *mxi = m;
    if (corr != 1.f) {
#pragma omp simd
        for (int64_t c = 0; c < dv; c++) ai[c] *= corr;
    }
}
#endif

static inline void tg_flash_row(float *si, int64_t nk, int64_t i0, int64_t i, int64_t j0, int64_t lq, int64_t lk,
                                int causal, int mask_kind, const void *mask, int64_t om, int64_t mr, int64_t mc,
                                float *mxi, float *sumi, float *ai, int64_t dv) {
#if defined(__AVX512F__)
    tg_flash_row16(si, nk, i0, i, j0, lq, lk, causal, mask_kind, mask, om, mr, mc, mxi, sumi, ai, dv, NULL, 0);
#else
    tg_flash_mask(si, nk, i0, i, j0, lq, lk, causal, mask_kind, mask, om, mr, mc);
    float m = *mxi;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < nk; j++) m = si[j] > m ? si[j] : m;
    /* all -inf so far: nothing to weigh yet (exp(-inf - -inf) would be NaN) */
    float corr = m == -INFINITY ? 1.f : tg_expf(*mxi - m), l = 0.f;
#pragma omp simd reduction(+ : l)
    for (int64_t j = 0; j < nk; j++) {
        float p = m == -INFINITY ? 0.f : tg_expf(si[j] - m);
        si[j] = p;
        l += p;
    }
    *sumi = *sumi * corr + l;
    *mxi = m;
    if (corr != 1.f) {
#pragma omp simd
        for (int64_t c = 0; c < dv; c++) ai[c] *= corr;
    }
#endif
}

/* bf16 attention products (precision bf16): both GEMMs of a block with bf16 operands,
 * rounded once to nearest even (vcvtne2ps2bf16), and f32 accumulation; oneDNN 3.2's C API
 * has no bf16 GEMM function to call here. On AMX as tiles (tdpbf16ps: a 16x16 f32 tile +=
 * 16x32 bf16 by 32x16 bf16), taken where the running processor reports AMX-BF16 and the
 * kernel grants this process the tile state (arch_prctl); else on AVX-512 BF16 (vdpbf16ps:
 * 16 f32 lanes += 16 bf16 pairs times 16 pairs, over the same packed operands), which on a
 * processor that issues it at its f32 FMAs' rate doubles their products (ViT-S/16's
 * attention at 197 tokens took about half the f32 path's time). Compiled where the compiler
 * targets AVX-512 BF16 (-march=native), AMX's parts where it targets AMX. */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define TG_HAVE_BF16_ATTENTION 1
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define TG_HAVE_AMX_ATTENTION 1

static int tg_amx_ready(void) {
    unsigned a, b, c, d; /* AMX-BF16: CPUID 7.0 EDX bit 22 */
    return tg_amx_granted() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22));
}

/* Tile registers, each 16 rows of 64 bytes: 0-3 a 2x2 block of the product, 4-5 two row
 * blocks of the left operand (16 rows x 16 bf16 pairs), 6-7 two column blocks of the right
 * one (16 pair rows x 16 columns). Configured per thread (tile state is). */
static void tg_amx_configure(void) {
    struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
}
#endif

/* AVX-512 BF16's bf16 dot products: CPUID 7.1 EAX bit 5. */
static int tg_avx512_bf16_ready(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
}

/* Element i of x, f32 or (bf16) bf16. */
static inline const void *tg_elem(const void *x, int bf16, int64_t i) { return (const char *)x + i * (bf16 ? 2 : 4); }

/* 16 elements from element `at` of x, f32 or (bf16) bf16 widened exactly; lanes off in m zero. */
static inline __m512 tg_load16(const void *x, int64_t at, __mmask16 m, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)x + at)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)x + at);
}

/* rows x n elements, f32 or (bf16) bf16 (row stride ld), each times `mul`, to bf16 rows of
 * `stride` elements, n..stride zero (the left operand: a row's consecutive bf16 pairs are its
 * pairs along n). A bf16 source times a power of two is exact: the same as its f32's rounding. */
static void tg_bf16_rows(const void *x, int bf16, int64_t ld, int64_t rows, int64_t n, int64_t stride, float mul,
                         uint16_t *y) {
    const __m512 m = _mm512_set1_ps(mul);
    for (int64_t i = 0; i < rows; i++) {
        uint16_t *yi = y + i * stride;
        for (int64_t j = 0; j < stride; j += 32) {
            __mmask16 lo = (__mmask16)(n - j >= 16 ? 0xffff : n - j <= 0 ? 0 : (1u << (n - j)) - 1);
            __mmask16 hi = (__mmask16)(n - j >= 32 ? 0xffff : n - j <= 16 ? 0 : (1u << (n - j - 16)) - 1);
            __m512bh v = _mm512_cvtne2ps_pbh(_mm512_mul_ps(tg_load16(x, i * ld + j + 16, hi, bf16), m),
                                             _mm512_mul_ps(tg_load16(x, i * ld + j, lo, bf16), m));
            _mm512_storeu_si512(yi + j, (__m512i)v);
        }
    }
}

/* c = a b (beta 0) or c += a b (beta 1) on AMX, c being 16 mt rows x 16 nt columns of f32
 * (row stride ldc): a is 16 mt rows of 16 kt bf16 pairs (row stride lda pairs), b 16 kt pair
 * rows of 16 nt columns (row stride ldb). The product tiles are loaded from c (or zeroed) and
 * stored back whole; two by two of them at a time, so each block of a and of b loaded serves
 * two products. */
#ifdef TG_HAVE_AMX_ATTENTION
#define TG_AMX_C(t, p) do { if (beta) _tile_loadd(t, p, ldc * 4); else _tile_zero(t); } while (0)
static void tg_amx_gemm(int64_t mt, int64_t nt, int64_t kt, const uint32_t *a, int64_t lda, const uint32_t *b,
                        int64_t ldb, float *c, int64_t ldc, int beta) {
    for (int64_t i = 0; i < mt; i += 2)
        for (int64_t j = 0; j < nt; j += 2) {
            const uint32_t *a0 = a + 16 * i * lda, *a1 = a0 + 16 * lda, *b0 = b + 16 * j, *b1 = b0 + 16;
            float *c00 = c + 16 * i * ldc + 16 * j, *c10 = c00 + 16 * ldc;
            if (i + 1 < mt && j + 1 < nt) {
                TG_AMX_C(0, c00); TG_AMX_C(1, c00 + 16); TG_AMX_C(2, c10); TG_AMX_C(3, c10 + 16);
                for (int64_t t = 0; t < kt; t++) {
                    _tile_loadd(4, a0 + 16 * t, lda * 4);
                    _tile_loadd(6, b0 + 16 * t * ldb, ldb * 4);
                    _tile_loadd(7, b1 + 16 * t * ldb, ldb * 4);
                    _tile_loadd(5, a1 + 16 * t, lda * 4);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, c00, ldc * 4); _tile_stored(1, c00 + 16, ldc * 4);
                _tile_stored(2, c10, ldc * 4); _tile_stored(3, c10 + 16, ldc * 4);
            } else if (j + 1 < nt) { /* the last row block */
                TG_AMX_C(0, c00); TG_AMX_C(1, c00 + 16);
                for (int64_t t = 0; t < kt; t++) {
                    _tile_loadd(4, a0 + 16 * t, lda * 4);
                    _tile_loadd(6, b0 + 16 * t * ldb, ldb * 4);
                    _tile_loadd(7, b1 + 16 * t * ldb, ldb * 4);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                }
                _tile_stored(0, c00, ldc * 4); _tile_stored(1, c00 + 16, ldc * 4);
            } else if (i + 1 < mt) { /* the last column block */
                TG_AMX_C(0, c00); TG_AMX_C(2, c10);
                for (int64_t t = 0; t < kt; t++) {
                    _tile_loadd(4, a0 + 16 * t, lda * 4);
                    _tile_loadd(5, a1 + 16 * t, lda * 4);
                    _tile_loadd(6, b0 + 16 * t * ldb, ldb * 4);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(2, 5, 6);
                }
                _tile_stored(0, c00, ldc * 4); _tile_stored(2, c10, ldc * 4);
            } else {
                TG_AMX_C(0, c00);
                for (int64_t t = 0; t < kt; t++) {
                    _tile_loadd(4, a0 + 16 * t, lda * 4);
                    _tile_loadd(6, b0 + 16 * t * ldb, ldb * 4);
                    _tile_dpbf16ps(0, 4, 6);
                }
                _tile_stored(0, c00, ldc * 4);
            }
        }
}
#undef TG_AMX_C
#endif

/* tg_amx_gemm's product on AVX-512 BF16, for rows r0..r0+3 and `nb` (1-4) column blocks from
 * column block j: every accumulator a register, each pair of a broadcast to all lanes and
 * multiplied into the four column blocks' pairs it meets. */
static inline __attribute__((always_inline)) void tg_dp_block(int nb, int64_t kp, const uint32_t *a, int64_t lda,
                                                              const uint32_t *b, int64_t ldb, float *c, int64_t ldc,
                                                              int beta) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 4
        for (int n = 0; n < nb; n++) acc[r][n] = beta ? _mm512_loadu_ps(c + r * ldc + 16 * n) : _mm512_setzero_ps();
    /* two pairs an iteration: the loop's own counting and branch no longer sit between every
     * 16 dot products (7% off ViT-S/16's and BERT-base's attention; unrolling by 4 no more) */
#pragma GCC unroll 2
    for (int64_t p = 0; p < kp; p++) {
        __m512bh bv[4];
#pragma GCC unroll 4
        for (int n = 0; n < nb; n++) bv[n] = (__m512bh)_mm512_loadu_si512(b + p * ldb + 16 * n);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[r * lda + p]);
#pragma GCC unroll 4
            for (int n = 0; n < nb; n++) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], av, bv[n]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 4
        for (int n = 0; n < nb; n++) _mm512_storeu_ps(c + r * ldc + 16 * n, acc[r][n]);
}

/* tg_amx_gemm's product on AVX-512 BF16, over only what it needs: `rows` rows of c (rounded
 * up to 4, the block's height), nt column blocks of 16 and `pairs` bf16 pairs, where AMX
 * multiplies whole 16-row and 16-pair tiles. A's rows up to the rounding and b's pair rows
 * beyond `pairs` up to the tiles' are zero or unread. ViT's 197 keys are 99 pairs where the
 * tiles take 112, and its last slab of 5 query rows 8 where they take 16. The column blocks
 * go in runs of at most 4, as even as they come (13 blocks: 4, 3, 3, 3, not 4, 4, 4, 1: a run
 * of one has four accumulators, too few to hide the dot product's latency). Returns the
 * multiply-adds of bf16 pairs it ran (tg_bf16_attention_pairs). */
static int64_t tg_dp_gemm(int64_t rows, int64_t nt, int64_t pairs, const uint32_t *a, int64_t lda, const uint32_t *b,
                          int64_t ldb, float *c, int64_t ldc, int beta) {
    int64_t runs = (nt + 3) / 4;
    for (int64_t i = 0; i < rows; i += 4)
        for (int64_t run = 0, j = 0; run < runs; run++) {
            int64_t nb = (nt - j + runs - run - 1) / (runs - run);
            const uint32_t *ai = a + i * lda, *bj = b + 16 * j;
            float *cij = c + i * ldc + 16 * j;
            switch ((int)nb) {
            case 4: tg_dp_block(4, pairs, ai, lda, bj, ldb, cij, ldc, beta); break;
            case 3: tg_dp_block(3, pairs, ai, lda, bj, ldb, cij, ldc, beta); break;
            case 2: tg_dp_block(2, pairs, ai, lda, bj, ldb, cij, ldc, beta); break;
            default: tg_dp_block(1, pairs, ai, lda, bj, ldb, cij, ldc, beta); break;
            }
            j += nb;
        }
    return (rows + 3) / 4 * 4 * 16 * nt * pairs;
}

/* The block products on AMX tiles (amx: whole 16 x 16 tiles) or AVX-512 BF16 (c's first
 * `rows` rows, `pairs` pairs); returns the multiply-adds of pairs run. */
static int64_t tg_bf16_gemm(int amx, int64_t rows, int64_t nt, int64_t pairs, const uint32_t *a, int64_t lda,
                            const uint32_t *b, int64_t ldb, float *c, int64_t ldc, int beta) {
#ifdef TG_HAVE_AMX_ATTENTION
    if (amx) {
        int64_t mt = (rows + 15) / 16, kt = (pairs + 15) / 16;
        tg_amx_gemm(mt, nt, kt, a, lda, b, ldb, c, ldc, beta);
        return 16 * mt * 16 * nt * 16 * kt;
    }
#endif
    (void)amx;
    return tg_dp_gemm(rows, nt, pairs, a, lda, b, ldb, c, ldc, beta);
}

/* One key block of a batch row in the right operands' layouts, made once for every query
 * block that reads it: k as bf16 pairs along d, transposed so key j is column j (dp16 pair
 * rows of bk16 columns; through `rows`, the block's k rows converted, bk x dp16 pairs), and
 * v as pairs down the keys (kp16 pair rows of dv16 columns: keys 2u and 2u+1 of column c in
 * pair u). Padding keys and columns are zero. */
static void tg_pack_kv(const void *k, int64_t kr, const void *v, int64_t vr, int in_bf16, int64_t nk, int64_t d,
                       int64_t dv, int64_t dp16, int64_t bk16, int64_t kp16, int64_t dv16, uint32_t *rows,
                       uint32_t *kh, uint32_t *vh) {
    tg_bf16_rows(k, in_bf16 & 2, kr, nk, d, 2 * dp16, 1.f, (uint16_t *)rows);
    for (int64_t j = 0; j < bk16; j += 16)
        for (int64_t t = 0; t < dp16; t += 16)
            tg_transpose16(rows + j * dp16 + t, dp16, nk - j, kh + t * bk16 + j, bk16);
    for (int64_t u = 0; u < kp16; u++)
        for (int64_t c = 0; c < dv16; c += 16) {
            __mmask16 cols = (__mmask16)(dv - c >= 16 ? 0xffff : dv - c <= 0 ? 0 : (1u << (dv - c)) - 1);
            __mmask16 even = 2 * u < nk ? cols : 0, odd = 2 * u + 1 < nk ? cols : 0;
            __m512i lo, hi;
            if (in_bf16 & 4) { /* already bf16: each key's 16 bits as they are */
                lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(even, (const uint16_t *)v + 2 * u * vr + c));
                hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(odd, (const uint16_t *)v + (2 * u + 1) * vr + c));
            } else {
                lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(even, (const float *)v + 2 * u * vr + c)));
                hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(odd, (const float *)v + (2 * u + 1) * vr + c)));
            }
            _mm512_storeu_si512(vh + u * dv16 + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
}

/* tg_attention at bf16 on AMX (no length or head dim zero): every key block's k and v packed
 * once (a first parallel pass), then the query-block tasks, each thread with one working area for all its
 * tasks: q's block as bf16 pairs (bq16 rows of dp16 pairs), one slab's scores (TG_AMX_SLAB x
 * bk16 f32) and weights as bf16 pairs along the keys (TG_AMX_SLAB rows of kp16 pairs), the
 * accumulator (bq16 x dv16 f32, the product tiles load and store it whole), the running max
 * and sum. A slab is two row tiles: the product's 2x2 blocking uses both. */
#define TG_AMX_SLAB 32
static int tg_attention_bf16(int nb, const int64_t *bd, const int64_t *qb, const int64_t *kb, const int64_t *vb,
                             const int64_t *mb, const int64_t *ob, const float *q, const float *k, const float *v,
                             const void *mask, float *o, int64_t lq, int64_t lk, int64_t d, int64_t dv, int64_t qr,
                             int64_t kr, int64_t vr, int64_t orow, int mask_kind, int64_t mr, int64_t mc, float scale,
                             int causal, int64_t bq, int64_t bk, int64_t batches, int out_bf16, int in_bf16,
                             int amx) {
    int64_t up = 16, bq16 = (bq + 15) / up * up, bk16 = (bk + 15) / up * up, dv16 = (dv + 15) / up * up;
    int64_t dp16 = ((d + 1) / 2 + 15) / up * up, kp16 = ((bk + 1) / 2 + 15) / up * up;
    int64_t qblocks = (lq + bq - 1) / bq, kblocks = (lk + bk - 1) / bk, per_block = dp16 * bk16 + kp16 * dv16;
    uint32_t *packed = malloc(sizeof(uint32_t) * (size_t)(batches * kblocks * per_block));
    if (!packed) TG_FAIL("attention: out of memory for its packed keys and values");
    size_t work = sizeof(uint32_t) * (size_t)(bq16 * dp16 + TG_AMX_SLAB * kp16 + bk * dp16) +
                  sizeof(float) * (size_t)(TG_AMX_SLAB * bk16 + bq16 * dv16 + 2 * bq) + 64;
    int failed = 0;
#pragma omp parallel if (batches * lq * lk * d > 65536)
    {
        int64_t macs = 0;
        char *area = malloc(work);
        if (!area) failed = 1;
        uint32_t *qh = (uint32_t *)(((uintptr_t)area + 63) & ~(uintptr_t)63), *ph = qh + bq16 * dp16;
        uint32_t *rows = ph + TG_AMX_SLAB * kp16;
        float *s = (float *)(rows + bk * dp16), *acc = s + TG_AMX_SLAB * bk16, *mx = acc + bq16 * dv16, *sum = mx + bq;
#ifdef TG_HAVE_AMX_ATTENTION
        if (area && amx) tg_amx_configure();
#endif
#pragma omp for collapse(2) schedule(static)
        for (int64_t bi = 0; bi < batches; bi++)
            for (int64_t kbk = 0; kbk < kblocks; kbk++) {
                if (!area) continue;
                int64_t off[5], j0 = kbk * bk, nk = j0 + bk < lk ? bk : lk - j0;
                tg_batch_offsets(nb, bd, qb, kb, vb, mb, ob, bi, off);
                uint32_t *kh = packed + (bi * kblocks + kbk) * per_block;
                tg_pack_kv(tg_elem(k, in_bf16 & 2, off[1] + j0 * kr), kr, tg_elem(v, in_bf16 & 4, off[2] + j0 * vr), vr,
                           in_bf16, nk, d, dv, dp16, bk16, kp16, dv16, rows, kh, kh + dp16 * bk16);
            }
#pragma omp for collapse(2) schedule(dynamic)
        for (int64_t bi = 0; bi < batches; bi++)
            for (int64_t qbk = 0; qbk < qblocks; qbk++) {
                if (!area) continue;
                int64_t off[5];
                tg_batch_offsets(nb, bd, qb, kb, vb, mb, ob, bi, off);
                int64_t i0 = qbk * bq, i1 = i0 + bq < lq ? i0 + bq : lq, nq = i1 - i0, mt = (nq + 15) / 16;
                /* q times the scale (exact for a power of two; else one rounding, as q's alone);
                 * rows nq.. of the last row block zero, so every product tile is finite */
                tg_bf16_rows(tg_elem(q, in_bf16 & 1, off[0] + i0 * qr), in_bf16 & 1, qr, nq, d, 2 * dp16, scale,
                             (uint16_t *)qh);
                memset(qh + nq * dp16, 0, sizeof(uint32_t) * (16 * mt - nq) * dp16);
                memset(acc, 0, sizeof(float) * 16 * mt * dv16);
                for (int64_t i = 0; i < nq; i++) { mx[i] = -INFINITY; sum[i] = 0.f; }
                for (int64_t kbk = 0; kbk < kblocks; kbk++) {
                    int64_t j0 = kbk * bk, nk = j0 + bk < lk ? bk : lk - j0;
                    if (causal && j0 > i1 - 1 + lk - lq) break;
                    const uint32_t *kh = packed + (bi * kblocks + kbk) * per_block, *vh = kh + dp16 * bk16;
                    /* a slab of TG_AMX_SLAB query rows at a time through both products, so its
                     * scores and weights stay in the core's first-level cache between them */
                    for (int64_t r0 = 0; r0 < nq; r0 += TG_AMX_SLAB) {
                        int64_t rn = nq - r0 < TG_AMX_SLAB ? nq - r0 : TG_AMX_SLAB, rt = (rn + 15) / 16;
                        macs += tg_bf16_gemm(amx, rn, (nk + 15) / 16, (d + 1) / 2, qh + r0 * dp16, dp16, kh, bk16, s,
                                             bk16, 0);
                        for (int64_t i = 0; i < rn; i++) /* the weights: bf16 pairs along the keys */
                            tg_flash_row16(s + i * bk16, nk, i0, r0 + i, j0, lq, lk, causal, mask_kind, mask,
                                              off[3], mr, mc, mx + r0 + i, sum + r0 + i, acc + (r0 + i) * dv16, dv,
                                              ph + i * kp16, kp16);
                        memset(ph + rn * kp16, 0, sizeof(uint32_t) * (16 * rt - rn) * kp16); /* rows rn.. zero */
                        macs += tg_bf16_gemm(amx, rn, dv16 / 16, (nk + 1) / 2, ph, kp16, vh, dv16, acc + r0 * dv16,
                                             dv16, 1);
                    }
                }
                for (int64_t i = 0; i < nq; i++)
                    tg_attention_row(o, off[4] + (i0 + i) * orow, acc + i * dv16, sum[i], dv, out_bf16);
            }
#ifdef TG_HAVE_AMX_ATTENTION
        if (area && amx) _tile_release();
#endif
        __atomic_fetch_add(&tg_bf16_attention_macs, macs, __ATOMIC_RELAXED);
        free(area);
    }
    free(packed);
    if (failed) TG_FAIL("attention: out of memory for its working blocks");
    __atomic_fetch_add(&tg_bf16_attentions, 1, __ATOMIC_RELAXED);
    return 0;
}
#endif

/* --- f32 attention on AVX-512, the products in registers ---
 *
 * oneDNN's sgemm per block ran each product near the f32 GEMM rate, but repacked the
 * block's keys (or values) on every call, once per query block, and the softmax between
 * the products took a seventh of the time (its e^x, 12 vector operations a 16 weights).
 * Here every key block's k (transposed: key j is column j) and v (columns padded to 16)
 * are packed once, in a first parallel pass; each query block then goes through the key
 * blocks a slab of TG_F32_SLAB rows at a time (its scores stay in the first-level cache
 * between the two products), on register-blocked products (tg_f32_gemm). The scores are
 * kept in base 2: q k^T is scaled by scale * log2(e) as it is stored (a float mask's
 * values too), so a weight is 2^(s - max), one subtraction and tg_exp2_16. A causal slab
 * multiplies only the keys its last row sees: the diagonal blocks' masked half is not
 * multiplied (GPT-2's 256 tokens in blocks of 128: a third of the products). */
#if defined(__AVX512F__)
#define TG_HAVE_F32_ATTENTION 1
/* Rows of a slab: its scores against a key block of 256 are 32 KiB at 32 rows, the first-level
 * cache of the cores measured (benchmarks/c_attention_ab.py): 16 leaves room for the keys. */
#define TG_F32_SLAB 16
/* Rows of the products' register block: 6 rows of 4 column vectors are 24 accumulators, the
 * most that leave a 32-register file room for the 4 loaded columns and the broadcast. */
#define TG_F32_ROWS 6
/* Rows of the register block where a run is 1-2 column vectors (a head dim of 32: dV, dQ and dK
 * of the backward, P V of the forward): 12 rows of 2 are 24 accumulators again, and each loaded
 * column serves twice the rows (6 rows of 2 took 8 loads per 12 FMAs). */
#define TG_F32_ROWS_NARROW 12

/* Attention calls that took this path so far (tests check the path is taken). */
static int tg_f32_attentions;
int tg_f32_attention_count(void) { return __atomic_load_n(&tg_f32_attentions, __ATOMIC_RELAXED); }

/* 2^y on 16 lanes for y <= 0 (or NaN): y = n + f with n an integer and |f| <= 1/2, 2^f a
 * degree-5 polynomial (fitted here for the least largest relative error on [-1/2, 1/2]:
 * 1.9e-7 evaluated in f32, as tg_exp16's degree-6 Taylor series on its own reduction), 2^n
 * by vscalefps. The clamp keeps -inf (a masked key) from making f NaN; NaN passes through
 * max as its second operand. */
static inline __m512 tg_exp2_16(__m512 y) {
    __m512 t = _mm512_max_ps(_mm512_set1_ps(-150.f), y);
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(0x1.5bba14p-10f), _mm512_set1_ps(0x1.3cea88p-7f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0x1.c6b752p-5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0x1.ebf9bcp-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0x1.62e42ap-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* One query row's base-2 scores against a key block, si[0:nk]: masked (a float mask's values
 * times log2(e)), the online softmax step (tg_flash_row16's) with weights 2^(s - max). The row's
 * storage runs on to a multiple of 16 (the products' columns): vectors are loaded and stored
 * whole, lanes past the keys left out of the max and the sum by a mask on those operations
 * only. Masked loads and stores took most of this step's time on a processor that runs them
 * slowly; so did the causal cut written a key at a time and read back as vectors (the store
 * forwarding fails): here the row's keys past its position are just not weighed, their
 * weights zero. */
static inline void tg_flash_row_log2(float *si, int64_t nk, int64_t i0, int64_t i, int64_t j0, int64_t lq,
                                     int64_t lk, int causal, int mask_kind, const void *mask, int64_t om, int64_t mr,
                                     int64_t mc, float *mxi, float *sumi, float *ai, int64_t dv) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY), log2e = _mm512_set1_ps(1.44269504088896341f);
    int64_t n = nk; /* the keys this row sees: causal, those up to position i + lk - lq */
    if (causal) n = i0 + i + lk - lq + 1 - j0 < 0 ? 0 : i0 + i + lk - lq + 1 - j0 < nk ? i0 + i + lk - lq + 1 - j0 : nk;
    __m512 vm = ninf;
    if (mask_kind == 2 && mc == 1) { /* an added mask along the keys: in the max's pass, masked loads
                                      * only for the last keys (every vector's took a fifth of MiniLM's) */
        const float *mi = (const float *)mask + om + (i0 + i) * mr + j0;
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(mi + j), log2e, _mm512_loadu_ps(si + j));
            _mm512_storeu_ps(si + j, x);
            vm = _mm512_max_ps(vm, x);
        }
        if (j < n) {
            __mmask16 live = tg_lanes(n - j);
            __m512 x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, mi + j), log2e, _mm512_loadu_ps(si + j));
            _mm512_storeu_ps(si + j, x);
            vm = _mm512_mask_max_ps(vm, live, vm, x);
        }
    } else {
        tg_flash_mask(si, n, i0, i, j0, lq, lk, 0, mask_kind == 2 ? 0 : mask_kind, mask, om, mr, mc);
        if (mask_kind == 2) {
            const float *mi = (const float *)mask + om + (i0 + i) * mr + j0 * mc;
            for (int64_t j = 0; j < n; j++) si[j] += mi[j * mc] * 1.44269504088896341f;
        }
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(si + j));
        if (j < n) vm = _mm512_mask_max_ps(vm, tg_lanes(n - j), vm, _mm512_loadu_ps(si + j));
    }
    float m = _mm512_reduce_max_ps(vm);
    m = m > *mxi || m != m ? m : *mxi;
    if (m == -INFINITY) { /* every key so far masked: nothing to weigh yet */
        for (int64_t j = 0; j < nk; j++) si[j] = 0.f;
        return;
    }
    /* nothing weighed before this block (the row's first): an accumulator of zeros */
    float corr = *mxi == -INFINITY ? 1.f : exp2f(*mxi - m);
    const __m512 vmax = _mm512_set1_ps(m);
    __m512 l = _mm512_setzero_ps(), l2 = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) { /* two sums: the adds' latency off the loop's path */
        __m512 p = tg_exp2_16(_mm512_sub_ps(_mm512_loadu_ps(si + j), vmax));
        __m512 p2 = tg_exp2_16(_mm512_sub_ps(_mm512_loadu_ps(si + j + 16), vmax));
        l = _mm512_add_ps(l, p);
        l2 = _mm512_add_ps(l2, p2);
        _mm512_storeu_ps(si + j, p);
        _mm512_storeu_ps(si + j + 16, p2);
    }
    for (; j < n; j += 16) { /* (the lanes past n: weight zero, the products read them up to nk) */
        __m512 p = _mm512_maskz_mov_ps(tg_lanes(n - j), tg_exp2_16(_mm512_sub_ps(_mm512_loadu_ps(si + j), vmax)));
        l = _mm512_add_ps(l, p);
        _mm512_storeu_ps(si + j, p);
    }
    for (; j < nk; j += 16) _mm512_storeu_ps(si + j, _mm512_setzero_ps());
    *sumi = *sumi * corr + _mm512_reduce_add_ps(_mm512_add_ps(l, l2));
    *mxi = m;
    if (corr != 1.f) {
#pragma omp simd
        for (int64_t c = 0; c < dv; c++) ai[c] *= corr;
    }
}

/* c = a b times `mul` (beta 0) or c += a b (beta 1) for rows r0..r0+R-1 and nb (1-4) column
 * vectors: a's rows of kred elements (row stride lda; at: a transposed, its row r the column r
 * of kred rows lda apart, as attention's backward reads P^T and dS^T from their slabs), b kred
 * rows of 16 nb columns (row stride ldb); every accumulator a register, each element of a
 * broadcast into the column vectors. */
static inline __attribute__((always_inline)) void tg_f32_block(int R, int nb, int64_t kred, const float *a,
                                                               int64_t lda, const float *b, int64_t ldb, float *c,
                                                               int64_t ldc, int beta, float mul, int at) {
    __m512 acc[TG_F32_ROWS_NARROW][4];
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int n = 0; n < nb; n++) acc[r][n] = beta ? _mm512_loadu_ps(c + r * ldc + 16 * n) : _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t p = 0; p < kred; p++) {
        __m512 bv[4];
#pragma GCC unroll 4
        for (int n = 0; n < nb; n++) bv[n] = _mm512_loadu_ps(b + p * ldb + 16 * n);
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            __m512 av = _mm512_set1_ps(at ? a[p * lda + r] : a[r * lda + p]);
#pragma GCC unroll 4
            for (int n = 0; n < nb; n++) acc[r][n] = _mm512_fmadd_ps(av, bv[n], acc[r][n]);
        }
    }
    const __m512 vmul = _mm512_set1_ps(mul);
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int n = 0; n < nb; n++)
            _mm512_storeu_ps(c + r * ldc + 16 * n, beta ? acc[r][n] : _mm512_mul_ps(acc[r][n], vmul));
}

#define TG_F32_CASE(R, N) case R * 8 + N: tg_f32_block(R, N, kred, ai, lda, bj, ldb, cij, ldc, beta, mul, at); break;
#define TG_F32_CASES(R) TG_F32_CASE(R, 1) TG_F32_CASE(R, 2) TG_F32_CASE(R, 3) TG_F32_CASE(R, 4)
#define TG_F32_NARROW(R) TG_F32_CASE(R, 1) TG_F32_CASE(R, 2)
/* tg_f32_block over `rows` rows of c and nt column vectors, in runs of at most 4 vectors as even
 * as they come (tg_dp_gemm's); a run's columns of b (from the first-level cache) serve all rows.
 * One copy each for a as it is and a transposed (tg_f32_gemm, tg_f32_gemm_at): `at` a constant. */
static inline __attribute__((always_inline)) void tg_f32_gemm_body(int64_t rows, int64_t nt, int64_t kred, const float *a,
                                                                   int64_t lda, const float *b, int64_t ldb, float *c,
                                                                   int64_t ldc, int beta, float mul, int at) {
    int64_t runs = (nt + 3) / 4;
    for (int64_t run = 0, j = 0; run < runs; run++) {
        int64_t nb = (nt - j + runs - run - 1) / (runs - run);
        int64_t tall = nb <= 2 ? TG_F32_ROWS_NARROW : TG_F32_ROWS;
        for (int64_t i = 0; i < rows; i += tall) {
            int64_t r = rows - i < tall ? rows - i : tall;
            const float *ai = at ? a + i : a + i * lda, *bj = b + 16 * j;
            float *cij = c + i * ldc + 16 * j;
            switch ((int)(r * 8 + nb)) {
                TG_F32_CASES(1) TG_F32_CASES(2) TG_F32_CASES(3) TG_F32_CASES(4) TG_F32_CASES(5) TG_F32_CASES(6)
                TG_F32_NARROW(7) TG_F32_NARROW(8) TG_F32_NARROW(9) TG_F32_NARROW(10) TG_F32_NARROW(11)
                TG_F32_NARROW(12)
            }
        }
        j += nb;
    }
}
static void tg_f32_gemm(int64_t rows, int64_t nt, int64_t kred, const float *a, int64_t lda, const float *b,
                        int64_t ldb, float *c, int64_t ldc, int beta, float mul) {
    tg_f32_gemm_body(rows, nt, kred, a, lda, b, ldb, c, ldc, beta, mul, 0);
}
static void tg_f32_gemm_at(int64_t rows, int64_t nt, int64_t kred, const float *a, int64_t lda, const float *b,
                           int64_t ldb, float *c, int64_t ldc, int beta, float mul) {
    tg_f32_gemm_body(rows, nt, kred, a, lda, b, ldb, c, ldc, beta, mul, 1);
}
#undef TG_F32_CASES
#undef TG_F32_NARROW
#undef TG_F32_CASE

/* rows x cols of x (row stride ld) into y (row stride ldy), columns cols..ldy zero */
static void tg_pad_rows(const float *x, int64_t ld, int64_t rows, int64_t cols, float *y, int64_t ldy) {
    for (int64_t i = 0; i < rows; i++) {
        memcpy(y + i * ldy, x + i * ld, sizeof(float) * (size_t)cols);
        memset(y + i * ldy + cols, 0, sizeof(float) * (size_t)(ldy - cols));
    }
}

/* x's rows (n rows of c columns, row stride ld) as the columns of xt (c rows of ldt, the
 * columns n..ldt zero): 16 x 16 blocks transposed in registers (an element at a time, the
 * stores a row of xt apart took an eighth of GPT-2's attention), the last c % 16 rows one
 * element at a time. The forward's key blocks, the backward's k and v. */
static void tg_pack_transposed(const float *x, int64_t ld, int64_t n, int64_t c, float *xt, int64_t ldt) {
    int64_t c16 = c / 16 * 16;
    for (int64_t j = 0; j < ldt; j += 16)
        for (int64_t col = 0; col < c16; col += 16)
            tg_transpose16((const uint32_t *)(x + j * ld + col), ld, n - j, (uint32_t *)(xt + col * ldt + j), ldt);
    for (int64_t col = c16; col < c; col++)
        for (int64_t j = 0; j < ldt; j++) xt[col * ldt + j] = j < n ? x[j * ld + col] : 0.f;
}

/* tg_attention at f32 (no length or head dim zero): the key blocks packed (k transposed, d rows
 * of bk16 keys; v's nk rows of dv16 columns; padding zero), then the query-block tasks, each
 * thread with one working area: a slab's scores, the accumulator (bq x dv16), the running max
 * and sum. */
static int tg_attention_f32(int nb, const int64_t *bd, const int64_t *qb, const int64_t *kb, const int64_t *vb,
                            const int64_t *mb, const int64_t *ob, const float *q, const float *k, const float *v,
                            const void *mask, float *o, int64_t lq, int64_t lk, int64_t d, int64_t dv, int64_t qr,
                            int64_t kr, int64_t vr, int64_t orow, int mask_kind, int64_t mr, int64_t mc, float scale,
                            int causal, int64_t bq, int64_t bk, int64_t batches, int out_bf16) {
    int64_t bk16 = (bk + 15) / 16 * 16, dv16 = (dv + 15) / 16 * 16;
    int64_t qblocks = (lq + bq - 1) / bq, kblocks = (lk + bk - 1) / bk, per_block = d * bk16 + bk * dv16;
    /* One query block per head (short sequences: MiniLM's 128 tokens): the head's one task packs
     * its keys and values into its thread's area, where the products then find them in cache;
     * the shared buffer for all heads (3 MiB there), allocated, first touched and packed in a
     * pass of its own on every call, was a fifth of such a call. */
    const int own = qblocks == 1;
    float *packed = own ? NULL : malloc(sizeof(float) * (size_t)(batches * kblocks * per_block));
    if (!own && !packed) TG_FAIL("attention: out of memory for its packed keys and values");
    size_t work = sizeof(float) * (size_t)(TG_F32_SLAB * bk16 + bq * dv16 + 2 * bq + (own ? kblocks * per_block : 0)) + 64;
    const float mul = scale * 1.44269504088896341f;
    int failed = 0;
#pragma omp parallel if (batches * lq * lk * d > 65536)
    {
        char *area = malloc(work);
        if (!area) failed = 1;
        float *s = (float *)(((uintptr_t)area + 63) & ~(uintptr_t)63), *mine = s + TG_F32_SLAB * bk16;
        float *acc = mine + (own ? kblocks * per_block : 0), *mx = acc + bq * dv16, *sum = mx + bq;
        /* key block kbk of batch row bi packed at kh: k^T (d rows of bk16 keys), then v (nk rows
         * of dv16 columns), the padding zero */
#define TG_PACK_KV(bi, kbk, kh) do { \
        int64_t off_[5], j0_ = (kbk) * bk, nk_ = j0_ + bk < lk ? bk : lk - j0_; \
        tg_batch_offsets(nb, bd, qb, kb, vb, mb, ob, bi, off_); \
        tg_pack_transposed(k + off_[1] + j0_ * kr, kr, nk_, d, kh, bk16); \
        tg_pad_rows(v + off_[2] + j0_ * vr, vr, nk_, dv, (kh) + d * bk16, dv16); } while (0)
        if (!own) {
#pragma omp for collapse(2) schedule(static)
            for (int64_t bi = 0; bi < batches; bi++)
                for (int64_t kbk = 0; kbk < kblocks; kbk++) TG_PACK_KV(bi, kbk, packed + (bi * kblocks + kbk) * per_block);
        }
#pragma omp for collapse(2) schedule(dynamic)
        for (int64_t bi = 0; bi < batches; bi++)
            for (int64_t qbk = 0; qbk < qblocks; qbk++) {
                if (!area) continue;
                int64_t off[5];
                tg_batch_offsets(nb, bd, qb, kb, vb, mb, ob, bi, off);
                for (int64_t kbk = 0; own && kbk < kblocks; kbk++) TG_PACK_KV(bi, kbk, mine + kbk * per_block);
                const float *heads = own ? mine : packed + bi * kblocks * per_block;
                int64_t i0 = qbk * bq, i1 = i0 + bq < lq ? i0 + bq : lq, nq = i1 - i0;
                memset(acc, 0, sizeof(float) * nq * dv16);
                for (int64_t i = 0; i < nq; i++) { mx[i] = -INFINITY; sum[i] = 0.f; }
                for (int64_t kbk = 0; kbk < kblocks; kbk++) {
                    int64_t j0 = kbk * bk, nk = j0 + bk < lk ? bk : lk - j0;
                    if (causal && j0 > i1 - 1 + lk - lq) break;
                    const float *kh = heads + kbk * per_block, *vh = kh + d * bk16;
                    for (int64_t r0 = 0; r0 < nq; r0 += TG_F32_SLAB) {
                        int64_t rn = nq - r0 < TG_F32_SLAB ? nq - r0 : TG_F32_SLAB, ns = nk;
                        /* causal: the keys the slab's last row sees (none: the slab's rows keep
                         * what they had, every key of the block masked for them) */
                        if (causal && i0 + r0 + rn + lk - lq - j0 < ns) ns = i0 + r0 + rn + lk - lq - j0;
                        if (ns <= 0) continue;
                        tg_f32_gemm(rn, (ns + 15) / 16, d, q + off[0] + (i0 + r0) * qr, qr, kh, bk16, s, bk16, 0, mul);
                        for (int64_t i = 0; i < rn; i++)
                            tg_flash_row_log2(s + i * bk16, ns, i0, r0 + i, j0, lq, lk, causal, mask_kind, mask,
                                              off[3], mr, mc, mx + r0 + i, sum + r0 + i, acc + (r0 + i) * dv16, dv);
                        tg_f32_gemm(rn, dv16 / 16, ns, s, bk16, vh, dv16, acc + r0 * dv16, dv16, 1, 1.f);
                    }
                }
                for (int64_t i = 0; i < nq; i++)
                    tg_attention_row(o, off[4] + (i0 + i) * orow, acc + i * dv16, sum[i], dv, out_bf16);
            }
        free(area);
    }
#undef TG_PACK_KV
    free(packed);
    if (failed) TG_FAIL("attention: out of memory for its working blocks");
    __atomic_fetch_add(&tg_f32_attentions, 1, __ATOMIC_RELAXED);
    return 0;
}
#endif

int tg_attention(int nb, const int64_t *bd, const int64_t *qb, const int64_t *kb, const int64_t *vb,
                 const int64_t *mb, const int64_t *ob, const float *q, const float *k, const float *v,
                 const void *mask, float *o, int64_t lq, int64_t lk, int64_t d, int64_t dv, int64_t qr,
                 int64_t kr, int64_t vr, int64_t orow, int mask_kind, int64_t mr, int64_t mc, float scale,
                 int causal, int64_t bq, int64_t bk) {
    int64_t batches = 1;
    /* Block sizes come from the IR (a .mlir file, a cache entry): the emitter checks them, and
     * so does this, as the one place a zero (division), a negative or a huge block (the
     * working block's size overflows) would do harm. */
    if (bq < 1 || bk < 1 || bq > TG_MAX_BLOCK || bk > TG_MAX_BLOCK || lq < 0 || lk < 0 || d < 0 || dv < 0)
        TG_FAIL("attention: block sizes or lengths out of range");
    for (int i = 0; i < nb; i++) batches *= bd[i];
    int out_bf16 = tg_attention_bf16_out, in_bf16 = tg_attention_bf16_in;
#ifdef TG_HAVE_BF16_ATTENTION
    /* bf16: both products of a block on AMX or AVX-512 BF16, the softmax f32. Read here: the thread-local is
     * the caller's, not the workers'. */
    if (tg_run_bf16 && d > 0 && dv > 0 && lq > 0 && lk > 0 && batches > 0) {
        int amx = 0;
#ifdef TG_HAVE_AMX_ATTENTION
        amx = tg_amx_ready();
#endif
        if (amx || tg_avx512_bf16_ready())
            return tg_attention_bf16(nb, bd, qb, kb, vb, mb, ob, q, k, v, mask, o, lq, lk, d, dv, qr, kr, vr, orow,
                                     mask_kind, mr, mc, scale, causal, bq, bk, batches, out_bf16, in_bf16, amx);
    }
#endif
    /* (no rows or no keys: nothing of q, k or v is read) */
    if (in_bf16 && lq > 0 && lk > 0 && batches > 0)
        TG_FAIL("attention: bf16 operands without the bf16 products to read them");
#ifdef TG_HAVE_F32_ATTENTION
    if (d > 0 && dv > 0 && lq > 0 && lk > 0 && batches > 0)
        return tg_attention_f32(nb, bd, qb, kb, vb, mb, ob, q, k, v, mask, o, lq, lk, d, dv, qr, kr, vr, orow,
                                mask_kind, mr, mc, scale, causal, bq, bk, batches, out_bf16);
#endif
    int64_t qblocks = (lq + bq - 1) / bq;
    int failed = 0;
    /* sgemm inside a task runs on the task's thread (no nested team). With OpenMP's
     * spinning waits on a shared machine this ran 100x slower (runtime.py makes them
     * passive); letting OpenMP shrink teams (omp_set_dynamic) made sgemm skip rows. */
#pragma omp parallel for collapse(2) schedule(dynamic) if (batches * lq * lk * d > 65536)
    for (int64_t bi = 0; bi < batches; bi++)
        for (int64_t qbk = 0; qbk < qblocks; qbk++) {
            int64_t off[5];
            tg_batch_offsets(nb, bd, qb, kb, vb, mb, ob, bi, off);
            int64_t oq = off[0], ok = off[1], ov = off[2], oo = off[4];
            int64_t i0 = qbk * bq, i1 = i0 + bq < lq ? i0 + bq : lq, nq = i1 - i0;
            float *s = malloc(sizeof(float) * (bq * bk + bq * (dv + 2)));
            if (!s) { failed = 1; continue; }
            float *acc = s + bq * bk, *mx = acc + bq * dv, *sum = mx + bq;
            for (int64_t i = 0; i < nq; i++) {
                mx[i] = -INFINITY;
                sum[i] = 0.f;
                for (int64_t c = 0; c < dv; c++) acc[i * dv + c] = 0.f;
            }
            for (int64_t j0 = 0; j0 < lk; j0 += bk) {
                int64_t nk = j0 + bk < lk ? bk : lk - j0;
                if (causal && j0 > i1 - 1 + lk - lq) break;
                /* keys past the block's last query's position are masked in every row: not
                 * multiplied (the first of GPT-2's two query blocks of 128 sees 128 of 256 keys) */
                if (causal && j0 + nk > i1 + lk - lq) nk = i1 + lk - lq - j0;
                if (d == 0) {
                    for (int64_t i = 0; i < nq * bk; i++) s[i] = 0.f;
                } else if (dnnl_sgemm('N', 'T', nq, nk, d, scale, q + oq + i0 * qr, qr, k + ok + j0 * kr, kr, 0.f, s,
                                      bk) != dnnl_success) {
                    failed = 2;
                    break;
                }
                for (int64_t i = 0; i < nq; i++)
                    tg_flash_row(s + i * bk, nk, i0, i, j0, lq, lk, causal, mask_kind, mask, off[3], mr, mc, mx + i,
                                 sum + i, acc + i * dv, dv);
                if (dv && dnnl_sgemm('N', 'N', nq, dv, nk, 1.f, s, bk, v + ov + j0 * vr, vr, 1.f, acc, dv)
                              != dnnl_success) {
                    failed = 2;
                    break;
                }
            }
            for (int64_t i = 0; i < nq; i++)
                tg_attention_row(o, oo + (i0 + i) * orow, acc + i * dv, sum[i], dv, out_bf16);
            free(s);
        }
    if (failed == 2) TG_FAIL("attention: oneDNN's sgemm failed on a block");
    if (failed) TG_FAIL("attention: out of memory for its working blocks");
    return 0;
}
