/* A strided 1-D convolution (stride s >= 2, k taps, no padding, dense, f32, a constant
 * weight) as ceil(k/s) oneDNN matmuls over views of its channels-last source, nothing copied:
 *
 *   y[t] = sum_j x[s t + j] W[j]     (x: [N, L, C] channels-last, W[j]: C x O)
 *
 * Output t reads x[s t .. s t + k - 1], the k C contiguous floats from s t C. Taps b s ..
 * b s + kb - 1 (kb = min(s, k - b s)) of every output are then a matrix view of x: T rows of
 * kb C floats from b s C, s C apart. With kb <= s the rows do not overlap, which oneDNN's matmul
 * takes (it refuses the single view of all k taps, whose rows overlap), so
 *
 *   y = X_0 W_0 + X_1 W_1 + ...      (W_b: rows (j, c) of taps b s + j, columns the outputs)
 *
 * the first matmul writing y, each later one adding into it (a sum post-op), the convolution's
 * eltwise epilogue (gelu, relu, ...) on the last one. oneDNN's GEMM kernels run these at the
 * rate of its GEMMs, above what its strided direct convolution reaches on the same shapes
 * (wav2vec 2.0's feature encoder: ir/hardware.py, strided_conv_wins). The W_b are rearranged
 * from the weight once, when the binding is made (packed by oneDNN where its kernel wants it),
 * as winograd.c transforms its weight. A convolution this path does not take (a bias, padding,
 * a binary post-op, bf16, a chained source in another layout) is made as tg_conv_create makes
 * it. Which convolutions ask for this path is the emitter's rule (ir/hardware.py). */
#ifndef TG_MAX_POST /* runtime.h has no include guard; runtime.c is included before this file */
#include "runtime.h"
#endif

#define TG_SCONV_MAX_BLOCKS 4 /* matmuls a convolution may take (ceil(k/s)); the rule asks for fewer */

/* -1: the emitter's choice (tg_sconv_create's `chosen`), 0: never, 1: every eligible convolution.
 * TG_STRIDED_CONV=0 in the environment starts it at 0, for a whole model's A/B
 * (benchmarks/full_size_sweep.py). */
static int tg_sconv_mode = -2; /* (-2: not read from the environment yet) */
void tg_set_strided_conv(int mode) { tg_sconv_mode = mode; }
/* Strided convolutions run as matmuls so far (tests check the path is taken). */
static int tg_sconv_runs;
int tg_strided_conv_count(void) { return __atomic_load_n(&tg_sconv_runs, __ATOMIC_RELAXED); }

struct tg_sconv {
    int blocks;
    int64_t offset[TG_SCONV_MAX_BLOCKS];  /* where block b's view starts in x: b s C floats */
    tg_prim mm[TG_SCONV_MAX_BLOCKS];      /* X_b W_b (+ what y holds, b > 0) */
    tg_packed pack[TG_SCONV_MAX_BLOCKS];  /* W_b as its primitive reads it */
    float *w[TG_SCONV_MAX_BLOCKS];        /* W_b as it is, where a primitive reads that */
};

int tg_sconv_run(tg_prim *g, const void *src, void *dst) {
    tg_sconv *s = g->sconv;
    for (int b = 0; b < s->blocks; b++)
        if (tg_prim_run(&s->mm[b], (const float *)src + s->offset[b], s->w[b], NULL, dst, NULL)) return 1;
    __atomic_add_fetch(&tg_sconv_runs, 1, __ATOMIC_RELAXED);
    return 0;
}

/* Whether this path computes the convolution: 1-D, dense, no bias, no padding, dilation 1,
 * stride >= 2, at most TG_SCONV_MAX_BLOCKS matmuls, a constant weight, f32, channels-last source
 * (positions C floats apart) and result, eltwise post-ops only, and a chained source only where
 * its producer left it in those strides. */
static int tg_sconv_takes(int nd, const int64_t *x_dims, const int64_t *x_str, int w_nd, const int64_t *w_dims,
                          const int64_t *y_dims, const int64_t *y_str, int has_bias, const int64_t *strides,
                          const int64_t *dilations, const int64_t *pads, const void *weight, int npost,
                          const tg_post *posts, const tg_prim *from) {
    if (nd != 3 || w_nd != 3 || has_bias || !weight || tg_fpmath != dnnl_fpmath_mode_strict ||
        w_dims[1] != x_dims[1] || w_dims[0] != y_dims[1] || strides[0] < 2 || dilations[0] != 1 || pads[0] ||
        pads[1] || (w_dims[2] + strides[0] - 1) / strides[0] > TG_SCONV_MAX_BLOCKS || npost >= TG_MAX_POST ||
        (x_dims[1] > 1 && x_str[1] != 1) || (x_dims[2] > 1 && x_str[2] != x_dims[1]) ||
        (y_dims[1] > 1 && y_str[1] != 1) || y_dims[2] != (x_dims[2] - w_dims[2]) / strides[0] + 1 ||
        x_dims[2] < w_dims[2])
        return 0;
    for (int i = 0; i < npost; i++)
        if (posts[i].binary) return 0;
    return tg_reads_plain(from, nd, x_dims, x_str);
}

/* tg_conv_create's arguments (less `block`), and `chosen`: 1 where the emitter's rule chose this
 * path for the shape (tg_set_strided_conv may overrule it). */
