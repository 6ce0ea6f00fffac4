/* Convolutions on oneDNN: channels-last, chained between convolutions, or blocked
 * (nChw16c/nChw8c) inside a chain. Compiled into the runtime after runtime.c, whose
 * primitive helpers (tg_prim_create, tg_md, the reorders) it uses (build.py). */

/* --- convolution: NC<spatial> activations, (G)OI<spatial> weights --- */

typedef struct {
    dnnl_memory_desc_t src, dst, bias; /* src, dst first: tg_io */
    dnnl_dims_t strides, dilates, pad_l, pad_r;
} tg_conv_ctx;

static dnnl_status_t tg_conv_pd(dnnl_primitive_desc_t *pd, const void *ctx, const_dnnl_memory_desc_t wei,
                                const_dnnl_primitive_attr_t attr) {
    const tg_conv_ctx *c = ctx;
    return dnnl_convolution_forward_primitive_desc_create(pd, tg_engine, dnnl_forward_inference,
                                                          dnnl_convolution_direct, c->src, wei, c->bias, c->dst,
                                                          c->strides, c->dilates, c->pad_l, c->pad_r, attr);
}

/* The layout `g` leaves its result in, in the caller's buffer. */
static const_dnnl_memory_desc_t tg_out_md(const tg_prim *g) {
    const_dnnl_memory_desc_t md = NULL;
    if (!g->prim || dnnl_memory_get_memory_desc(g->re_dst ? g->user_dst : g->dst, &md) != dnnl_success) return NULL;
    return md;
}

/* Whether a convolution whose source `from` wrote (NULL: none) finds it in the emitter's f32
 * strides (x_dims, x_str), as the paths that read the source as it lies (winograd.c,
 * strided_conv.c) need: a producer that left oneDNN's own layout there sends them to oneDNN. */
static int tg_reads_plain(const tg_prim *from, int nd, const int64_t *x_dims, const int64_t *x_str) {
    const_dnnl_memory_desc_t chained = from ? tg_out_md(from) : NULL;
    if (!chained) return 1;
    dnnl_memory_desc_t plain = tg_md(nd, x_dims, x_str, dnnl_f32);
    int same = plain && dnnl_memory_desc_equal(chained, plain);
    if (plain) dnnl_memory_desc_destroy(plain);
    return same;
}

/* Whether a chained attempt (tg_conv_create) gave what chaining is for: a kernel other
 * than ref, a result that fits the caller's buffer of `capacity` bytes and, at bf16, one
 * written in bf16 by a bf16 x bf16 kernel. */
static int tg_chain_ok(const tg_prim *g, int chain_out, size_t capacity) {
    const_dnnl_primitive_desc_t pd = NULL;
    if (dnnl_primitive_get_primitive_desc(g->prim, &pd) != dnnl_success || tg_is_ref(pd)) return 0;
    if (!chain_out) return 1;
    const_dnnl_memory_desc_t out = tg_out_md(g), wmd = NULL;
    dnnl_data_type_t dt = dnnl_data_type_undef, wt = dnnl_data_type_undef;
    if (!out || dnnl_memory_desc_get_size(out) > capacity ||
        dnnl_memory_get_memory_desc(g->wei, &wmd) != dnnl_success)
        return 0;
    dnnl_memory_desc_query(out, dnnl_query_data_type, &dt);
    dnnl_memory_desc_query(wmd, dnnl_query_data_type, &wt);
    return tg_fpmath == dnnl_fpmath_mode_bf16 && chain_out != 2 ? dt == dnnl_bf16 && wt == dnnl_bf16 : dt == dnnl_f32;
}

/* A convolution computed in oneDNN's blocked layout nChw<block>c (tg_conv_create's `block`),
 * source and result alike (its blocked kernels take no other pairing): the source is taken
 * as its producer left it where that is this layout (a chained blocked producer), else
 * reordered into it in a scratch of the primitive's own; the result stays blocked in the
 * caller's buffer where only chained blocked convolutions read it (`keep`), else it is
 * reordered out into the caller's layout. Returns 0 when it took this path, else 1 with `g`
 * cleared (the caller makes it channels-last): a reference kernel, a reorder or a relayout
 * oneDNN asked for, a post-op reading the destination's own layout. */
