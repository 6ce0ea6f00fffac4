/* tilegraph C backend: a matmul of one row by a constant weight (a fully connected layer at
 * batch 1, an image model's head), y[N] = x[K] @ W[K, N], then its post-ops.
 *
 * Such a GEMM does two flops per weight it reads once: its time is the weight's read from
 * memory. oneDNN's GEMM kernels, made for blocks of rows, read it at a fraction of the
 * processor's bandwidth on one row (ir/hardware.gemv_wins has the measurements). Here W is packed
 * once at creation into panels of TG_GEMV_W columns, each panel K rows of its columns back to
 * back ([panel][K][width]), so a panel is one sequential stream the hardware prefetcher runs
 * ahead of; the panel's sums stay in registers over all of K, and threads take whole panels.
 *
 * Called through tg_gemv_create, which the emitter asks for where ir/hardware.gemv_wins says
 * (backends/c/onednn.py); anything this path does not take (a source of more than one row,
 * bf16 operands, a post-op it does not apply) is made as tg_matmul_create makes it. */

#define TG_GEMV_V 16                 /* f32 lanes of a tg_gv16 */
#define TG_GEMV_W (4 * TG_GEMV_V)    /* columns of a panel: 4 vectors of sums, in two sets = 8 chains */

/* Weights (K x N floats) from which threads split the panels: a fork costs a few microseconds, the
 * read of 1 MB from memory at one core's ~20 GB/s about 50 (smaller ones, a squeeze-excitation's,
 * measured faster on one thread than oneDNN on two: benchmarks/gemv_heads.py --threads 2). */
#define TG_GEMV_PARALLEL_MIN (1 << 18)

typedef float tg_gv16 __attribute__((vector_size(64), aligned(4), may_alias));

/* -1: the emitter's choice, 0: never (oneDNN's matmul), 1: every one-row matmul this path takes.
 * TG_GEMV=0 in the environment starts it at 0, for a whole model's A/B. */
static int tg_gemv_mode = -2; /* (-2: not read from the environment yet) */
void tg_set_gemv(int mode) { tg_gemv_mode = mode; }
/* One-row matmuls run so far on this path (tests check it is taken). */
static int tg_gemv_runs;
int tg_gemv_count(void) { return __atomic_load_n(&tg_gemv_runs, __ATOMIC_RELAXED); }

struct tg_gemv {
    int64_t k, n, xs, ys;  /* x's stride along K, y's along N */
    int64_t col;           /* dims after the column's in the destination (a post-op's operand aligns on the right) */
    int has_bias;
    float *w;              /* the panels: ceil(N / TG_GEMV_W) of K x width, the last one's width rounded up to TG_GEMV_V */
    float *x;              /* x gathered where it is strided (K floats), else NULL */
    int npost;
    tg_post posts[TG_MAX_POST];
};

/* The sums of one panel of `nv` vectors over all of K: its quarters of K read side by side (four
 * sequential streams keep more of the weight's reads from memory in flight than one: ~10% more
 * bandwidth on one core, the same from cache), into two sets of sums. */
static inline __attribute__((always_inline)) void tg_gemv_panel(const float *x, const float *w, int64_t k,
                                                                const int nv, tg_gv16 *out) {
    tg_gv16 a[4] = {{0}}, b[4] = {{0}};
    const int64_t width = (int64_t)nv * TG_GEMV_V, q = k / 4;
    for (int64_t i = 0; i < q; i++) {
        const float x0 = x[i], x1 = x[i + q], x2 = x[i + 2 * q], x3 = x[i + 3 * q];
        const tg_gv16 *r0 = (const tg_gv16 *)(w + i * width), *r1 = (const tg_gv16 *)(w + (i + q) * width);
        const tg_gv16 *r2 = (const tg_gv16 *)(w + (i + 2 * q) * width), *r3 = (const tg_gv16 *)(w + (i + 3 * q) * width);
        for (int v = 0; v < nv; v++) {
            a[v] += x0 * r0[v] + x2 * r2[v];
            b[v] += x1 * r1[v] + x3 * r3[v];
        }
    }
    for (int64_t i = 4 * q; i < k; i++) {
        const tg_gv16 *r = (const tg_gv16 *)(w + i * width);
        for (int v = 0; v < nv; v++) a[v] += x[i] * r[v];
    }
    for (int v = 0; v < nv; v++) out[v] = a[v] + b[v];
}

