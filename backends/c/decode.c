/* tilegraph C backend: the decode step's kernels beside the block-format matmuls: the KV cache
 * written in place (f32, or rounded into f16), causal attention over it, and sampling a token
 * from logits. Included at the end of blockq.c (its scratch, half conversions and ISA choice). */

int tg_cache_write(void *cache, const void *x, int64_t B, int64_t Hkv, int64_t S, int64_t T, int64_t D,
                   int64_t elem, const int64_t *pos, int64_t pstride) {
    for (int64_t b = 0; b < B; b++) {
        int64_t p = pos[b * pstride];
        if (p < 0 || T < 0 || p > S - T)
            TG_FAIL("cache write: %lld new rows at position %lld do not fit a cache of %lld", (long long)T,
                    (long long)p, (long long)S);
    }
    size_t row = (size_t)(D * elem);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++)
            memcpy((char *)cache + (size_t)((b * Hkv + h) * S + pos[b * pstride]) * row,
                   (const char *)x + (size_t)((b * Hkv + h) * T) * row, row * (size_t)T);
    return 0;
}

/* f32 -> f16, rounded to nearest even as IEEE (and NumPy's astype, the interpreter's): overflow
 * to inf, subnormals rounded, NaN kept a NaN (F. Giesen's float_to_half_fast3_rtne). */
static inline uint16_t bq_to_half(float f) {
    uint32_t u, sign;
    memcpy(&u, &f, 4);
    sign = (u >> 16) & 0x8000u;
    u &= 0x7FFFFFFFu;
    if (u >= 0x47800000u) return (uint16_t)(sign | (u > 0x7F800000u ? 0x7E00u : 0x7C00u));  /* >= 65536, inf, NaN */
    if (u < 0x38800000u) {  /* below 2^-14: a subnormal half (or zero); adding 0.5 rounds at 2^-24 */
        float v, magic = 0.5f;
        memcpy(&v, &u, 4);
        v += magic;
        uint32_t r, m;
        memcpy(&r, &v, 4);
        memcpy(&m, &magic, 4);
        return (uint16_t)(sign | (r - m));
    }
    uint32_t odd = (u >> 13) & 1u;
    u += 0xC8000FFFu + odd;  /* rebias the exponent (-112 << 23) and round the 13 dropped bits to even */
    return (uint16_t)(sign | (u >> 13));
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
static void bq_to_half_f16c(const float *x, uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) y[i] = bq_to_half(x[i]);
}
static void bq_from_half_f16c(const uint16_t *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    for (; i < n; i++) y[i] = bq_half(x[i]);
}
#pragma GCC pop_options

/* n f32 values rounded into f16, and back: F16C where the processor has it (bq_level >= 1) */
static void bq_to_half_n(const float *x, uint16_t *y, int64_t n) {
    if (bq_kernels() != &bq_kernels_scalar) bq_to_half_f16c(x, y, n);
    else for (int64_t i = 0; i < n; i++) y[i] = bq_to_half(x[i]);
}
static void bq_from_half_n(const uint16_t *x, float *y, int64_t n) {
    if (bq_kernels() != &bq_kernels_scalar) bq_from_half_f16c(x, y, n);
    else for (int64_t i = 0; i < n; i++) y[i] = bq_half(x[i]);
}

int tg_cache_write_f16(uint16_t *cache, const float *x, int64_t B, int64_t Hkv, int64_t S, int64_t T, int64_t D,
                       const int64_t *pos, int64_t pstride) {
    for (int64_t b = 0; b < B; b++) {
        int64_t p = pos[b * pstride];
        if (p < 0 || T < 0 || p > S - T)
            TG_FAIL("cache write: %lld new rows at position %lld do not fit a cache of %lld", (long long)T,
                    (long long)p, (long long)S);
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++)
            bq_to_half_n(x + (b * Hkv + h) * T * D, cache + ((b * Hkv + h) * S + pos[b * pstride]) * D, T * D);
    return 0;
}

