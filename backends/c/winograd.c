/* Winograd convolution F(4x4, 3x3) for 3x3, stride-1, dense or grouped f32 convolutions on
 * channels-last activations (Lavin and Gray, "Fast Algorithms for Convolutional Neural
 * Networks", 2015). Each 4x4 block of outputs ("tile") comes from a 6x6 block of inputs:
 *
 *   Y = A^T [ (G g G^T) (.) (B^T d B) ] A
 *
 * and the elementwise product (.), summed over input channels, is 36 independent GEMMs
 * [tiles x C] x [C x K], one per point of the 6x6 transformed tile: 36 * 16 / (16 * 9) = 1/4 of
 * a direct convolution's multiply-adds, which oneDNN's kernels run at the core's peak, so only
 * fewer of them makes such a convolution faster (oneDNN 3.2 has no f32 Winograd on x64: its
 * primitive descriptor for dnnl_convolution_winograd is "unimplemented"). Channels stay
 * innermost, as the activations lie, 16 of them one vector through both transforms:
 *
 *   x (N, H, W, C) --input transform--> V [36][tiles][C] --36 GEMMs (one oneDNN batched
 *   matmul, its B packed once)--> M [36][tiles][K] --output transform, bias, post-ops--> y
 *
 * A grouped convolution (RegNet's, 64 channels a group) makes 36 x groups GEMMs [tiles x C/groups]
 * x [C/groups x K/groups] of the same batched matmul, each reading its group's columns of V and
 * writing its columns of M, so the transforms are those of the dense convolution.
 *
 * over the tiles in chunks (of the emitter's WINOGRAD_CHUNK_BYTES), each chunk through all
 * three before the next, so its V and M are still in cache when the next stage reads them.
 * The weight is transformed (G g G^T, in double) and packed once when the binding is made,
 * as runtime.c packs oneDNN's weights. V and M live in the arena scratch the emitter reserves
 * for the step (onednn.py); the transforms run over tiles on OpenMP's threads, the GEMMs on
 * oneDNN's. The epilogue oneDNN would have fused (bias, relu/clip/linear, a binary operand, a
 * sum into the destination) is applied to each 4x4 tile as it is written, in the same order.
 * Where a convolution does not qualify here (bf16 precision, a chained layout, another
 * post-op), it is made as tg_conv_create makes it. Which convolutions ask for this path is the
 * emitter's rule (ir/hardware.py, winograd_wins), from measured times per shape. */
#ifndef TG_MAX_POST /* runtime.h has no include guard; runtime.c is included before this file */
#include "runtime.h"
#endif

#define TG_WINO_V 16 /* channels per vector: one AVX-512 register of f32 (several where there is no AVX-512) */
typedef float tg_v16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t tg_m16 __attribute__((vector_size(64), aligned(4)));

/* -1: the emitter's choice (tg_wino_create's `scratch`), 0: never, 1: every eligible convolution
 * (benchmarks/winograd_convs.py times both ways in one process). TG_WINOGRAD=0 in the
 * environment starts it at 0, for a whole model's A/B (benchmarks/full_size_sweep.py). */
static int tg_wino_mode = -2; /* (-2: not read from the environment yet) */
void tg_set_winograd(int mode) { tg_wino_mode = mode; }
/* Winograd convolutions run so far (tests check the path is taken). */
static int tg_wino_runs;
int tg_winograd_count(void) { return __atomic_load_n(&tg_wino_runs, __ATOMIC_RELAXED); }

struct tg_wino {
    int64_t n, c, k, h, w, oh, ow, pt, pl, th, tw, tiles, tb;     /* tb: tiles per chunk */
    int64_t groups;                                               /* (C / groups channels in each) */
    int64_t xs[4], ys[4];                                         /* strides, NCHW order */
    int arena;                                                    /* V and M in the step's arena scratch */
    tg_prim mm, tail;                                             /* the 36 GEMMs: a chunk, the last one */
    tg_packed pack;                                               /* their B: G g G^T, packed */
    float *u;                                                     /* or as it is, where oneDNN takes that */
    int npost;
    tg_post posts[TG_MAX_POST];
};