/* A post-op on the value of column j, as oneDNN applies it (tg_gemv_takes lists those). */
static inline float tg_gemv_post(const tg_post *p, const float *operand, int64_t col, int64_t j, float o) {
    if (p->binary) {
        int64_t d = p->nd - 1 - col; /* (a dim of 1 there, or none: one value for every column) */
        float b = operand[d >= 0 && p->dims[d] != 1 ? j * p->strides[d] : 0];
        return p->alg == dnnl_binary_add ? o + b : p->alg == dnnl_binary_mul ? o * b : o - b;
    }
    switch (p->alg) {
    case dnnl_eltwise_relu: return o > 0.f ? o : o * p->alpha; /* (NaN kept) */
    case dnnl_eltwise_clip: return o < p->alpha ? p->alpha : o > p->beta ? p->beta : o;
    case dnnl_eltwise_linear: return p->alpha * o + p->beta;
    case dnnl_eltwise_hardswish: {
        float t = p->alpha * o + p->beta;
        return o * (t < 0.f ? 0.f : t > 1.f ? 1.f : t);
    }
    case dnnl_eltwise_logistic: return tg_sigmoid(o);
    case dnnl_eltwise_swish: return o * tg_sigmoid(p->alpha * o);
    case dnnl_eltwise_tanh: return tg_tanhf(o);
    case dnnl_eltwise_gelu_tanh: return tg_gelu_tanh(o);
    default: return tg_expf(o); /* dnnl_eltwise_exp (tg_gemv_takes) */
    }
}

static int tg_gemv_alg(const tg_post *p) {
    if (p->binary == 1)
        return p->nd >= 1 && p->nd <= TG_MAX_DIMS &&
               (p->alg == dnnl_binary_add || p->alg == dnnl_binary_mul || p->alg == dnnl_binary_sub);
    const int algs[] = {dnnl_eltwise_relu, dnnl_eltwise_clip, dnnl_eltwise_linear, dnnl_eltwise_hardswish,
                        dnnl_eltwise_logistic, dnnl_eltwise_swish, dnnl_eltwise_tanh, dnnl_eltwise_gelu_tanh,
                        dnnl_eltwise_exp};
    for (int i = 0; i < (int)(sizeof algs / sizeof *algs); i++)
        if (!p->binary && p->alg == algs[i]) return 1;
    return 0; /* (gelu's erf form: the module's own polynomial; a sum: never asked of a matmul) */
}

/* Whether this path computes the matmul: f32, a constant weight, one row (every batch dim 1),
 * post-ops it applies, and f32 arithmetic asked for (not oneDNN's bf16 mode). */
static int tg_gemv_takes(int nd, const int64_t *a_dims, const int64_t *b_dims, const int64_t *b_str,
                         const int64_t *c_dims, const int *types, int scaled, const void *weight, int npost,
                         const tg_post *posts) {
    if (!weight || scaled || tg_bf16_on() || nd < 2 || nd > TG_MAX_DIMS || npost > TG_MAX_POST)
        return 0;
    for (int i = 0; i < 3; i++)
        if (types[i] != dnnl_f32) return 0;
    for (int i = 0; i < nd - 1; i++)
        if (a_dims[i] != 1 || c_dims[i] != 1 || (i < nd - 2 && b_dims[i] != 1)) return 0;
    if (a_dims[nd - 1] < 1 || b_dims[nd - 1] < 1 || b_str[nd - 2] < 0 || b_str[nd - 1] < 0) return 0;
    for (int i = 0; i < npost; i++)
        if (!tg_gemv_alg(&posts[i])) return 0;
    return 1;
}