/* Decode attention: a work unit is (batch, KV head, a block of queries, a span of keys); the
 * H / Hkv heads sharing a KV head and the block's queries all meet each key row while it is
 * in L1, so the cache is read once per step. Keys go 64 at a time: scores, then the online
 * softmax update (exp vectorised over the 64), then p v. With few units (one sequence, a
 * few KV heads) the keys split into spans, combined after by their maxima and sums (as
 * flash-decoding does), so every thread has keys to read. An f16 cache (half the bytes a
 * step reads at depth) is read in place on AVX-512 (D of 64 or 128): each K and V vector widened
 * in a register as the dot product or p v loads it, once per four query rows; elsewhere each
 * block of 64 rows is widened into a thread's scratch first, read by every query. */
#define CA_KEYS 64
#define CA_QMAX 64  /* query rows per unit */
#define CA_DMAX 256 /* head size of a widened block (64 rows) */

/* The online softmax update of one query row by a block's scores s[0..live) whose largest,
 * with the row's running maximum, is m: s becomes exp(s - m); returns the factor that rescales
 * what the row had summed so far. */
static inline __attribute__((always_inline)) float ca_online(float *s, int64_t live, float m, float *mx, float *sum) {
    float corr = tg_expf(*mx - m), l = 0.f;
#pragma omp simd reduction(+ : l)
    for (int64_t jj = 0; jj < live; jj++) {
        float e = tg_expf(s[jj] - m);
        s[jj] = e;
        l += e;
    }
    *sum = *sum * corr + l;
    *mx = m;
    return corr;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")
/* the sums of 16 registers, as one: three levels of in-lane shuffles and adds (45 instructions
 * for 16 dot products, where 16 horizontal sums take ~130) */
static inline __m512 ca_hsum16(const __m512 *v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}
/* s[j] = scale q . k_j for the n (<= CA_KEYS) rows of kblk, 16 keys at a time; D % 16 == 0.
 * Returns the largest (a vector max, not a scalar chain of compares) */
static inline __attribute__((always_inline)) float ca_scores_zmm_d(const int64_t D, const float *qv, const float *kblk,
                                                                   int64_t n, float scale, float *s) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        int64_t m = n - j0 < 16 ? n - j0 : 16;
        __m512 a[16];
        for (int jj = 0; jj < 16; jj++) {
            a[jj] = _mm512_setzero_ps();
            if (jj < m)
                for (int64_t c = 0; c < D; c += 16)
                    a[jj] = _mm512_fmadd_ps(_mm512_loadu_ps(qv + c), _mm512_loadu_ps(kblk + (j0 + jj) * D + c), a[jj]);
        }
        __mmask16 live = (__mmask16)((1u << m) - 1);
        __m512 r = _mm512_mul_ps(ca_hsum16(a), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(s + j0, live, r);
        top = _mm512_mask_max_ps(top, live, top, r);
    }
    return _mm512_reduce_max_ps(top);
}
/* s[r * CA_KEYS + j] = scale q_r . k_j for NR (<= 4) query rows and the n keys of an f16 block
 * kh, read in place: each K vector widened once in a register (vcvtph2ps) for all NR rows.
 * KP = 16 / NR keys at a time, their NR x KP dot products summed by one ca_hsum16 (lane
 * r * KP + k), each row's KP lanes then moved down by one permute and stored. A last step of
 * fewer keys reads its last key again in the missing places, and stores only its own. */
static inline __attribute__((always_inline)) void ca_scores_zmm_h(const int64_t D, const int NR, const float *const *q,
                                                                  const uint16_t *kh, int64_t n, float scale,
                                                                  float *s) {
    const int KP = 16 / NR;
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t j0 = 0; j0 < n; j0 += KP) {
        int64_t m = n - j0 < KP ? n - j0 : KP;
        const uint16_t *kr[16];
        for (int k = 0; k < KP; k++) kr[k] = kh + (j0 + (k < m ? k : m - 1)) * D;
        __m512 a[16];
        for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 16) {
            __m512 qv[4];
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) qv[r] = _mm512_loadu_ps(q[r] + c);
#pragma GCC unroll 16
            for (int k = 0; k < KP; k++) {
                __m512 kv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(kr[k] + c)));
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) a[r * KP + k] = _mm512_fmadd_ps(qv[r], kv, a[r * KP + k]);
            }
        }
        __m512 sums = _mm512_mul_ps(ca_hsum16(a), _mm512_set1_ps(scale));
        __mmask16 live = (__mmask16)((1u << m) - 1);
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            _mm512_mask_storeu_ps(s + r * CA_KEYS + j0, live,
                                  _mm512_permutexvar_ps(_mm512_add_epi32(iota, _mm512_set1_epi32(r * KP)), sums));
    }
}
/* the largest of s[from..live) (a vector max) */
static inline __attribute__((always_inline)) float ca_max_zmm(const float *s, int64_t from, int64_t live) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = from; j < live; j += 16) {
        int64_t m = live - j < 16 ? live - j : 16;
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, (__mmask16)((1u << m) - 1), s + j));
    }
    return _mm512_reduce_max_ps(top);
}
/* acc[r] = acc[r] * corr[r] + sum_j p[r][j] v_j for NR rows at once (each V row loaded once for
 * all of them; NR * D / 16 accumulators in registers, independent chains for the FMA pipes).
 * V rows from vblk, or widened from f16 as they are loaded where vh is non-NULL. */