int tg_sconv_create(tg_prim *g, int nd, const int64_t *x_dims, const int64_t *x_str, int w_nd,
                    const int64_t *w_dims, const int64_t *w_str, const int64_t *y_dims, const int64_t *y_str,
                    int has_bias, const int64_t *strides, const int64_t *dilations, const int64_t *pads,
                    const void *weight, tg_packed *pack, int npost, const tg_post *posts, const tg_prim *from,
                    int chain_out, int stream, int chosen) {
    if (tg_sconv_mode == -2)
        tg_sconv_mode = getenv("TG_STRIDED_CONV") && !strcmp(getenv("TG_STRIDED_CONV"), "0") ? 0 : -1;
    if (!(tg_sconv_mode < 0 ? chosen : tg_sconv_mode) ||
        !tg_sconv_takes(nd, x_dims, x_str, w_nd, w_dims, y_dims, y_str, has_bias, strides, dilations, pads, weight,
                        npost, posts, from))
        return tg_conv_create(g, nd, x_dims, x_str, w_nd, w_dims, w_str, y_dims, y_str, has_bias, strides,
                              dilations, pads, weight, pack, npost, posts, from, chain_out, stream, 0);
    if (tg_runtime_init()) return 1;
    tg_sconv *s = calloc(1, sizeof *s);
    if (!s) TG_FAIL("out of memory for a strided convolution");
    g->sconv = s;
    const int64_t n = x_dims[0], c = x_dims[1], o = y_dims[1], t = y_dims[2], k = w_dims[2], st = strides[0];
    const float *w = weight;
    s->blocks = (int)((k + st - 1) / st);
    tg_post last[TG_MAX_POST];
    last[0] = (tg_post){.binary = TG_POST_SUM};
    memcpy(last + 1, posts, (size_t)npost * sizeof *posts);
    size_t used = strlen(tg_prim_lines);
    int count = tg_prims, rc = 0;
    const char *impl = "?";
    for (int b = 0; b < s->blocks && !rc; b++) {
        const int64_t kb = k - b * st < st ? k - b * st : st, rows = kb * c;
        float *wb = malloc((size_t)rows * o * sizeof(float));
        if (!wb) {
            snprintf(tg_err, sizeof tg_err, "out of memory rearranging a strided convolution's weight");
            rc = 1;
            break;
        }
        for (int64_t j = 0; j < kb; j++) /* W_b[(j, ci), oi] = w[oi, ci, b s + j] */
            for (int64_t ci = 0; ci < c; ci++)
                for (int64_t oi = 0; oi < o; oi++)
                    wb[(j * c + ci) * o + oi] = w[oi * w_str[0] + ci * w_str[1] + (b * st + j) * w_str[2]];
        s->offset[b] = b * st * c;
        /* (batch 1 as a 2-D matmul: oneDNN chooses its kernels by the strides of every dim) */
        const int64_t ad[] = {n, t, rows}, as[] = {x_str[0], st * c, 1};
        const int64_t bd[] = {1, rows, o}, bs[] = {rows * o, o, 1};
        const int64_t cd[] = {n, t, o}, cs[] = {y_str[0], y_str[2], 1};
        const int types[] = {dnnl_f32, dnnl_f32, dnnl_f32};
        int two = n == 1, first = b == 0, end = b == s->blocks - 1;
        /* the first writes y; the later ones add into it; the last applies the epilogue */
        rc = tg_matmul_create(&s->mm[b], 3 - two, ad + two, as + two, bd + two, bs + two, cd + two, cs + two, types,
                              0, wb, &s->pack[b], first ? (end ? npost : 0) : (end ? npost + 1 : 1),
                              first ? posts : last, 0);
        rc = rc ? 2 : 0; /* (a view oneDNN's matmul refuses: its convolution) */
        if (rc || s->mm[b].wei_handle) free(wb);
        else s->w[b] = wb; /* (its primitive reads W_b as it lies) */
        const_dnnl_primitive_desc_t pd = NULL;
        if (!rc) dnnl_primitive_get_primitive_desc(s->mm[b].prim, &pd);
        if (!rc && (!pd || tg_is_ref(pd) || s->mm[b].re_src || s->mm[b].re_dst)) rc = 2; /* no fast GEMM: oneDNN's */
        if (!rc) impl = tg_impl(pd);
    }
    if (strlen(tg_prim_lines) > used) tg_prim_lines[used] = 0; /* (reported below as the convolution it is) */
    tg_prims = count;
    if (rc == 1) return 1;
    if (rc) {
        tg_prim_destroy(g);
        return tg_conv_create(g, nd, x_dims, x_str, w_nd, w_dims, w_str, y_dims, y_str, has_bias, strides,
                              dilations, pads, weight, pack, npost, posts, from, chain_out, stream, 0);
    }
    char line[256];
    int len = snprintf(line, sizeof line, "convolution of a %lldx%lldx%lld source: strided (k %lld, stride %lld) as %d "
                       "matmuls on %s\n", (long long)n, (long long)c, (long long)x_dims[2], (long long)k,
                       (long long)st, s->blocks, impl);
    len = len < (int)sizeof line ? len : (int)sizeof line - 1;
    if (used + len >= sizeof tg_prim_lines) used = 0;
    memcpy(tg_prim_lines + used, line, (size_t)len + 1);
    tg_prims++;
    return 0;
}

void tg_sconv_free(tg_sconv *s) {
    for (int b = 0; b < TG_SCONV_MAX_BLOCKS; b++) {
        tg_prim_destroy(&s->mm[b]);
        free(s->pack[b].data);
        free(s->w[b]);
        if (s->pack[b].md) dnnl_memory_desc_destroy(s->pack[b].md);
    }
    free(s);
}