/* `bias`: N floats, or NULL where there is none; `post`: the binary post-ops' operands, in order. */
int tg_gemv_run(tg_prim *g, const void *src, const void *bias, void *dst, void *const *post) {
    tg_gemv *s = g->gemv;
    const float *bs = s->has_bias ? bias : NULL;
    const float *x = src;
    if (s->x) {
        for (int64_t i = 0; i < s->k; i++) s->x[i] = x[i * s->xs];
        x = s->x;
    }
    const int64_t panels = (s->n + TG_GEMV_W - 1) / TG_GEMV_W;
    float *y = dst;
#pragma omp parallel for schedule(static) if (panels > 1 && s->k * s->n >= TG_GEMV_PARALLEL_MIN)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * TG_GEMV_W, cols = s->n - n0 < TG_GEMV_W ? s->n - n0 : TG_GEMV_W;
        const int nv = (int)((cols + TG_GEMV_V - 1) / TG_GEMV_V);
        const float *w = s->w + n0 * s->k; /* (every panel before is TG_GEMV_W wide) */
        tg_gv16 sums[4];
        switch (nv) { /* (a constant count each: the compiler keeps the sums in registers) */
        case 4: tg_gemv_panel(x, w, s->k, 4, sums); break;
        case 3: tg_gemv_panel(x, w, s->k, 3, sums); break;
        case 2: tg_gemv_panel(x, w, s->k, 2, sums); break;
        default: tg_gemv_panel(x, w, s->k, 1, sums); break;
        }
        const float *o = (const float *)sums;
        for (int64_t j = 0; j < cols; j++) {
            float v = bs ? o[j] + bs[n0 + j] : o[j];
            for (int q = 0, b = 0; q < s->npost; q++) {
                const tg_post *pp = &s->posts[q];
                v = tg_gemv_post(pp, pp->binary ? post[b++] : NULL, s->col, n0 + j, v);
            }
            y[(n0 + j) * s->ys] = v;
        }
    }
    __atomic_add_fetch(&tg_gemv_runs, 1, __ATOMIC_RELAXED);
    return 0;
}

/* Packs W (K x N, `rs` between rows, `cs` between columns) into g's panels: a gemv.c primitive
 * from here on. */
static int tg_gemv_setup(tg_prim *g, int64_t k, int64_t n, int64_t xs, int64_t ys, int64_t col, const float *b,
                         int64_t rs, int64_t cs, int has_bias, int npost, const tg_post *posts) {
    tg_gemv *s = calloc(1, sizeof *s);
    if (!s) TG_FAIL("out of memory for a one-row matmul");
    g->gemv = s;
    g->has_bias = has_bias;
    s->k = k, s->n = n, s->xs = xs, s->ys = ys, s->col = col, s->has_bias = has_bias;
    s->npost = npost;
    memcpy(s->posts, posts, (size_t)npost * sizeof *posts);
    const int64_t full = n / TG_GEMV_W * TG_GEMV_W, last = (n - full + TG_GEMV_V - 1) / TG_GEMV_V * TG_GEMV_V;
    s->w = aligned_alloc(64, (size_t)((full + last) * k * (int64_t)sizeof(float) + 63) / 64 * 64);
    if (xs != 1) s->x = malloc((size_t)k * sizeof(float));
    if (!s->w || (xs != 1 && !s->x)) TG_FAIL("out of memory packing a one-row matmul's weight");
    for (int64_t n0 = 0; n0 < n; n0 += TG_GEMV_W) {
        const int64_t width = n0 < full ? TG_GEMV_W : last;
        float *panel = s->w + n0 * k;
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < width; j++)
                panel[i * width + j] = n0 + j < n ? b[i * rs + (n0 + j) * cs] : 0.f;
    }
    char line[160];
    snprintf(line, sizeof line, "%s of a 1x%lld source: gemv.c (a %lldx%lld weight)\n", col ? "convolution" : "matmul",
             (long long)k, (long long)k, (long long)n);
    tg_log_line(line);
    return 0;
}