static inline __attribute__((always_inline)) void ca_pv_zmm(const int64_t D, const int NR, const float *vblk,
                                                            const uint16_t *vh, int64_t n, const float *p,
                                                            const float *corr, float *acc) {
    __m512 a[4][8];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int64_t c = 0; c < D / 16; c++) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * c),
                                                                     _mm512_set1_ps(corr[r]));
    for (int64_t j = 0; j < n; j++) {
#pragma GCC unroll 8
        for (int64_t c = 0; c < D / 16; c++) {
            __m512 vv = vh ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(vh + j * D + 16 * c)))
                           : _mm512_loadu_ps(vblk + j * D + 16 * c);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * CA_KEYS + j]), vv, a[r][c]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int64_t c = 0; c < D / 16; c++) _mm512_storeu_ps(acc + r * D + 16 * c, a[r][c]);
}
/* The rows of a later block of keys asked for now: a thread reads its span's K and V rows once,
 * in order, and does a block's arithmetic between reads, so the hardware's stream prefetch alone
 * keeps too few lines in flight (an f16 block's widening, scores and p v left the core waiting on
 * each next block's lines). One prefetch per 64-byte line of the block CA_AHEAD keys ahead. */
#define CA_AHEAD (2 * CA_KEYS)
static inline __attribute__((always_inline)) void ca_prefetch(const float *kb, const float *vb, const uint16_t *kh,
                                                              const uint16_t *vh, int64_t D, int64_t j, int64_t j_hi) {
    if (j >= j_hi) return;
    int64_t n = j_hi - j < CA_KEYS ? j_hi - j : CA_KEYS;
    const char *k = kh ? (const char *)(kh + j * D) : (const char *)(kb + j * D);
    const char *v = kh ? (const char *)(vh + j * D) : (const char *)(vb + j * D);
    int64_t bytes = n * D * (kh ? 2 : 4);
    for (int64_t i = 0; i < bytes; i += 64) {
        _mm_prefetch(k + i, _MM_HINT_T0);
        _mm_prefetch(v + i, _MM_HINT_T0);
    }
}
/* ca_span on AVX-512 for D = 64 or 128: per block of keys, four query rows at a time: their
 * scores (f32: a row's 16 keys per ca_hsum16; f16: ca_scores_zmm_h, all four rows' at once), the
 * online softmax update, then p v. An f16 block is read in place, never copied. */
