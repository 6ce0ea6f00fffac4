/* tilegraph C backend: the SIMD dot products of block-format weights with q8 activations.
 *
 * Included twice by blockq.c, once per instruction set, with
 *   BQ_SUFFIX  the name suffix of every function here (_vnni, _avx2)
 *   BQ_DP(acc, u, s)  acc (8 x int32) += the sums of 4 adjacent products u8 x s8
 *              (AVX512-VNNI's vpdpbusd; AVX2's maddubs + madd: exact here, since a weight's
 *              unsigned part is at most 63 or, for q8_0, |w| <= 128 against |a| <= 127, so the
 *              int16 pair sums never saturate)
 * and the #pragma GCC target that lets the compiler use them: the runtime picks a variant at
 * run time (__builtin_cpu_supports), so no instruction here runs on a processor without it.
 *
 * Each kernel computes, for one weight row and R activation rows (R <= BQ_MAXR: a prompt's
 * rows share each unpacked weight block), y[r] = sum over blocks of the block's dot product.
 * The activation row is tg_q8row (blockq.c): int8 values and one float scale per 32, with the
 * block's sum (for a weight format with an offset: q4_0's -8, q4_1's min, q6_k's -32). */

#define BQ_CAT2(a, b) a##b
#define BQ_CAT(a, b) BQ_CAT2(a, b)
#define BQ_FN(name) BQ_CAT(name, BQ_SUFFIX)

/* Each kernel's body takes R as a parameter and is inlined into wrappers where R is a
 * constant (1: decode; BQ_MAXR: a prompt), so its accumulators live in registers. */
#define BQ_WRAP(fmt) \
    static void BQ_FN(bq_dot_##fmt)(const uint8_t *w, const tg_q8row *a, int R, int64_t nb, float *y) { \
        if (R == BQ_MAXR) BQ_FN(bq_body_##fmt)(w, a, BQ_MAXR, nb, y); \
        else for (int r = 0; r < R; r++) BQ_FN(bq_body_##fmt)(w, a + r, 1, nb, y + r); \
    }

static inline float BQ_FN(bq_hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 bytes of packed nibbles -> 32 bytes: the low nibbles (elements 0..15) then the high ones. */
static inline __m256i BQ_FN(bq_nibbles16)(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

static inline float BQ_FN(bq_f16)(const uint8_t *p) {
    uint16_t h; memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 32 bits -> 32 bytes, 0x10 where bit i is set (byte i): q5_0's fifth bits (ggml's bytes_from_bits_32). */
static inline __m256i BQ_FN(bq_fifth_bits)(const uint8_t *p) {
    uint32_t x;
    memcpy(&x, p, 4);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), spread);  /* byte i: the byte holding bit i */
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));  /* all bits but i % 8 set */
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

/* q4_0: 18 bytes per 32 (f16 d, 16 bytes of nibbles q); w = d (q - 8). q5_0 (fifth = 1): 22 bytes
 * per 32 (f16 d, 32 fifth bits, the nibbles); w = d (q - 16). `fifth` is a constant where inlined. */
static inline __attribute__((always_inline)) void BQ_FN(bq_body_q4_0_q5_0)(const uint8_t *w, const tg_q8row *a,
                                                                         const int R, int64_t nb, float *y,
                                                                         const int fifth) {
    __m256 acc[BQ_MAXR];
    float off[BQ_MAXR];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); off[r] = 0.f; }
    for (int64_t b = 0; b < nb; b++, w += fifth ? 22 : 18) {
        float d = BQ_FN(bq_f16)(w);
        __m256i u = BQ_FN(bq_nibbles16)(w + (fifth ? 6 : 2));
        if (fifth) u = _mm256_or_si256(u, BQ_FN(bq_fifth_bits)(w + 2));
        for (int r = 0; r < R; r++) {
            __m256i s = _mm256_loadu_si256((const __m256i *)(a[r].q + 32 * b));
            __m256i dp = _mm256_setzero_si256();
            BQ_DP(dp, u, s);
            float da = d * a[r].d[b];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), _mm256_set1_ps(da), acc[r]);
            off[r] += da * (float)a[r].s[b];
        }
    }
    for (int r = 0; r < R; r++) y[r] = BQ_FN(bq_hsum)(acc[r]) - (fifth ? 16.f : 8.f) * off[r];
}
static inline __attribute__((always_inline)) void BQ_FN(bq_body_q4_0)(const uint8_t *w, const tg_q8row *a, const int R,
                                                                    int64_t nb, float *y) {
    BQ_FN(bq_body_q4_0_q5_0)(w, a, R, nb, y, 0);
}
static inline __attribute__((always_inline)) void BQ_FN(bq_body_q5_0)(const uint8_t *w, const tg_q8row *a, const int R,
                                                                    int64_t nb, float *y) {
    BQ_FN(bq_body_q4_0_q5_0)(w, a, R, nb, y, 1);
}