/* The transforms interpolate at 0, -1, 1, 1/2, -2 and infinity, not Lavin's 0, +-1, +-2: points
 * paired with their reciprocals, as Barabasz et al. advise ("Error analysis and improving the
 * accuracy of Winograd convolution for deep neural networks", 2020). Of four sets tried against
 * float64 over random 6x6 tiles of 256 channels in f32, this one's maximum relative error of a
 * tile was lowest: 7.5e-6 against Lavin's 3.1e-5 (mean 2.4e-6 against 4.5e-6; a direct f32 sum's:
 * 1.1e-7), for a few more additions in the input transform. The matrices solve
 * A^T [(G g) (.) (B^T d)] = g * d exactly (the Toom-Cook construction, solved for B^T). */

/* G g G^T of one 3x3 filter g (row-major, `s` apart within a row, `r` between rows) into u[36]. */
static void tg_wino_filter(const float *g, int64_t r, int64_t s, double *u) {
    static const double G[6][3] = {{1, 0, 0},
                                   {-1. / 3, 1. / 3, -1. / 3},
                                   {1. / 3, 1. / 3, 1. / 3},
                                   {-16. / 15, -8. / 15, -4. / 15},
                                   {1. / 15, -2. / 15, 4. / 15},
                                   {0, 0, 1}};
    double t[6][3];
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 3; j++)
            t[i][j] = G[i][0] * g[0 * r + j * s] + G[i][1] * g[1 * r + j * s] + G[i][2] * g[2 * r + j * s];
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 6; j++) u[i * 6 + j] = t[i][0] * G[j][0] + t[i][1] * G[j][1] + t[i][2] * G[j][2];
}

/* B^T d: six vectors in, six out (the rows or the columns of a 6x6 tile). */
static inline void tg_wino_bt(const tg_v16 *d, tg_v16 *o) {
    tg_v16 d13 = d[3] - d[1];
    o[0] = d[0] + 1.5f * d13 - 2.f * d[2] + d[4];
    o[1] = d[1] - 2.5f * d[2] + 0.5f * d[3] + d[4];
    o[2] = 2.5f * d[3] - d[1] + 0.5f * d[2] + d[4];
    o[3] = 2.f * d13 - d[2] + d[4];
    o[4] = -0.5f * d13 - d[2] + d[4];
    o[5] = d[1] - 1.5f * d[2] - 2.f * d[3] + 1.5f * d[4] + d[5];
}

/* A^T m: six vectors in, four out. */
static inline void tg_wino_at(const tg_v16 *m, tg_v16 *o) {
    tg_v16 s12 = m[1] + m[2], d21 = m[2] - m[1];
    o[0] = m[0] + s12 + m[3] + m[4];
    o[1] = d21 + 0.5f * m[3] - 2.f * m[4];
    o[2] = s12 + 0.25f * m[3] + 4.f * m[4];
    o[3] = d21 + 0.125f * m[3] - 8.f * m[4] + m[5];
}

/* Tile t's 6x6 inputs, channels c0..c0+cw, transformed into V (zeros outside the image). */
static void tg_wino_input(const tg_wino *s, const float *x, float *v, int64_t vs, int64_t t, int64_t t0, int64_t c0,
                          int cw) {
    int64_t per = s->th * s->tw, n = t / per, ty = t % per / s->tw, tx = t % s->tw;
    int64_t y0 = ty * 4 - s->pt, x0 = tx * 4 - s->pl;
    tg_v16 d[36], e[36], col[6], f[6];
    const tg_v16 zero = {0};
    if (cw == TG_WINO_V && y0 >= 0 && x0 >= 0 && y0 + 6 <= s->h && x0 + 6 <= s->w) { /* (inside: no checks) */
        const float *from = x + n * s->xs[0] + y0 * s->xs[2] + x0 * s->xs[3] + c0;
        for (int i = 0; i < 6; i++)
            for (int j = 0; j < 6; j++) d[i * 6 + j] = *(const tg_v16 *)(from + i * s->xs[2] + j * s->xs[3]);
    } else {
        for (int i = 0; i < 6; i++)
            for (int j = 0; j < 6; j++) {
                int64_t yy = y0 + i, xx = x0 + j;
                d[i * 6 + j] = zero;
                if (yy < 0 || yy >= s->h || xx < 0 || xx >= s->w) continue; /* (no pointer formed outside x) */
                const float *from = x + n * s->xs[0] + yy * s->xs[2] + xx * s->xs[3] + c0;
                if (cw == TG_WINO_V) d[i * 6 + j] = *(const tg_v16 *)from;
                else memcpy(&d[i * 6 + j], from, (size_t)cw * sizeof(float));
            }
    }
    for (int j = 0; j < 6; j++) { /* columns, then rows */
        for (int i = 0; i < 6; i++) col[i] = d[i * 6 + j];
        tg_wino_bt(col, f);
        for (int i = 0; i < 6; i++) e[i * 6 + j] = f[i];
    }
    float *row = v + (t - t0) * s->c + c0; /* (once: a store through tg_v16 may alias *s) */
    for (int i = 0; i < 6; i++) {
        tg_wino_bt(e + i * 6, f);
        for (int j = 0; j < 6; j++) {
            float *to = row + (i * 6 + j) * vs;
            if (cw == TG_WINO_V) *(tg_v16 *)to = f[j];
            else memcpy(to, &f[j], (size_t)cw * sizeof(float));
        }
    }
}