static inline __attribute__((always_inline)) void ca_span_zmm(const int64_t D, int64_t nq, int64_t j_lo, int64_t j_hi,
                                                              const float *const *qr, const int64_t *first,
                                                              const int64_t *lim, const float *kb, const float *vb, const uint16_t *kh,
                                                              const uint16_t *vh, float scale,
                                                              float *acc, float *mx, float *sum) {
    float p[4 * CA_KEYS] __attribute__((aligned(64))), corr[4];
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += CA_KEYS) {
        int64_t nk = j_hi - j0 < CA_KEYS ? j_hi - j0 : CA_KEYS;
        const float *kblk = kh ? NULL : kb + j0 * D, *vblk = kh ? NULL : vb + j0 * D;
        const uint16_t *khb = kh ? kh + j0 * D : NULL, *vhb = kh ? vh + j0 * D : NULL;
        ca_prefetch(kb, vb, kh, vh, D, j0 + CA_AHEAD, j_hi);
        for (int64_t r0 = 0; r0 < nq; r0 += 4) {
            int nr = nq - r0 < 4 ? (int)(nq - r0) : 4;
            int64_t most = 0;  /* keys any of these rows sees in this block */
            if (kh) {  /* the keys any row sees, [lo, hi): every row's scores there at once */
                int64_t lo = nk, hi = 0;
                for (int i = 0; i < nr; i++) {
                    int64_t live = lim[r0 + i] - j0 < nk ? lim[r0 + i] - j0 : nk;
                    int64_t from = first[r0 + i] - j0 > 0 ? first[r0 + i] - j0 : 0;
                    if (live > from) lo = from < lo ? from : lo, hi = live > hi ? live : hi;
                }
                switch (hi > lo ? nr : 0) {
                case 0: break;
                case 1: ca_scores_zmm_h(D, 1, qr + r0, khb + lo * D, hi - lo, scale, p + lo); break;
                case 2: ca_scores_zmm_h(D, 2, qr + r0, khb + lo * D, hi - lo, scale, p + lo); break;
                case 3: ca_scores_zmm_h(D, 3, qr + r0, khb + lo * D, hi - lo, scale, p + lo); break;
                default: ca_scores_zmm_h(D, 4, qr + r0, khb + lo * D, hi - lo, scale, p + lo); break;
                }
            }
            for (int i = 0; i < nr; i++) {
                int64_t r = r0 + i, live = lim[r] - j0 < nk ? lim[r] - j0 : nk;
                int64_t from = first[r] - j0 > 0 ? first[r] - j0 : 0;  /* a sliding window's start */
                float *s = p + i * CA_KEYS;
                if (live <= from) {  /* nothing to see here: p = 0, the row unchanged */
                    corr[i] = 1.f;
                    for (int64_t jj = 0; jj < nk; jj++) s[jj] = 0.f;
                    continue;
                }
                most = live > most ? live : most;
                float m = kh ? ca_max_zmm(s, from, live) : ca_scores_zmm_d(D, qr[r], kblk + from * D, live - from, scale, s + from);
                m = mx[r] > m ? mx[r] : m;
                for (int64_t jj = 0; jj < from; jj++) s[jj] = -INFINITY;  /* before the window: weight 0 */
                corr[i] = ca_online(s, live, m, mx + r, sum + r);
                for (int64_t jj = live; jj < nk; jj++) s[jj] = 0.f;
            }
            float *ar = acc + r0 * D;
            switch (nr) {
            case 1: ca_pv_zmm(D, 1, vblk, vhb, most, p, corr, ar); break;
            case 2: ca_pv_zmm(D, 2, vblk, vhb, most, p, corr, ar); break;
            case 3: ca_pv_zmm(D, 3, vblk, vhb, most, p, corr, ar); break;
            default: ca_pv_zmm(D, 4, vblk, vhb, most, p, corr, ar); break;
            }
        }
    }
}
static void ca_span_zmm64(int64_t nq, int64_t j_lo, int64_t j_hi, const float *const *qr, const int64_t *first,
                          const int64_t *lim, const float *kb, const float *vb, const uint16_t *kh, const uint16_t *vh,
                          float scale, float *acc, float *mx, float *sum) {
    ca_span_zmm(64, nq, j_lo, j_hi, qr, first, lim, kb, vb, kh, vh, scale, acc, mx, sum);
}
static void ca_span_zmm128(int64_t nq, int64_t j_lo, int64_t j_hi, const float *const *qr, const int64_t *first,
                           const int64_t *lim, const float *kb, const float *vb, const uint16_t *kh, const uint16_t *vh,
                           float scale, float *acc, float *mx, float *sum) {
    ca_span_zmm(128, nq, j_lo, j_hi, qr, first, lim, kb, vb, kh, vh, scale, acc, mx, sum);
}
#pragma GCC pop_options

static void ca_scores(int64_t D, const float *qv, const float *kblk, int64_t n, float scale, float *s) {
    for (int64_t jj = 0; jj < n; jj++) {
        const float *kr = kblk + jj * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < D; c++) dot += qv[c] * kr[c];
        s[jj] = dot * scale;
    }
}

/* One unit's span of keys [j_lo, j_hi), CA_KEYS at a time: scores, the online softmax update,
 * then p v. Query-major loops over a block whose K and V rows (64 x D floats each) stay in L1:
 * with D a constant (the callers' 64 and 128) a query's accumulator lives in registers across
 * the block's keys. kf/vf: room for a block widened from f16 (kh/vh non-NULL), else unused. */
