/* tilegraph C backend: attention's backward (tg.attention_grad), f32: on attention.c's
 * register-blocked products where the processor has AVX-512, else on oneDNN's sgemm per block
 * (runtime.h declares tg_attention_backward). Compiled into the runtime library after
 * attention.c (build.py), whose helpers and runtime.c's statics it uses.
 *
 * FlashAttention-2's backward reorganised for a CPU core: per batch row (head), query blocks of
 * bq rows, each against every key it sees at once (the causal limit: the keys after the block's
 * last query are never touched, so a causal mask halves the work), in a working area of two
 * bq x Lk slabs that stays in the core's cache:
 *
 *   S  = scale Q_b K^T          P = softmax(S, masked)     (the forward's probabilities again)
 *   dP = dO_b V^T               dS = P (dP - rowsum(P dP)) scale
 *   dV += P^T dO_b              dQ_b = dS K                dK += dS^T Q_b
 *
 * Whole rows per block need no saved logsumexp (the row's max and sum are at hand) and no
 * second pass over the keys. dK and dV sum over the head's query blocks in place: one task
 * owns a head, so nothing is shared between threads. The mask: 0 none, 1 bool (keep where
 * true), 2 float (added), read at row stride mr and column stride mc from its batch offset. */
#ifndef TG_MAX_POST /* runtime.h has no include guard; runtime.c is included before this file */
#include "runtime.h"
#endif

static int tg_attention_backwards;
int tg_attention_backward_count(void) { return __atomic_load_n(&tg_attention_backwards, __ATOMIC_RELAXED); }

/* The offsets of batch row `bi` (flattened over dims bd[nb]) in the 8 operands whose batch
 * strides bs holds (tg_attention_backward's order). */
static void tg_grad_offsets(int nb, const int64_t *bd, const int64_t *bs, int64_t bi, int64_t off[8]) {
    for (int t = 0; t < 8; t++) off[t] = 0;
    for (int i = nb - 1; i >= 0; i--) {
        int64_t idx = bi % bd[i];
        bi /= bd[i];
        for (int t = 0; t < 8; t++) off[t] += idx * bs[t * nb + i];
    }
}

/* rows x cols of x (row stride ld) set to `value` */
static void tg_fill_rows(float *x, int64_t rows, int64_t cols, int64_t ld, float value) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) x[i * ld + j] = value;
}

#ifdef TG_HAVE_F32_ATTENTION
/* --- the same on AVX-512, on attention.c's register-blocked products ---
 *
 * oneDNN's sgemm per block packed its operands on every call: five calls per block of 64 query
 * rows, each a few microseconds of work at MiniLM's 128 keys and head dim 32, so the packing and
 * the dispatch were a large part of it. Here a head's k and v are packed once (k^T and v^T as d
 * and e rows of lk16 keys, the columns of S = Q K^T and dP = dO V^T; k padded to d16 columns
 * for dQ = dS K), and the five products run on tg_f32_gemm, the two that read P and dS
 * transposed (dV += P^T dO, dK += dS^T Q) on tg_f32_gemm_at, which reads a slab's columns as
 * its rows: no transposed copy. The softmax is the forward's base-2 row (tg_flash_row_log2):
 * S is stored times scale log2(e), P = 2^(S - max) / sum. Operands whose columns are not a
 * multiple of 16 (the products load whole vectors of b and store whole vectors of c) go
 * through padded copies; at d, e multiples of 16 they are read and written where they are.
 * Each thread's working area (both slabs, the packed keys and values, dK and dV accumulators)
 * is allocated once per call and serves every head it takes. */
/* Query rows per block under a causal mask: a block multiplies every key through its last
 * row's, so the band's masked half-block is work wasted per block; at 16 rows that is a
 * sixteenth of GPT-2's 256 keys where the emitter's 64 wasted a quarter (its backward took 9%
 * less time in benchmarks/c_attention_ab.py --backward; without the mask 64 rows stay a little
 * faster, fewer passes over dK and dV). */
#define TG_F32_CAUSAL_ROWS 16

static int tg_f32_attention_backwards;
int tg_f32_attention_backward_count(void) {
    return __atomic_load_n(&tg_f32_attention_backwards, __ATOMIC_RELAXED);
}