/* One post-op on the output pixel (n, yy, xx), channels k0..k0+kw (o), as oneDNN applies it;
 * y: where the pixel's channels lie (a sum adds what they hold). */
static inline tg_v16 tg_wino_post(const tg_post *p, const void *operand, const float *y, tg_v16 o, int kw,
                                  int64_t n, int64_t k0, int64_t yy, int64_t xx) {
    if (p->binary == TG_POST_SUM) {
        tg_v16 old = {0};
        if (kw == TG_WINO_V) old = *(const tg_v16 *)y;
        else memcpy(&old, y, (size_t)kw * sizeof(float));
        return o + old;
    }
    if (p->binary) {
        const int64_t idx[4] = {n, k0, yy, xx};
        const float *b = operand;
        int64_t cs = 0;
        for (int i = 0; i < p->nd; i++) { /* (dims aligned on the right; a dim of 1 broadcasts) */
            int d = 4 - p->nd + i;
            if (d >= 0 && p->dims[i] != 1) b += idx[d] * p->strides[i];
            if (d == 1 && p->dims[i] != 1) cs = p->strides[i];
        }
        tg_v16 w = {0};
        if (cs == 1 && kw == TG_WINO_V) w = *(const tg_v16 *)b;
        else for (int l = 0; l < kw; l++) w[l] = b[l * cs];
        return p->alg == dnnl_binary_add ? o + w : p->alg == dnnl_binary_mul ? o * w : o - w;
    }
    if (p->alg == dnnl_eltwise_relu) { /* x > 0 ? x : alpha x, NaN kept */
        tg_m16 neg = o <= 0.f;
        return (tg_v16)(((tg_m16)o & ~neg) | ((tg_m16)(o * p->alpha) & neg));
    }
    if (p->alg == dnnl_eltwise_clip) {
        tg_m16 lo = o < p->alpha, hi = o > p->beta;
        tg_v16 a = o - o + p->alpha, b = o - o + p->beta;
        return (tg_v16)(((tg_m16)o & ~lo & ~hi) | ((tg_m16)a & lo) | ((tg_m16)b & hi));
    }
    return p->alpha * o + p->beta; /* dnnl_eltwise_linear (tg_wino_takes) */
}

/* Tile t's outputs, channels k0..k0+kw, from M: bias and post-ops, written into y. */
static void tg_wino_output(const tg_wino *s, const float *m, int64_t ms, const float *bias, float *y,
                           void *const *post, int64_t t, int64_t t0, int64_t k0, int kw) {
    int64_t per = s->th * s->tw, n = t / per, ty = t % per / s->tw, tx = t % s->tw;
    tg_v16 a[36], b[24], col[6], f[4], bv = {0};
    for (int p = 0; p < 36; p++) a[p] = *(const tg_v16 *)(m + p * ms + (t - t0) * s->k + k0);
    if (bias && kw == TG_WINO_V) bv = *(const tg_v16 *)((const float *)bias + k0);
    else if (bias) memcpy(&bv, (const float *)bias + k0, (size_t)kw * sizeof(float));
    for (int j = 0; j < 6; j++) { /* columns, then rows */
        for (int i = 0; i < 6; i++) col[i] = a[i * 6 + j];
        tg_wino_at(col, f);
        for (int i = 0; i < 4; i++) b[i * 6 + j] = f[i];
    }
    for (int i = 0; i < 4 && ty * 4 + i < s->oh; i++) {
        tg_wino_at(b + i * 6, f);
        for (int j = 0; j < 4 && tx * 4 + j < s->ow; j++) {
            int64_t yy = ty * 4 + i, xx = tx * 4 + j;
            float *to = y + n * s->ys[0] + yy * s->ys[2] + xx * s->ys[3] + k0;
            tg_v16 o = f[j] + bv;
            for (int q = 0, bi = 0; q < s->npost; q++) {
                const tg_post *p = &s->posts[q];
                o = tg_wino_post(p, p->binary == 1 ? post[bi] : NULL, to, o, kw, n, k0, yy, xx);
                bi += p->binary == 1;
            }
            if (kw == TG_WINO_V) *(tg_v16 *)to = o;
            else memcpy(to, &o, (size_t)kw * sizeof(float));
        }
    }
}