static inline __attribute__((always_inline)) void ca_span(const int64_t D, int64_t nq, int64_t j_lo, int64_t j_hi,
                                                          const float *const *qr, const int64_t *first,
                                                          const int64_t *lim, const float *kb,
                                                          const float *vb, const uint16_t *kh, const uint16_t *vh,
                                                          float *kf, float *vf, float scale, float *acc,
                                                          float *mx, float *sum) {
    float s[CA_KEYS];
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += CA_KEYS) {
        int64_t nk = j_hi - j0 < CA_KEYS ? j_hi - j0 : CA_KEYS;
        const float *kblk = kb + j0 * D, *vblk = vb + j0 * D;
        if (kh) {
            bq_from_half_n(kh + j0 * D, kf, nk * D);
            bq_from_half_n(vh + j0 * D, vf, nk * D);
            kblk = kf;
            vblk = vf;
        }
        for (int64_t r = 0; r < nq; r++) {
            const float *qv = qr[r];
            int64_t live = lim[r] - j0 < nk ? lim[r] - j0 : nk;  /* keys at or before this query */
            int64_t from = first[r] - j0 > 0 ? first[r] - j0 : 0;  /* and inside its window */
            if (live <= from) continue;
            ca_scores(D, qv, kblk + from * D, live - from, scale, s + from);
            float m = mx[r];
            for (int64_t jj = from; jj < live; jj++) m = s[jj] > m ? s[jj] : m;
            for (int64_t jj = 0; jj < from; jj++) s[jj] = -INFINITY;  /* before the window: weight 0 */
            float corr = ca_online(s, live, m, mx + r, sum + r);
            float *ar = acc + r * D;
            float a[D];
#pragma omp simd
            for (int64_t c = 0; c < D; c++) a[c] = ar[c] * corr;
            for (int64_t jj = 0; jj < live; jj++) {
                const float *vr = vblk + jj * D;
                float p = s[jj];
#pragma omp simd
                for (int64_t c = 0; c < D; c++) a[c] += p * vr[c];
            }
#pragma omp simd
            for (int64_t c = 0; c < D; c++) ar[c] = a[c];
        }
    }
}

/* The path a call takes (one place decides; tg_cache_attention_kernel reports it, so the tests see
 * the fast path taken): a prompt's GEMMs; AVX-512 units reading the cache in place (D of 64 or
 * 128, f32 or f16); the portable units (an f16 cache widened a block at a time into scratch). */
static int ca_pick(int64_t T, int64_t D, int64_t window, int64_t L) {
    if (T > 16 && (window <= 0 || window >= L)) return TG_CA_KERNEL_PROMPT;  /* (a window that cuts keys: units) */
    return bq_kernels() == &bq_kernels_vnni && (D == 64 || D == 128) ? TG_CA_KERNEL_ZMM : TG_CA_KERNEL_UNITS;
}

int tg_cache_attention_kernel(int64_t T, int64_t D, int64_t window, int64_t L) { return ca_pick(T, D, window, L); }