static int tg_conv_blocked(tg_prim *g, tg_conv_ctx *ctx, int nd, const int64_t *x_dims, const int64_t *y_dims,
                           int block, const_dnnl_memory_desc_t user_x, const_dnnl_memory_desc_t plain_y, int keep,
                           const_dnnl_memory_desc_t wei, const void *weight, tg_packed *pack, int npost,
                           const tg_post *posts, int w_nd, const int64_t *w_dims) {
    dnnl_memory_desc_t bx = NULL, by = NULL;
    dnnl_dims_t xd, yd;
    int has_bias = g->has_bias, rc = 1, sum = 0;
    for (int i = 0; i < npost; i++) {
        if (posts[i].binary && posts[i].binary != TG_POST_SUM) return 1;
        sum |= posts[i].binary == TG_POST_SUM;
    }
    keep = keep && !sum; /* (a buffer two convolutions write is never chained) */
    for (int i = 0; i < nd; i++) xd[i] = x_dims[i], yd[i] = y_dims[i];
    dnnl_format_tag_t tag = block == 16 ? dnnl_aBcd16b : dnnl_aBcd8b;
    if (nd == 4 && (block == 8 || block == 16) &&
        dnnl_memory_desc_create_with_tag(&bx, nd, xd, dnnl_f32, tag) == dnnl_success &&
        dnnl_memory_desc_create_with_tag(&by, nd, yd, dnnl_f32, tag) == dnnl_success) {
        ctx->src = bx;
        ctx->dst = by;
        rc = tg_prim_create(g, tg_conv_pd, ctx, sizeof *ctx, wei, weight, pack, npost, posts, w_nd, w_dims, 0, 0);
        const_dnnl_primitive_desc_t pd = NULL;
        /* (tg_relayout's reorders, where oneDNN had only ref for these layouts: not this path) */
        if (!rc && (g->re_src || g->re_dst || dnnl_primitive_get_primitive_desc(g->prim, &pd) != dnnl_success ||
                    tg_is_ref(pd)))
            rc = 1;
        if (!rc && keep && dnnl_memory_desc_get_size(by) > dnnl_memory_desc_get_size(plain_y)) keep = 0;
        if (!rc && !dnnl_memory_desc_equal(user_x, bx))
            rc = tg_reorder_step(&g->re_src, &g->user_src, &g->tmp_src, &g->own_bytes, user_x, bx, 1, 0);
        if (!rc && !keep)
            rc = tg_reorder_step(&g->re_dst, &g->user_dst, &g->tmp_dst, &g->own_bytes, plain_y, by, 0, 0);
        if (!rc && sum) { /* (what it adds to, into the blocked scratch first) */
            dnnl_primitive_desc_t rpd = NULL;
            rc = dnnl_reorder_primitive_desc_create(&rpd, plain_y, tg_engine, by, tg_engine, NULL) != dnnl_success ||
                 dnnl_primitive_create(&g->re_acc, rpd) != dnnl_success;
            if (rpd) dnnl_primitive_desc_destroy(rpd);
        }
        if (!rc) tg_log_primitive(pd, user_x, block == 16 ? (keep ? " (nChw16c, kept)" : " (nChw16c)")
                                                           : (keep ? " (nChw8c, kept)" : " (nChw8c)"));
    }
    if (rc) {
        tg_prim_destroy(g);
        g->has_bias = has_bias;
    }
    if (bx) dnnl_memory_desc_destroy(bx);
    if (by) dnnl_memory_desc_destroy(by);
    return rc;
}