static int tg_attention_backward_f32(int nb, const int64_t *bd, const int64_t *bs, const float *q, const float *k,
                                     const float *v, const float *gy, const void *mask, float *dq, float *dk,
                                     float *dv, int64_t lq, int64_t lk, int64_t d, int64_t e, int64_t qr,
                                     int64_t kr, int64_t vr, int64_t gr, int64_t dqr, int64_t dkr, int64_t dvr,
                                     int mask_kind, int64_t mr, int64_t mc, float scale, int causal, int64_t bq,
                                     int64_t batches) {
    if (causal && bq > TG_F32_CAUSAL_ROWS) bq = TG_F32_CAUSAL_ROWS;
    const int64_t lk16 = (lk + 15) / 16 * 16, d16 = (d + 15) / 16 * 16, e16 = (e + 15) / 16 * 16;
    const int dpad = d != d16, epad = e != e16;
    /* the area: s, ds (bq x lk16), k^T (d x lk16), v^T (e x lk16), k padded and dK (lk x d16
     * each), dV (lk x e16), q, dQ (bq x d16) and dO (bq x e16) of a block, padded */
    const int64_t floats = 2 * bq * lk16 + (d + e) * lk16 + lk * (2 * d16 + e16) + bq * (2 * d16 + e16);
    const float mul = scale * 1.44269504088896341f;
    int failed = 0;
#pragma omp parallel if (batches * lq * lk * (d + e) > 65536)
    {
        char *area = malloc(sizeof(float) * (size_t)floats + 64);
        if (!area) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        float *s = (float *)(((uintptr_t)area + 63) & ~(uintptr_t)63), *ds = s + bq * lk16, *kt = ds + bq * lk16;
        float *vt = kt + d * lk16, *kp = vt + e * lk16, *dka = kp + lk * d16, *dva = dka + lk * d16;
        float *qp = dva + lk * e16, *dqa = qp + bq * d16, *gp = dqa + bq * d16;
#pragma omp for schedule(dynamic)
        for (int64_t bi = 0; bi < batches; bi++) {
            if (!area) continue;
            int64_t off[8];
            tg_grad_offsets(nb, bd, bs, bi, off);
            const float *qh = q + off[0], *kh = k + off[1], *vh = v + off[2], *gh = gy + off[3];
            float *dqh = dq + off[5], *dkh = dk + off[6], *dvh = dv + off[7];
            /* dK and dV summed where they are when their rows are whole vectors */
            float *dks = dpad ? dka : dkh, *dvs = epad ? dva : dvh;
            int64_t ldk = dpad ? d16 : dkr, ldv = epad ? e16 : dvr;
            tg_fill_rows(dks, lk, dpad ? d16 : d, ldk, 0.f);
            tg_fill_rows(dvs, lk, epad ? e16 : e, ldv, 0.f);
            tg_pack_transposed(kh, kr, lk, d, kt, lk16);
            tg_pack_transposed(vh, vr, lk, e, vt, lk16);
            if (dpad) tg_pad_rows(kh, kr, lk, d, kp, d16);
            const float *kb = dpad ? kp : kh;
            int64_t ldkb = dpad ? d16 : kr, nan_head = 0;
            for (int64_t i0 = 0; i0 < lq; i0 += bq) {
                int64_t nq = i0 + bq < lq ? bq : lq - i0;
                int64_t nk = causal ? i0 + nq + lk - lq : lk; /* the keys some row of the block sees */
                nk = nk > lk ? lk : nk;
                if (nk <= 0) { /* rows before every key: NaN, as the forward's */
                    tg_fill_rows(dqh + i0 * dqr, nq, d, dqr, NAN);
                    nan_head = 1;
                    continue;
                }
                int64_t nt = (nk + 15) / 16;
                const float *qb = qh + i0 * qr, *gb = gh + i0 * gr;
                int64_t ldq = qr, ldg = gr;
                if (dpad) { tg_pad_rows(qb, qr, nq, d, qp, d16); qb = qp; ldq = d16; }
                if (epad) { tg_pad_rows(gb, gr, nq, e, gp, e16); gb = gp; ldg = e16; }
                tg_f32_gemm(nq, nt, d, qb, ldq, kt, lk16, s, lk16, 0, mul);
                for (int64_t i = 0; i < nq; i++) {
                    float mx = -INFINITY, sum = 0.f, *si = s + i * lk16;
                    tg_flash_row_log2(si, nk, i0, i, 0, lq, lk, causal, mask_kind, mask, off[4], mr, mc, &mx, &sum,
                                      NULL, 0);
                    /* a row with every key masked: NaN, as softmax over all -inf is, and so are all
                     * of the head's dK and dV, which sum over its rows (filled after its last block) */
                    nan_head |= !(sum > 0.f);
                    const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : NAN);
                    for (int64_t j = 0; j < 16 * nt; j += 16) _mm512_storeu_ps(si + j, _mm512_mul_ps(inv, _mm512_loadu_ps(si + j)));
                }
                tg_f32_gemm(nq, nt, e, gb, ldg, vt, lk16, ds, lk16, 0, 1.f);
                const __m512 vscale = _mm512_set1_ps(scale);
                for (int64_t i = 0; i < nq; i++) { /* dS = P (dP - rowsum(P dP)) scale (padding: P and dP zero) */
                    float *pi = s + i * lk16, *gi = ds + i * lk16;
                    __m512 dot = _mm512_setzero_ps();
                    for (int64_t j = 0; j < 16 * nt; j += 16)
                        dot = _mm512_fmadd_ps(_mm512_loadu_ps(pi + j), _mm512_loadu_ps(gi + j), dot);
                    const __m512 vdot = _mm512_set1_ps(_mm512_reduce_add_ps(dot));
                    for (int64_t j = 0; j < 16 * nt; j += 16) {
                        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(pi + j), _mm512_sub_ps(_mm512_loadu_ps(gi + j), vdot));
                        _mm512_storeu_ps(gi + j, _mm512_mul_ps(x, vscale));
                    }
                }
                tg_f32_gemm_at(nk, e16 / 16, nq, s, lk16, gb, ldg, dvs, ldv, 1, 1.f);
                float *dqb = dpad ? dqa : dqh + i0 * dqr;
                tg_f32_gemm(nq, d16 / 16, nk, ds, lk16, kb, ldkb, dqb, dpad ? d16 : dqr, 0, 1.f);
                if (dpad)
                    for (int64_t i = 0; i < nq; i++) memcpy(dqh + (i0 + i) * dqr, dqa + i * d16, sizeof(float) * (size_t)d);
                tg_f32_gemm_at(nk, d16 / 16, nq, ds, lk16, qb, ldq, dks, ldk, 1, 1.f);
            }
            if (nan_head) {
                tg_fill_rows(dkh, lk, d, dkr, NAN);
                tg_fill_rows(dvh, lk, e, dvr, NAN);
                continue;
            }
            for (int64_t j = 0; dpad && j < lk; j++) memcpy(dkh + j * dkr, dka + j * d16, sizeof(float) * (size_t)d);
            for (int64_t j = 0; epad && j < lk; j++) memcpy(dvh + j * dvr, dva + j * e16, sizeof(float) * (size_t)e);
        }
        free(area);
    }
    if (failed) TG_FAIL("attention_grad: out of memory for its working blocks");
    __atomic_fetch_add(&tg_attention_backwards, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&tg_f32_attention_backwards, 1, __ATOMIC_RELAXED);
    return 0;
}
#endif