/* k/v are float (kv_f16 0) or f16 bits (kv_f16 1) */
static int ca_run(const float *q, const void *k, const void *v, float *o, int64_t B, int64_t H, int64_t Hkv,
                  int64_t T, int64_t S, int64_t D, const int64_t *pos, int64_t pstride, float scale, int64_t window,
                  int kv_f16) {
    if (Hkv <= 0 || H % Hkv) TG_FAIL("cache attention: %lld heads do not share %lld KV heads evenly", (long long)H,
                                      (long long)Hkv);
    int64_t pmax = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t p = pos[b * pstride];
        if (p < 0 || T < 0 || p > S - T)
            TG_FAIL("cache attention: %lld queries at position %lld reach past a cache of %lld", (long long)T,
                    (long long)p, (long long)S);
        pmax = p > pmax ? p : pmax;
    }
    if (T == 0 || B == 0 || H == 0) return 0;
    int64_t G = H / Hkv;
    if (G > CA_QMAX) TG_FAIL("cache attention: %lld heads per KV head (at most %d)", (long long)G, CA_QMAX);
    if (kv_f16 && D > CA_DMAX) TG_FAIL("cache attention: an f16 cache of head size %lld (at most %d)", (long long)D,
                                       CA_DMAX);
    int kernel = ca_pick(T, D, window, pmax + T);
    if (kernel == TG_CA_KERNEL_PROMPT) {
        /* a prompt: many query blocks, each a few small GEMMs (tg_attention, on oneDNN's sgemm);
         * the G heads of a KV head are a batch dim of stride 0 in K and V; an f16 cache's rows
         * so far are widened first (a prompt is bound by its arithmetic, not this pass) */
        for (int64_t b = 0; b < B; b++) {  /* one call per sequence: each its own position */
            int64_t L = pos[b * pstride] + T, ld = S;
            const float *kb = (const float *)k + b * Hkv * S * D, *vb = (const float *)v + b * Hkv * S * D;
            if (kv_f16) {
                float *w = bq_scratch_get((size_t)(2 * Hkv * L * D) * sizeof(float));
                if (!w) TG_FAIL("cache attention: out of memory widening an f16 cache");
                for (int64_t h = 0; h < Hkv; h++) {
                    bq_from_half_n((const uint16_t *)k + (b * Hkv + h) * S * D, w + h * L * D, L * D);
                    bq_from_half_n((const uint16_t *)v + (b * Hkv + h) * S * D, w + (Hkv + h) * L * D, L * D);
                }
                kb = w, vb = w + Hkv * L * D, ld = L;
            }
            int64_t bd[2] = {Hkv, G}, qb[2] = {G * T * D, T * D}, kbs[2] = {ld * D, 0}, mb[2] = {0, 0};
            if (tg_attention(2, bd, qb, kbs, kbs, mb, qb, q + b * H * T * D, kb, vb, NULL, o + b * H * T * D, T, L,
                             D, D, D, D, D, D, 0, 0, 0, scale, 1, 64, 256))
                return 1;
        }
        return 0;
    }
    int64_t tq = CA_QMAX / G < T ? CA_QMAX / G : T;  /* queries per unit */
    int64_t qblocks = (T + tq - 1) / tq, items = B * Hkv * qblocks, L = pmax + T;
    if (window > 0 && window + tq - 1 < L) L = window + tq - 1;  /* the most keys one unit reads */
    int threads = omp_get_max_threads();
    int64_t spans = (2 * threads + items - 1) / items, most = (L + 255) / 256;
    spans = spans < 1 ? 1 : spans > most ? (most < 1 ? 1 : most) : spans;
    int64_t span = (L + spans - 1) / spans;
    span = (span + CA_KEYS - 1) / CA_KEYS * CA_KEYS;
    int64_t QB = G * tq, unit = QB * (D + 2);
    float *part = bq_scratch_get((size_t)(items * spans * unit) * sizeof(float));
    if (!part) TG_FAIL("cache attention: out of memory for its partial sums");
    int zmm = kernel == TG_CA_KERNEL_ZMM, widen = kv_f16 && !zmm;
    int failed = 0;
    int parallel = B * H * T * L * D > 32768;  /* below, a fork costs more than the work */
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
    for (int64_t it = 0; it < items; it++)
        for (int64_t sp = 0; sp < spans; sp++) {
            static __thread float *kv_wide;  /* a thread's block widened from f16: allocated once, kept */
            if (widen && !kv_wide && posix_memalign((void **)&kv_wide, 64, 2 * CA_KEYS * CA_DMAX * sizeof(float)))
                kv_wide = NULL;
            if (widen && !kv_wide) { failed = 1; continue; }
            int64_t b = it / (Hkv * qblocks), kh = it / qblocks % Hkv, t0 = it % qblocks * tq;
            int64_t nt = T - t0 < tq ? T - t0 : tq, nq = G * nt, pb = pos[b * pstride];
            float *acc = part + (it * spans + sp) * unit, *mx = acc + QB * D, *sum = mx + QB;
            int64_t at = (b * Hkv + kh) * S * D;
            const float *kb = kv_f16 ? NULL : (const float *)k + at, *vb = kv_f16 ? NULL : (const float *)v + at;
            const uint16_t *khf = kv_f16 ? (const uint16_t *)k + at : NULL, *vhf = kv_f16 ? (const uint16_t *)v + at : NULL;
            float *kf = kv_wide, *vf = widen ? kv_wide + CA_KEYS * CA_DMAX : NULL;
            const float *qr[CA_QMAX];
            int64_t first[CA_QMAX], lim[CA_QMAX];
            for (int64_t r = 0; r < nq; r++) {
                int64_t g = r / nt, t = t0 + r % nt;
                qr[r] = q + ((b * H + kh * G + g) * T + t) * D;
                lim[r] = pb + t + 1;
                first[r] = window > 0 && lim[r] > window ? lim[r] - window : 0;
                mx[r] = -INFINITY;
                sum[r] = 0.f;
                for (int64_t c = 0; c < D; c++) acc[r * D + c] = 0.f;
            }
            /* the unit's keys: from its first query's window start (0 without a window) */
            int64_t u_lo = window > 0 && pb + t0 + 1 > window ? pb + t0 + 1 - window : 0;
            int64_t j_lo = u_lo + sp * span, j_hi = j_lo + span < pb + t0 + nt ? j_lo + span : pb + t0 + nt;
            if (zmm && D == 64) ca_span_zmm64(nq, j_lo, j_hi, qr, first, lim, kb, vb, khf, vhf, scale, acc, mx, sum);
            else if (zmm) ca_span_zmm128(nq, j_lo, j_hi, qr, first, lim, kb, vb, khf, vhf, scale, acc, mx, sum);
            else if (D == 64) ca_span(64, nq, j_lo, j_hi, qr, first, lim, kb, vb, khf, vhf, kf, vf, scale, acc, mx, sum);
            else if (D == 128) ca_span(128, nq, j_lo, j_hi, qr, first, lim, kb, vb, khf, vhf, kf, vf, scale, acc, mx, sum);
            else if (D == 256) ca_span(256, nq, j_lo, j_hi, qr, first, lim, kb, vb, khf, vhf, kf, vf, scale, acc, mx, sum);
            else ca_span(D, nq, j_lo, j_hi, qr, first, lim, kb, vb, khf, vhf, kf, vf, scale, acc, mx, sum);
        }
    if (failed) TG_FAIL("cache attention: out of memory widening an f16 cache");
    /* combine the spans of each unit's queries */
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t it = 0; it < items; it++) {
        int64_t b = it / (Hkv * qblocks), kh = it / qblocks % Hkv, t0 = it % qblocks * tq;
        int64_t nt = T - t0 < tq ? T - t0 : tq, nq = G * nt;
        for (int64_t r = 0; r < nq; r++) {
            int64_t g = r / nt, t = t0 + r % nt;
            float m = -INFINITY;
            for (int64_t sp = 0; sp < spans; sp++) {
                float ms = part[(it * spans + sp) * unit + QB * D + r];
                m = ms > m ? ms : m;
            }
            float *out = o + ((b * H + kh * G + g) * T + t) * D, total = 0.f;
            for (int64_t c = 0; c < D; c++) out[c] = 0.f;
            for (int64_t sp = 0; sp < spans; sp++) {
                const float *acc = part + (it * spans + sp) * unit;
                float ms = acc[QB * D + r];
                if (ms == -INFINITY) continue;
                float wgt = tg_expf(ms - m);
                total += wgt * acc[QB * D + QB + r];
#pragma omp simd
                for (int64_t c = 0; c < D; c++) out[c] += wgt * acc[r * D + c];
            }
            float inv = 1.f / total;
            for (int64_t c = 0; c < D; c++) out[c] *= inv;
        }
    }
    return 0;
}

