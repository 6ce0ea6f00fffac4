/* tilegraph C backend: attention's backward (tg.attention_grad), f32 on oneDNN's sgemm per
 * block (runtime.h declares tg_attention_backward). Compiled into the runtime library after
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

/* bs: the batch strides of q, k, v, gy, the mask, dq, dk and dv, nb each, in that order; rows
 * of q, k, v and gy contiguous at row strides qr, kr, vr, gr; dq, dk, dv row-major. */
int tg_attention_backward(int nb, const int64_t *bd, const int64_t *bs, const float *q, const float *k,
                          const float *v, const float *gy, const void *mask, float *dq, float *dk, float *dv,
                          int64_t lq, int64_t lk, int64_t d, int64_t e, int64_t qr, int64_t kr, int64_t vr,
                          int64_t gr, int mask_kind, int64_t mr, int64_t mc, float scale, int causal, int64_t bq) {
    if (bq < 1 || bq > TG_MAX_BLOCK || lq < 0 || lk < 0 || d < 0 || e < 0)
        TG_FAIL("attention_grad: block size or lengths out of range");
    int64_t batches = 1;
    for (int i = 0; i < nb; i++) batches *= bd[i];
    int failed = 0;
#pragma omp parallel if (batches * lq * lk * (d + e) > 65536)
    {
        /* two slabs of bq x lk: the scores then probabilities, and dP then dS */
        float *s = lk > 0 ? malloc(sizeof(float) * (size_t)(2 * bq * lk)) : NULL;
        if (lk > 0 && !s) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED); /* (threads may fail at once) */
        float *ds = s ? s + bq * lk : NULL;
#pragma omp for schedule(dynamic)
        for (int64_t bi = 0; bi < batches; bi++) {
            int64_t off[8] = {0}, rest = bi;
            for (int i = nb - 1; i >= 0; i--) {
                int64_t idx = rest % bd[i];
                rest /= bd[i];
                for (int t = 0; t < 8; t++) off[t] += idx * bs[t * nb + i];
            }
            const float *qh = q + off[0], *kh = k + off[1], *vh = v + off[2], *gh = gy + off[3];
            float *dqh = dq + off[5], *dkh = dk + off[6], *dvh = dv + off[7];
            memset(dkh, 0, sizeof(float) * (size_t)(lk * d));
            memset(dvh, 0, sizeof(float) * (size_t)(lk * e));
            if (lk == 0) {
                for (int64_t i = 0; i < lq * d; i++) dqh[i] = NAN; /* no keys: softmax over nothing */
                continue;
            }
            if (!s) continue;
            for (int64_t i0 = 0; i0 < lq; i0 += bq) {
                int64_t nq = i0 + bq < lq ? bq : lq - i0;
                /* the keys some row of the block sees: through its last query's position */
                int64_t nk = causal ? i0 + nq + lk - lq : lk;
                nk = nk > lk ? lk : nk;
                if (nk <= 0) { /* rows before every key: NaN, as the forward's */
                    for (int64_t i = 0; i < nq * d; i++) dqh[i0 * d + i] = NAN;
                    for (int64_t i = 0; i < lk * d; i++) dkh[i] = NAN;
                    for (int64_t i = 0; i < lk * e; i++) dvh[i] = NAN;
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
                ok = ok && (e == 0 || dnnl_sgemm('T', 'N', nk, e, nq, 1.f, s, nk, gh + i0 * gr, gr, 1.f, dvh, e) ==
                                          dnnl_success);
                ok = ok && (d == 0 || dnnl_sgemm('N', 'N', nq, d, nk, 1.f, ds, nk, kh, kr, 0.f, dqh + i0 * d, d) ==
                                          dnnl_success);
                ok = ok && (d == 0 || dnnl_sgemm('T', 'N', nk, d, nq, 1.f, ds, nk, qh + i0 * qr, qr, 1.f, dkh, d) ==
                                          dnnl_success);
                if (!ok) {
                    __atomic_store_n(&failed, 2, __ATOMIC_RELAXED);
                    break;
                }
            }
        }
        free(s);
    }
    if (failed == 2) TG_FAIL("attention_grad: oneDNN's sgemm failed on a block");
    if (failed) TG_FAIL("attention_grad: out of memory for its working blocks");
    __atomic_fetch_add(&tg_attention_backwards, 1, __ATOMIC_RELAXED);
    return 0;
}