/* `bias` NULL where the convolution has none; `post`: the binary post-ops' operands, in order.
 * Tiles go in chunks of tb, each through all three stages before the next: a chunk's V and M
 * stay in cache between the transforms and the GEMMs (at batch 8, 56x56x64 makes 29 MB of them). */
int tg_wino_run(tg_prim *g, const void *src, const void *bias, void *dst, void *const *post) {
    tg_wino *s = g->wino;
    float *v = s->arena ? g->wei_arena : g->tmp_in;
    if (!v) TG_FAIL("a Winograd convolution was run without its scratch");
    int64_t cb = (s->c + TG_WINO_V - 1) / TG_WINO_V, kb = (s->k + TG_WINO_V - 1) / TG_WINO_V;
    for (int64_t t0 = 0; t0 < s->tiles; t0 += s->tb) {
        int64_t nt = s->tiles - t0 < s->tb ? s->tiles - t0 : s->tb, vs = nt * s->c, ms = nt * s->k;
        float *m = v + 36 * vs;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < nt * cb; i++) {
            int64_t c0 = i % cb * TG_WINO_V;
            tg_wino_input(s, src, v, vs, t0 + i / cb, t0, c0, (int)(s->c - c0 < TG_WINO_V ? s->c - c0 : TG_WINO_V));
        }
        if (tg_prim_run(nt == s->tb ? &s->mm : &s->tail, v, s->u, NULL, m, NULL)) return 1;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < nt * kb; i++) {
            int64_t k0 = i % kb * TG_WINO_V;
            tg_wino_output(s, m, ms, bias, dst, post, t0 + i / kb, t0, k0,
                           (int)(s->k - k0 < TG_WINO_V ? s->k - k0 : TG_WINO_V));
        }
    }
    __atomic_add_fetch(&tg_wino_runs, 1, __ATOMIC_RELAXED);
    return 0;
}

/* The floats of V and M a chunk of tb tiles needs (onednn.py's winograd_floats reserves as many). */
static int64_t tg_wino_floats(int64_t tb, int64_t c, int64_t k) { return 36 * tb * (c + k) + TG_WINO_V; }

/* The 36 GEMMs over a chunk of nt tiles: V [36][nt][C] x U [36][C][K] -> M [36][nt][K], U packed
 * once into s->pack (a second primitive takes that packed copy where its kernel reads it so).
 * Grouped, 36 x groups GEMMs in one batched matmul: group g's [nt][C/groups] columns of V times
 * U [36][g][C/groups][K/groups] into its [nt][K/groups] columns of M (V and M lie as ungrouped). */
static int tg_wino_gemms(tg_wino *s, tg_prim *mm, int64_t nt, float *u) {
    const int64_t g = s->groups, cg = s->c / g, kg = s->k / g;
    const int types[] = {dnnl_f32, dnnl_f32, dnnl_f32};
    if (g == 1) { /* (no dim of 1 for the groups: oneDNN's kernels are chosen by the strides of every dim) */
        const int64_t ad[] = {36, nt, s->c}, as[] = {nt * s->c, s->c, 1};
        const int64_t bd[] = {36, s->c, s->k}, bs[] = {s->c * s->k, s->k, 1};
        const int64_t cd[] = {36, nt, s->k}, cs[] = {nt * s->k, s->k, 1};
        return tg_matmul_create(mm, 3, ad, as, bd, bs, cd, cs, types, 0, u, &s->pack, 0, NULL, 0);
    }
    const int64_t ad[] = {36, g, nt, cg}, as[] = {nt * s->c, cg, s->c, 1};
    const int64_t bd[] = {36, g, cg, kg}, bs[] = {s->c * kg, cg * kg, kg, 1};
    const int64_t cd[] = {36, g, nt, kg}, cs[] = {nt * s->k, kg, s->k, 1};
    return tg_matmul_create(mm, 4, ad, as, bd, bs, cd, cs, types, 0, u, &s->pack, 0, NULL, 0);
}