int tg_cache_attention(const float *q, const float *k, const float *v, float *o, int64_t B, int64_t H,
                       int64_t Hkv, int64_t T, int64_t S, int64_t D, const int64_t *pos, int64_t pstride,
                       float scale, int64_t window) {
    return ca_run(q, k, v, o, B, H, Hkv, T, S, D, pos, pstride, scale, window, 0);
}

int tg_cache_attention_f16(const float *q, const uint16_t *k, const uint16_t *v, float *o, int64_t B, int64_t H,
                           int64_t Hkv, int64_t T, int64_t S, int64_t D, const int64_t *pos, int64_t pstride,
                           float scale, int64_t window) {
    return ca_run(q, k, v, o, B, H, Hkv, T, S, D, pos, pstride, scale, window, 1);
}

/* Sampling (tg.sample; ir/kernels.py's sample is the reference): one token per row of logits,
 * inside the compiled step, so a decode step returns token ids and Python runs no op per token. */

/* the k-th largest of x[0..n) (k >= 1), x reordered (quickselect, Hoare's partition) */
static float sm_kth_largest(float *x, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;  /* index in descending order */
    while (lo < hi) {
        float pivot = x[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (x[i] > pivot) i++;
            while (x[j] < pivot) j--;
            if (i <= j) { float t = x[i]; x[i] = x[j]; x[j] = t; i++; j--; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
    return x[want];
}

typedef struct { float p; int64_t i; } sm_entry;
static int sm_by_p_desc(const void *a, const void *b) {  /* most likely first, ties by index */
    const sm_entry *x = a, *y = b;
    if (x->p != y->p) return x->p < y->p ? 1 : -1;
    return x->i < y->i ? -1 : x->i > y->i;
}

int tg_sample(const float *logits, const uint8_t *seen, const float *u, int64_t B, int64_t V, float temperature,
              int64_t top_k, float top_p, float penalty, int64_t *out) {
    if (V <= 0) TG_FAIL("sample: a vocabulary of %lld", (long long)V);
    float *x = bq_scratch_get((size_t)V * (2 * sizeof(float) + sizeof(sm_entry)));
    if (!x) TG_FAIL("sample: out of memory for a row of %lld logits", (long long)V);
    float *tmp = x + V;
    sm_entry *ranked = (sm_entry *)(tmp + V);
    for (int64_t b = 0; b < B; b++) {
        const float *l = logits + b * V;
        for (int64_t i = 0; i < V; i++) {
            float v = l[i];
            if (penalty != 1.f && seen[b * V + i]) v = v > 0 ? v / penalty : v * penalty;
            x[i] = v;
        }
        if (temperature == 0.f) {  /* greedy: the first largest */
            int64_t best = 0;
            for (int64_t i = 1; i < V; i++)
                if (x[i] > x[best]) best = i;
            out[b] = best;
            continue;
        }
        float m = -INFINITY;
        for (int64_t i = 0; i < V; i++) {
            x[i] /= temperature;
            m = x[i] > m ? x[i] : m;
        }
        float kth = -INFINITY;
        if (top_k > 0 && top_k < V) {
            memcpy(tmp, x, (size_t)V * sizeof(float));
            kth = sm_kth_largest(tmp, V, top_k);
        }
        float total = 0.f;
        for (int64_t i = 0; i < V; i++) {
            float p = x[i] < kth ? 0.f : tg_expf(x[i] - m);
            x[i] = p;
            total += p;
        }
        if (top_p < 1.f) {
            /* The kept set is a prefix of the tokens ranked by probability; every token above a
             * threshold t comes before every token below it, so once the mass above t reaches
             * top_p, only those need ranking (t halves from the largest until it does). */
            float t = 1.f, above = 0.f, inv = 1.f / total;
            while (t > 1e-30f) {
                t *= 0.5f;
                above = 0.f;
                for (int64_t i = 0; i < V; i++)
                    if (x[i] * inv > t) above += x[i] * inv;
                if (above >= top_p) break;
            }
            if (above < top_p) t = 0.f;  /* rank every token left */
            int64_t c = 0;
            for (int64_t i = 0; i < V; i++)
                if (x[i] > 0 && x[i] * inv > t) ranked[c++] = (sm_entry){x[i] * inv, i};
            qsort(ranked, (size_t)c, sizeof(sm_entry), sm_by_p_desc);
            float before = 0.f, kept = 0.f;
            for (int64_t r = 0; r < c; r++) {
                if (before >= top_p) ranked[r].p = -1.f;  /* past the set */
                before += ranked[r].p > 0 ? ranked[r].p : 0.f;
            }
            for (int64_t i = 0; i < V; i++) tmp[i] = 0.f;
            for (int64_t r = 0; r < c; r++)
                if (ranked[r].p >= 0) { tmp[ranked[r].i] = x[ranked[r].i]; kept += x[ranked[r].i]; }
            memcpy(x, tmp, (size_t)V * sizeof(float));
            total = kept;
        }
        float target = u[b] * total, run = 0.f;
        int64_t pick = V - 1;
        for (int64_t i = 0; i < V; i++) {
            run += x[i];
            if (run > target) { pick = i; break; }
        }
        out[b] = pick;
    }
    return 0;
}