/* w_dims/w_str: OI<spatial> (groups == 1) or GOI<spatial>; dilations in torch's
 * convention (1 = dense), oneDNN's is one less.
 *
 * Chaining: `from` is the convolution that wrote this one's source, when the emitter found
 * that only convolutions read that buffer (onednn.py, chain_convolutions), and `chain_out`
 * says the same of this one's result (2: some reader computes in f32, a depthwise one). Such a buffer holds what its producer's kernel
 * writes as it lies: at bf16 its bf16 result (no conversion to f32 and back between the
 * two), at f32 the layout oneDNN prefers (format `any`; channels-last on the processors
 * oneDNN 3.2 has brgemm kernels for). Where the chained form gets no fast kernel, or the
 * result would not fit the buffer, the convolution is made as unchained, and a chained
 * source it cannot read is reordered into the f32 layout first.
 *
 * `stream`: the source (1) and/or the result (2) lie in a buffer that several convolutions
 * write (ResNet's blocks add into their shortcut's buffer, a sum post-op) and only
 * convolutions read (onednn.py, chain_convolutions). At bf16 such a buffer holds bf16 in the
 * emitter's strides, for every writer and reader alike, so its reader converts nothing and
 * its writers write half the bytes (the sum post-op reads it in bf16 too). A writer has no
 * f32 fallback (the buffer's readers take it as bf16): its bf16 kernel is taken even where
 * it is oneDNN's reference one (reported as such). At f32 the flags change nothing.
 *
 * `block`: 0, or 8 or 16 where the emitter's rule (ir/hardware.blocked_conv) found oneDNN's
 * blocked kernels faster for this shape: at f32 it computes in nChw<block>c (tg_conv_blocked),
 * a chained result (`chain_out`) left blocked for its readers, which the emitter marks only
 * where every one of them is blocked too. */