/* Whether this path computes the convolution (else oneDNN's does): the dims, the precision,
 * f32 channels-last operands, and post-ops it applies itself. Chaining (tg_conv_create) asks
 * nothing of it at f32: it writes its result where the caller's strides put it, which a chained
 * reader takes as unchained (tg_out_md has no oneDNN result to report), and it reads a chained
 * source that its producer left in those strides (oneDNN's channels-last); a source in another
 * layout sends the convolution to oneDNN. (`stream` changes nothing at f32.) */
static int tg_wino_takes(int nd, const int64_t *x_dims, const int64_t *x_str, int w_nd, const int64_t *w_dims,
                         const int64_t *y_dims, const int64_t *y_str, const int64_t *strides,
                         const int64_t *dilations, const int64_t *pads, const void *weight, int npost,
                         const tg_post *posts, const tg_prim *from) {
    /* (grouped: the weight's dims are groups, K / groups, C / groups, 3, 3) */
    const int64_t *win = w_dims + w_nd - 2;
    const int64_t groups = w_nd == 5 ? w_dims[0] : 1;
    if (nd != 4 || (w_nd != 4 && w_nd != 5) || win[0] != 3 || win[1] != 3 ||
        groups * w_dims[w_nd - 3] != x_dims[1] || groups * w_dims[w_nd - 4] != y_dims[1] || !weight ||
        tg_fpmath != dnnl_fpmath_mode_strict || (x_dims[1] > 1 && x_str[1] != 1) ||
        (y_dims[1] > 1 && y_str[1] != 1) || npost > TG_MAX_POST)
        return 0;
    for (int i = 0; i < 2; i++)
        if (strides[i] != 1 || dilations[i] != 1 || pads[i] < 0 || pads[i] > 2 || pads[i + 2] < 0 || pads[i + 2] > 2 ||
            y_dims[2 + i] != x_dims[2 + i] + pads[i] + pads[i + 2] - 2)
            return 0;
    for (int i = 0; i < npost; i++)
        if (posts[i].binary == 1 ? posts[i].nd > 4 || (posts[i].alg != dnnl_binary_add &&
                                                      posts[i].alg != dnnl_binary_mul && posts[i].alg != dnnl_binary_sub)
                                 : !posts[i].binary && posts[i].alg != dnnl_eltwise_relu &&
                                       posts[i].alg != dnnl_eltwise_clip && posts[i].alg != dnnl_eltwise_linear)
            return 0;
    return tg_reads_plain(from, nd, x_dims, x_str);
}

/* tg_conv_create's arguments, and `scratch`: the floats of arena scratch the emitter reserved
 * for the step (tg_prim_scratch passes it each run) where its rule chose Winograd for this
 * shape, else 0 (tg_set_winograd may overrule the rule; the binding then has its own). */