/* q4_1: 20 bytes per 32 (f16 d, f16 m, nibbles q); w = d q + m. */
static inline __attribute__((always_inline)) void BQ_FN(bq_body_q4_1)(const uint8_t *w, const tg_q8row *a, const int R,
                                                                    int64_t nb, float *y) {
    __m256 acc[BQ_MAXR];
    float off[BQ_MAXR];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); off[r] = 0.f; }
    for (int64_t b = 0; b < nb; b++, w += 20) {
        float d = BQ_FN(bq_f16)(w), m = BQ_FN(bq_f16)(w + 2);
        __m256i u = BQ_FN(bq_nibbles16)(w + 4);
        for (int r = 0; r < R; r++) {
            __m256i s = _mm256_loadu_si256((const __m256i *)(a[r].q + 32 * b));
            __m256i dp = _mm256_setzero_si256();
            BQ_DP(dp, u, s);
            float db = a[r].d[b];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), _mm256_set1_ps(d * db), acc[r]);
            off[r] += m * db * (float)a[r].s[b];
        }
    }
    for (int r = 0; r < R; r++) y[r] = BQ_FN(bq_hsum)(acc[r]) + off[r];
}

/* q8_0: 34 bytes per 32 (f16 d, int8 q); w = d q. Signed x signed through |w| and sign(a, w). */
static inline __attribute__((always_inline)) void BQ_FN(bq_body_q8_0)(const uint8_t *w, const tg_q8row *a, const int R,
                                                                    int64_t nb, float *y) {
    __m256 acc[BQ_MAXR];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 34) {
        float d = BQ_FN(bq_f16)(w);
        __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2));
        __m256i u = _mm256_sign_epi8(q, q);
        for (int r = 0; r < R; r++) {
            __m256i s = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(a[r].q + 32 * b)), q);
            __m256i dp = _mm256_setzero_si256();
            BQ_DP(dp, u, s);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), _mm256_set1_ps(d * a[r].d[b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = BQ_FN(bq_hsum)(acc[r]);
}

/* q4_k: 144 bytes per 256 (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
 * nibbles); sub-block j of 32: w = d sc_j q - dmin m_j, its nibbles the low (j even) or high
 * (j odd) halves of bytes 32 (j / 2) .. 32 (j / 2) + 31. */
static inline __attribute__((always_inline)) void BQ_FN(bq_body_q4_k)(const uint8_t *w, const tg_q8row *a, const int R,
                                                                    int64_t nb, float *y) {
    __m256 acc[BQ_MAXR];
    float off[BQ_MAXR];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); off[r] = 0.f; }
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++, w += 144) {
        float d = BQ_FN(bq_f16)(w), dmin = BQ_FN(bq_f16)(w + 2);
        uint8_t sc[8], mn[8];
        tg_q4k_scales(w + 4, sc, mn);
        for (int c = 0; c < 4; c++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * c));
            __m256i lo = _mm256_and_si256(q, mask), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
            int64_t j0 = 8 * b + 2 * c;
            for (int r = 0; r < R; r++) {
                __m256i s0 = _mm256_loadu_si256((const __m256i *)(a[r].q + 32 * j0));
                __m256i s1 = _mm256_loadu_si256((const __m256i *)(a[r].q + 32 * j0 + 32));
                __m256i dp0 = _mm256_setzero_si256(), dp1 = _mm256_setzero_si256();
                BQ_DP(dp0, lo, s0);
                BQ_DP(dp1, hi, s1);
                float d0 = a[r].d[j0], d1 = a[r].d[j0 + 1];
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp0), _mm256_set1_ps(d * sc[2 * c] * d0), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp1), _mm256_set1_ps(d * sc[2 * c + 1] * d1), acc[r]);
                off[r] += dmin * (mn[2 * c] * d0 * (float)a[r].s[j0] + mn[2 * c + 1] * d1 * (float)a[r].s[j0 + 1]);
            }
        }
    }
    for (int r = 0; r < R; r++) y[r] = BQ_FN(bq_hsum)(acc[r]) - off[r];
}