static int tg_gemv_on(int wins) {
    if (tg_gemv_mode == -2) tg_gemv_mode = getenv("TG_GEMV") && !strcmp(getenv("TG_GEMV"), "0") ? 0 : -1;
    return tg_gemv_mode < 0 ? wins : tg_gemv_mode;
}

/* tg_matmul_create's arguments; `wins`: the emitter's rule (ir/hardware.gemv_wins) says this path
 * is faster (tg_set_gemv overrules it). */
int tg_gemv_create(tg_prim *g, int nd, const int64_t *a_dims, const int64_t *a_str, const int64_t *b_dims,
                   const int64_t *b_str, const int64_t *c_dims, const int64_t *c_str, const int *types, int scaled,
                   const void *weight, tg_packed *pack, int npost, const tg_post *posts, size_t wei_scratch,
                   int wins) {
    if (!tg_gemv_on(wins) || !tg_gemv_takes(nd, a_dims, b_dims, b_str, c_dims, types, scaled, weight, npost, posts))
        return tg_matmul_create(g, nd, a_dims, a_str, b_dims, b_str, c_dims, c_str, types, scaled, weight, pack,
                                npost, posts, wei_scratch);
    return tg_gemv_setup(g, a_dims[nd - 1], b_dims[nd - 1], a_str[nd - 1], c_str[nd - 1], 0, weight,
                         b_str[nd - 2], b_str[nd - 1], 0, npost, posts);
}

/* A 1x1 convolution of a 1x1 image (a squeeze-excitation's two), the same GEMV: tg_conv_create's
 * arguments and `wins`. Its source as the emitter lays it out (a chained producer that left
 * oneDNN's own layout there sends it to oneDNN), its result so too (for a chained reader: no
 * oneDNN layout to report, tg_out_md), f32 (not a bf16 stream), no sum into its destination. */
int tg_gemv_conv_create(tg_prim *g, int nd, const int64_t *x_dims, const int64_t *x_str, int w_nd,
                        const int64_t *w_dims, const int64_t *w_str, const int64_t *y_dims, const int64_t *y_str,
                        int has_bias, const int64_t *strides, const int64_t *dilations, const int64_t *pads,
                        const void *weight, tg_packed *pack, int npost, const tg_post *posts, const tg_prim *from,
                        int chain_out, int stream, int block, int wins) {
    int one = nd >= 3 && nd <= TG_MAX_DIMS && w_nd == nd && x_dims[0] == 1 && w_dims[1] == x_dims[1] && !stream;
    for (int i = 2; one && i < nd; i++) /* (pads: nd - 2 before, as many after) */
        one = x_dims[i] == 1 && y_dims[i] == 1 && w_dims[i] == 1 && pads[i - 2] == 0 && pads[nd - 4 + i] == 0;
    const int64_t c = x_dims[1], k = y_dims[1];
    const int64_t ad[] = {1, c}, bd[] = {c, k}, bs[] = {w_str[1], w_str[0]}, cd[] = {1, k};
    const int types[] = {dnnl_f32, dnnl_f32, dnnl_f32};
    if (!one || !tg_gemv_on(wins) || !tg_reads_plain(from, nd, x_dims, x_str) ||
        !tg_gemv_takes(2, ad, bd, bs, cd, types, 0, weight, npost, posts))
        return tg_conv_create(g, nd, x_dims, x_str, w_nd, w_dims, w_str, y_dims, y_str, has_bias, strides,
                              dilations, pads, weight, pack, npost, posts, from, chain_out, stream, block);
    return tg_gemv_setup(g, c, k, x_str[1], y_str[1], nd - 2, weight, w_str[1], w_str[0], has_bias, npost, posts);
}

void tg_gemv_free(tg_gemv *s) {
    free(s->w);
    free(s->x);
    free(s);
}