int tg_wino_create(tg_prim *g, int nd, const int64_t *x_dims, const int64_t *x_str, int w_nd,
                   const int64_t *w_dims, const int64_t *w_str, const int64_t *y_dims, const int64_t *y_str,
                   int has_bias, const int64_t *strides, const int64_t *dilations, const int64_t *pads,
                   const void *weight, tg_packed *pack, int npost, const tg_post *posts, const tg_prim *from,
                   int chain_out, int stream, int64_t scratch) {
    if (tg_wino_mode == -2) tg_wino_mode = getenv("TG_WINOGRAD") && !strcmp(getenv("TG_WINOGRAD"), "0") ? 0 : -1;
    if (!(tg_wino_mode < 0 ? scratch > 0 : tg_wino_mode) ||
        !tg_wino_takes(nd, x_dims, x_str, w_nd, w_dims, y_dims, y_str, strides, dilations, pads, weight, npost,
                       posts, from))
        return tg_conv_create(g, nd, x_dims, x_str, w_nd, w_dims, w_str, y_dims, y_str, has_bias, strides,
                              dilations, pads, weight, pack, npost, posts, from, chain_out, stream, 0);
    if (tg_runtime_init()) return 1;
    tg_wino *s = calloc(1, sizeof *s);
    if (!s) TG_FAIL("out of memory for a Winograd convolution");
    g->wino = s;
    g->has_bias = has_bias;
    s->n = x_dims[0], s->c = x_dims[1], s->h = x_dims[2], s->w = x_dims[3], s->k = y_dims[1];
    s->oh = y_dims[2], s->ow = y_dims[3], s->pt = pads[0], s->pl = pads[1], s->groups = w_nd == 5 ? w_dims[0] : 1;
    s->th = (s->oh + 3) / 4, s->tw = (s->ow + 3) / 4, s->tiles = s->n * s->th * s->tw;
    for (int i = 0; i < 4; i++) s->xs[i] = x_str[i], s->ys[i] = y_str[i];
    s->npost = npost;
    memcpy(s->posts, posts, (size_t)npost * sizeof *posts);
    /* B of the 36 (x groups) GEMMs: U[p][gi][c][k], point p of G g G^T for output channel k and
     * input channel c of group gi */
    const int64_t cg = s->c / s->groups, kg = s->k / s->groups, *ws = w_str + w_nd - 4;
    float *u = malloc((size_t)36 * s->c * kg * sizeof(float));
    double t[36];
    if (!u) TG_FAIL("out of memory transforming a Winograd convolution's weight");
    for (int64_t gi = 0; gi < s->groups; gi++)
        for (int64_t k = 0; k < kg; k++)
            for (int64_t c = 0; c < cg; c++) {
                tg_wino_filter((const float *)weight + (w_nd == 5 ? gi * w_str[0] : 0) + k * ws[0] + c * ws[1], ws[2],
                               ws[3], t);
                for (int p = 0; p < 36; p++) u[((p * s->groups + gi) * cg + c) * kg + k] = (float)t[p];
            }
    /* chunks of as many tiles as the emitter's scratch holds (all, in a binding's own scratch) */
    s->arena = scratch >= tg_wino_floats(1, s->c, s->k);
    s->tb = s->arena ? (scratch - TG_WINO_V) / (36 * (s->c + s->k)) : s->tiles;
    s->tb = s->tb < s->tiles ? s->tb : s->tiles;
    size_t used = strlen(tg_prim_lines);
    int count = tg_prims, rc = tg_wino_gemms(s, &s->mm, s->tb, u);
    if (!rc && s->tiles % s->tb) rc = tg_wino_gemms(s, &s->tail, s->tiles % s->tb, u);
    if (rc || (s->mm.wei_handle && (!s->tail.prim || s->tail.wei_handle))) free(u);
    else s->u = u; /* (a primitive reads U as it lies) */
    if (rc) return 1;
    if (strlen(tg_prim_lines) > used) tg_prim_lines[used] = 0; /* (reported below as the convolution it is) */
    tg_prims = count;
    const_dnnl_primitive_desc_t pd = NULL, tail = NULL;
    dnnl_primitive_get_primitive_desc(s->mm.prim, &pd);
    if (s->tail.prim) dnnl_primitive_get_primitive_desc(s->tail.prim, &tail);
    if (!pd || tg_is_ref(pd) || (tail && tg_is_ref(tail))) { /* no fast GEMM for it: oneDNN's convolution */
        tg_prim_destroy(g);
        return tg_conv_create(g, nd, x_dims, x_str, w_nd, w_dims, w_str, y_dims, y_str, has_bias, strides,
                              dilations, pads, weight, pack, npost, posts, from, chain_out, stream, 0);
    }
    char line[256];
    int n = snprintf(line, sizeof line, "convolution of a %lldx%lldx%lldx%lld source: winograd F(4x4,3x3), 36 x %lld "
                     "GEMMs on %s, %lld tiles a chunk\n", (long long)s->n, (long long)s->c, (long long)s->h,
                     (long long)s->w, (long long)s->groups, tg_impl(pd), (long long)s->tb);
    n = n < (int)sizeof line ? n : (int)sizeof line - 1;
    if (used + n >= sizeof tg_prim_lines) used = 0;
    memcpy(tg_prim_lines + used, line, (size_t)n + 1);
    tg_prims++;
    if (!s->arena) { /* (no arena scratch from the emitter, or too little: the binding's own) */
        size_t bytes = (size_t)tg_wino_floats(s->tb, s->c, s->k) * sizeof(float);
        g->tmp_in = tg_alloc_big(bytes);
        if (!g->tmp_in) TG_FAIL("out of memory for a Winograd convolution's scratch (%zu bytes)", bytes);
        g->own_bytes += bytes;
    }
    return 0;
}

void tg_wino_free(tg_wino *s) {
    tg_prim_destroy(&s->mm);
    tg_prim_destroy(&s->tail);
    free(s->pack.data);
    free(s->u);
    if (s->pack.md) dnnl_memory_desc_destroy(s->pack.md);
    free(s);
}