/* bs: the batch strides of q, k, v, gy, the mask, dq, dk and dv, nb each, in that order; rows
 * of each contiguous, at row strides qr, kr, vr, gr and dqr, dkr, dvr (the emitter lays the
 * gradients out as their reader, the heads' merge, wants them: BERT's (b, s, h, d)). */
int tg_attention_backward(int nb, const int64_t *bd, const int64_t *bs, const float *q, const float *k,
                          const float *v, const float *gy, const void *mask, float *dq, float *dk, float *dv,
                          int64_t lq, int64_t lk, int64_t d, int64_t e, int64_t qr, int64_t kr, int64_t vr,
                          int64_t gr, int64_t dqr, int64_t dkr, int64_t dvr, int mask_kind, int64_t mr, int64_t mc,
                          float scale, int causal, int64_t bq) {
    if (bq < 1 || bq > TG_MAX_BLOCK || lq < 0 || lk < 0 || d < 0 || e < 0)
        TG_FAIL("attention_grad: block size or lengths out of range");
    int64_t batches = 1;
    for (int i = 0; i < nb; i++) batches *= bd[i];
#ifdef TG_HAVE_F32_ATTENTION
    if (d > 0 && e > 0 && lq > 0 && lk > 0 && batches > 0)
        return tg_attention_backward_f32(nb, bd, bs, q, k, v, gy, mask, dq, dk, dv, lq, lk, d, e, qr, kr, vr, gr, dqr,
                                         dkr, dvr, mask_kind, mr, mc, scale, causal, bq, batches);
#endif
    int failed = 0;
#pragma omp parallel if (batches * lq * lk * (d + e) > 65536)
    {
        /* two slabs of bq x lk: the scores then probabilities, and dP then dS */
        float *s = lk > 0 ? malloc(sizeof(float) * (size_t)(2 * bq * lk)) : NULL;
        if (lk > 0 && !s) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED); /* (threads may fail at once) */
        float *ds = s ? s + bq * lk : NULL;
#pragma omp for schedule(dynamic)
        for (int64_t bi = 0; bi < batches; bi++) {
            int64_t off[8];
            tg_grad_offsets(nb, bd, bs, bi, off);
            const float *qh = q + off[0], *kh = k + off[1], *vh = v + off[2], *gh = gy + off[3];
            float *dqh = dq + off[5], *dkh = dk + off[6], *dvh = dv + off[7];
            tg_fill_rows(dkh, lk, d, dkr, 0.f);
            tg_fill_rows(dvh, lk, e, dvr, 0.f);
            if (lk == 0) {
                tg_fill_rows(dqh, lq, d, dqr, NAN); /* no keys: softmax over nothing */
                continue;
            }
            if (!s) continue;
            int nan_head = 0;
            for (int64_t i0 = 0; i0 < lq; i0 += bq) {
                int64_t nq = i0 + bq < lq ? bq : lq - i0;
                /* the keys some row of the block sees: through its last query's position */
                int64_t nk = causal ? i0 + nq + lk - lq : lk;
                nk = nk > lk ? lk : nk;
                if (nk <= 0) { /* rows before every key: NaN, as the forward's */
                    tg_fill_rows(dqh + i0 * dqr, nq, d, dqr, NAN);
                    nan_head = 1;
                    continue;
                }
                int ok = d == 0 || dnnl_sgemm('N', 'T', nq, nk, d, scale, qh + i0 * qr, qr, kh, kr, 0.f, s, nk) ==
                                       dnnl_success;
                if (d == 0)
                    memset(s, 0, sizeof(float) * (size_t)(nq * nk));
                /* the probabilities: the causal cut and the mask, then softmax in place (a row with
                 * every key masked NaN, as softmax over all -inf is, and the gradients it reaches) */
                for (int64_t i = 0; ok && i < nq; i++)
                    tg_flash_mask(s + i * nk, nk, i0, i, 0, lq, lk, causal, mask_kind, mask, off[4], mr, mc);
                tg_softmax_rows(s, s, nq, nk);
                /* such a row's NaN reaches every key's dK and dV, not only the keys through nk */
                for (int64_t i = 0; i < nq; i++) nan_head |= s[i * nk] != s[i * nk];
                if (ok && e > 0)
                    ok = dnnl_sgemm('N', 'T', nq, nk, e, 1.f, gh + i0 * gr, gr, vh, vr, 0.f, ds, nk) == dnnl_success;
                else if (ok)
                    memset(ds, 0, sizeof(float) * (size_t)(nq * nk));
                for (int64_t i = 0; ok && i < nq; i++) {
                    float *pi = s + i * nk, *gi = ds + i * nk, dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t j = 0; j < nk; j++) dot += pi[j] * gi[j];
#pragma omp simd
                    for (int64_t j = 0; j < nk; j++) gi[j] = pi[j] * (gi[j] - dot) * scale;
                }
                ok = ok && (e == 0 || dnnl_sgemm('T', 'N', nk, e, nq, 1.f, s, nk, gh + i0 * gr, gr, 1.f, dvh, dvr) ==
                                          dnnl_success);
                ok = ok && (d == 0 || dnnl_sgemm('N', 'N', nq, d, nk, 1.f, ds, nk, kh, kr, 0.f, dqh + i0 * dqr, dqr) ==
                                          dnnl_success);
                ok = ok && (d == 0 || dnnl_sgemm('T', 'N', nk, d, nq, 1.f, ds, nk, qh + i0 * qr, qr, 1.f, dkh, dkr) ==
                                          dnnl_success);
                if (!ok) {
                    __atomic_store_n(&failed, 2, __ATOMIC_RELAXED);
                    break;
                }
            }
            if (nan_head) {
                tg_fill_rows(dkh, lk, d, dkr, NAN);
                tg_fill_rows(dvh, lk, e, dvr, NAN);
            }
        }
        free(s);
    }
    if (failed == 2) TG_FAIL("attention_grad: oneDNN's sgemm failed on a block");
    if (failed) TG_FAIL("attention_grad: out of memory for its working blocks");
    __atomic_fetch_add(&tg_attention_backwards, 1, __ATOMIC_RELAXED);
    return 0;
}