/* q6_k: 210 bytes per 256 (128 bytes of low nibbles ql, 64 of high 2-bit pairs qh, 16 int8
 * scales, f16 d); w = d sc_g (q - 32), one scale per 16. Per half of 128: element l, l+32,
 * l+64, l+96 (l < 32) take ql[l] low, ql[l+32] low, ql[l] high, ql[l+32] high and bits 0-1,
 * 2-3, 4-5, 6-7 of qh[l]. In a vpdpbusd result, lanes 0-3 sum elements 0..15 of a sub-block
 * and lanes 4-7 elements 16..31: the two scales of the sub-block, lane-wise. */
static inline __attribute__((always_inline)) void BQ_FN(bq_body_q6_k)(const uint8_t *w, const tg_q8row *a, const int R,
                                                                    int64_t nb, float *y) {
    __m256 acc[BQ_MAXR];
    float off[BQ_MAXR];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); off[r] = 0.f; }
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    for (int64_t b = 0; b < nb; b++, w += 210) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *scales = (const int8_t *)(w + 192);
        float d = BQ_FN(bq_f16)(w + 208);
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4));
            for (int k = 0; k < 4; k++) {
                const int8_t *sc = scales + 8 * h + 2 * k;
                __m256 scv = _mm256_setr_m128(_mm_set1_ps((float)sc[0]), _mm_set1_ps((float)sc[1]));
                int64_t j = 8 * b + 4 * h + k;
                for (int r = 0; r < R; r++) {
                    __m256i s = _mm256_loadu_si256((const __m256i *)(a[r].q + 32 * j));
                    __m256i dp = _mm256_setzero_si256();
                    BQ_DP(dp, q[k], s);
                    float dd = d * a[r].d[j];
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dp), scv), _mm256_set1_ps(dd), acc[r]);
                    off[r] += dd * ((float)sc[0] * a[r].s16[2 * j] + (float)sc[1] * a[r].s16[2 * j + 1]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) y[r] = BQ_FN(bq_hsum)(acc[r]) - 32.f * off[r];
}

/* Rows of float activations to q8 (tg_q8row): per 32, d = max|x| / 127 and q = round(x / d). */
static void BQ_FN(bq_quantize)(const float *x, int64_t k, tg_q8row *a) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + 32 * b;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        float amax = _mm_cvtss_f32(m), d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        __m256 inv = _mm256_set1_ps(id);
        __m256i i32[4];
        for (int i = 0; i < 4; i++) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  /* nearest, even */
        __m256i s01 = _mm256_packs_epi32(i32[0], i32[1]), s23 = _mm256_packs_epi32(i32[2], i32[3]);
        __m256i q8 = _mm256_packs_epi16(s01, s23);
        /* the packs interleave 128-bit lanes: put the 32 values back in order */
        q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(a->q + 32 * b), q8);
        a->d[b] = d;
        /* sums per 16: madd of the int16 pairs with ones, then the two halves */
        __m256i w16a = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q8));
        __m256i w16b = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q8, 1));
        __m256i ones = _mm256_set1_epi16(1);
        __m256i p0 = _mm256_madd_epi16(w16a, ones), p1 = _mm256_madd_epi16(w16b, ones);
        int32_t t0[8], t1[8];
        _mm256_storeu_si256((__m256i *)t0, p0);
        _mm256_storeu_si256((__m256i *)t1, p1);
        int32_t h0 = t0[0] + t0[1] + t0[2] + t0[3] + t0[4] + t0[5] + t0[6] + t0[7];
        int32_t h1 = t1[0] + t1[1] + t1[2] + t1[3] + t1[4] + t1[5] + t1[6] + t1[7];
        a->s16[2 * b] = (int16_t)h0;
        a->s16[2 * b + 1] = (int16_t)h1;
        a->s[b] = h0 + h1;
        a->ds[2 * b] = d;
        a->ds[2 * b + 1] = d * (float)(h0 + h1);
    }
}

BQ_WRAP(q4_0)
BQ_WRAP(q4_1)
BQ_WRAP(q8_0)
BQ_WRAP(q4_k)
BQ_WRAP(q6_k)
BQ_WRAP(q5_0)
static const tg_bq_kernels BQ_FN(bq_kernels) = {
    .quantize = BQ_FN(bq_quantize),
    .dot = {[TG_BQ_Q4_0] = BQ_FN(bq_dot_q4_0), [TG_BQ_Q4_1] = BQ_FN(bq_dot_q4_1), [TG_BQ_Q8_0] = BQ_FN(bq_dot_q8_0),
            [TG_BQ_Q4_K] = BQ_FN(bq_dot_q4_k), [TG_BQ_Q6_K] = BQ_FN(bq_dot_q6_k), [TG_BQ_Q5_0] = BQ_FN(bq_dot_q5_0)},
};

#undef BQ_FN
#undef BQ_WRAP
#undef BQ_CAT
#undef BQ_CAT2