int tg_conv_create(tg_prim *g, int nd, const int64_t *x_dims, const int64_t *x_str, int w_nd,
                   const int64_t *w_dims, const int64_t *w_str, const int64_t *y_dims, const int64_t *y_str,
                   int has_bias, const int64_t *strides, const int64_t *dilations, const int64_t *pads,
                   const void *weight, tg_packed *pack, int npost, const tg_post *posts, const tg_prim *from,
                   int chain_out, int stream, int block) {
    tg_conv_ctx ctx;
    int sp = nd - 2, rc = 1;
    if (tg_check_ranks("convolution", nd, 3, w_nd, npost, posts)) return 1;
    if (tg_runtime_init()) return 1;
    /* At precision bf16 a depthwise convolution stays f32: oneDNN 3.2 has no AMX kernel for
     * it, and its AVX-512 BF16 one (brdgmm_dw:avx512_core_bf16) took about twice the f32
     * kernel's time on every depthwise shape of MobileNetV2 and EfficientNet-B0. */
    dnnl_fpmath_mode_t precision = tg_fpmath;
    if (w_nd == nd + 1 && w_dims[1] == 1 && w_dims[2] == 1) tg_fpmath = dnnl_fpmath_mode_strict;
    dnnl_memory_desc_t plain_x = tg_md(nd, x_dims, x_str, dnnl_f32), plain_y = tg_md(nd, y_dims, y_str, dnnl_f32);
    dnnl_memory_desc_t wei = tg_md(w_nd, w_dims, w_str, dnnl_f32), chain_y = NULL;
    ctx.bias = NULL;
    if (has_bias) {
        int64_t o = y_dims[1], one = 1;
        ctx.bias = tg_md(1, &o, &one, dnnl_f32);
    }
    for (int i = 0; i < sp; i++) {
        ctx.strides[i] = strides[i];
        ctx.dilates[i] = dilations[i] - 1;
        ctx.pad_l[i] = pads[i];
        ctx.pad_r[i] = pads[i + sp];
    }
    if (!plain_x || !plain_y || !wei || (has_bias && !ctx.bias)) {
        tg_fpmath = precision;
        TG_FAIL("oneDNN rejected a convolution operand's layout");
    }
    g->has_bias = has_bias;
    int bf16_stream = tg_fpmath == dnnl_fpmath_mode_bf16 ? stream : 0; /* (never for a depthwise one, the emitter's rule) */
    dnnl_memory_desc_t stream_x = bf16_stream & 1 ? tg_md(nd, x_dims, x_str, dnnl_bf16) : NULL;
    const_dnnl_memory_desc_t chained = stream_x ? stream_x : from ? tg_out_md(from) : NULL;
    if (chained) { /* (the producer's result has this source's dims, or it is not taken as chained) */
        int cn = 0;
        const dnnl_dims_t *cd = NULL;
        dnnl_memory_desc_query(chained, dnnl_query_ndims_s32, &cn);
        dnnl_memory_desc_query(chained, dnnl_query_dims, &cd);
        for (int i = 0; i < nd && cn == nd && cd; i++) cn = (*cd)[i] == x_dims[i] ? cn : -1;
        if (cn != nd) chained = NULL;
    }
    if (block && precision == dnnl_fpmath_mode_strict && !bf16_stream)
        rc = tg_conv_blocked(g, &ctx, nd, x_dims, y_dims, block, chained ? chained : plain_x, plain_y, chain_out,
                             wei, weight, pack, npost, posts, w_nd, w_dims);
    int blocked = !rc; /* (its own line in the primitives' listing) */
    if (blocked) {
    } else if (bf16_stream & 2) {
        chain_y = tg_md(nd, y_dims, y_str, dnnl_bf16);
        ctx.src = (dnnl_memory_desc_t)(chained ? chained : plain_x);
        ctx.dst = chain_y;
        if (!chain_y || tg_prim_create(g, tg_conv_pd, &ctx, sizeof ctx, wei, weight, pack, npost, posts, w_nd, w_dims,
                                       0, 0)) {
            tg_fpmath = precision;
            if (stream_x) dnnl_memory_desc_destroy(stream_x);
            dnnl_memory_desc_destroy(plain_x);
            dnnl_memory_desc_destroy(plain_y);
            if (chain_y) dnnl_memory_desc_destroy(chain_y);
            if (ctx.bias) dnnl_memory_desc_destroy(ctx.bias);
            dnnl_memory_desc_destroy(wei);
            TG_FAIL("oneDNN has no bf16 convolution to write a bf16 activation buffer");
        }
        rc = 0;
    } else if (chain_out) {
        size_t numel = 1;
        for (int i = 0; i < nd; i++) numel *= (size_t)y_dims[i];
        chain_y = tg_fpmath == dnnl_fpmath_mode_bf16 && chain_out != 2 ? tg_md(nd, y_dims, y_str, dnnl_bf16)
                                                                       : tg_md_any(nd, y_dims, dnnl_f32);
        ctx.src = (dnnl_memory_desc_t)(chained ? chained : plain_x);
        ctx.dst = chain_y;
        if (chain_y) rc = tg_prim_create(g, tg_conv_pd, &ctx, sizeof ctx, wei, weight, pack, npost, posts, w_nd,
                                         w_dims, 0, 0);
        if (!rc && !tg_chain_ok(g, chain_out, numel * sizeof(float))) rc = 1;
    } else if (chained && !dnnl_memory_desc_equal(chained, plain_x)) {
        ctx.src = (dnnl_memory_desc_t)chained;
        ctx.dst = plain_y;
        rc = tg_prim_create(g, tg_conv_pd, &ctx, sizeof ctx, wei, weight, pack, npost, posts, w_nd, w_dims, 0, 0);
        if (!rc && !tg_chain_ok(g, 0, 0)) rc = 1;
    }
    if (rc) { /* unchained (or the chained form failed): the caller's f32 layouts */
        tg_prim_destroy(g);
        g->has_bias = has_bias;
        ctx.src = plain_x;
        ctx.dst = plain_y;
        rc = tg_prim_create(g, tg_conv_pd, &ctx, sizeof ctx, wei, weight, pack, npost, posts, w_nd, w_dims, 0, 0);
        if (!rc && chained && !dnnl_memory_desc_equal(chained, plain_x)) {
            rc = tg_reorder_step(&g->re_in, &g->in_from, &g->tmp_in, &g->own_bytes, chained, plain_x, 1, 0);
            if (!rc && dnnl_memory_create(&g->in_to, plain_x, tg_engine, DNNL_MEMORY_NONE) != dnnl_success) {
                snprintf(tg_err, sizeof tg_err, "oneDNN memory_create failed");
                rc = 1;
            }
        }
    }
    if (!rc && !blocked) tg_log_prim(g, ctx.src);
    tg_fpmath = precision;
    dnnl_memory_desc_destroy(plain_x);
    dnnl_memory_desc_destroy(plain_y);
    if (chain_y) dnnl_memory_desc_destroy(chain_y);
    if (stream_x) dnnl_memory_desc_destroy(stream_x);
    if (ctx.bias) dnnl_memory_desc_destroy(ctx.bias);
    dnnl_memory_desc_destroy(wei);
    return rc;
}
